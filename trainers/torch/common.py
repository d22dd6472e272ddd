"""What every PyTorch backend shares: shard ingest, the `TorchAdapter` the loop drives (trainers/loop.py), its
state files, and the `TorchTrainer` they run on. Backends (ddp, tp, horovod torch) differ only in how they
wrap the model and optimizer, sync gradients, and turn state into the dense form a checkpoint holds."""
from __future__ import annotations

import contextlib
import itertools
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from contract.data import MNIST_MEAN, MNIST_STD, bucketed_order, shuffled_order
from contract.metrics import AsyncReducer, PendingReduce, peak_rss_bytes
from trainers.parallel.comm import collective_device
from trainers.parallel.data_parallel import average_gradients
from trainers.parallel.memory import rank_memory
from trainers.torch_recipe import TorchRecipe, clip_dense_grad_norm, with_kernels_of
from trainers.worker import dataset_shards, loop_config, run_config, scaling_config

LOAD_BATCH = 8192  # rows per Ray Data batch when pulling a shard into memory
EVAL_BATCH = 256
STATE_FILE = "state.pt"  # {"model": dense state dict, "optimizer": dense optimizer state, "scheduler": ...}


Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor, int]  # (model inputs, labels, tokens in batch)


def place_model(model: nn.Module, device: torch.device) -> nn.Module:
    """`model` on `device`; a convolutional one in channels-last memory format, which oneDNN (and cuDNN) run
    faster: the MNIST CNN's training step is 1.9x faster on one CPU thread (NCHW max-pooling is a slow path;
    benchmarks/README.md). Horovod takes them through contiguous copies (`horovod_torch.ContiguousCompression`)."""
    if any(isinstance(m, nn.Conv2d) for m in model.modules()):
        return model.to(device, memory_format=torch.channels_last)
    return model.to(device)


def seed_dropout(seed: int, stream: int) -> None:
    """Seed the dropout masks of training, once the model is built (its initial weights come from `seed` alone).
    `stream`: the rank's data-parallel rank, so each draws its own masks, as one process would draw a fresh mask
    for every sample of the global batch; the ranks of a TP group share one (`ParallelDims.dropout_stream`), as
    dropout on their replicated activations requires. Every torch backend seeds this way, so the same `run.seed`
    trains the same model through ddp, fsdp and horovod (benchmarks/loss_parity.py)."""
    torch.manual_seed(seed + 1000 * stream)  # the offset the shard shuffle uses too (another generator)


def normalise(images: torch.Tensor) -> torch.Tensor:
    return (images.float() / 255.0 - MNIST_MEAN) / MNIST_STD


def image_batch(columns: dict[str, torch.Tensor]) -> Batch:
    return (normalise(columns["image"]),), columns["label"].long(), 0


def text_batch(columns: dict[str, torch.Tensor]) -> Batch:
    ids, lengths = columns["input_ids"].long(), columns["length"]
    mask = torch.arange(ids.shape[1], device=ids.device) < lengths[:, None]  # (B, T), True = real token
    return (ids, mask), columns["label"].long(), int(lengths.sum())


# dataset name -> (columns a worker keeps, how a batch of them becomes model inputs)
DATA_ADAPTERS = {"mnist": (("image", "label"), image_batch),
                 "imdb": (("input_ids", "length", "label", "id"), text_batch)}


class ShardBatches:
    """Batches from this worker's Ray Data shard, as (model inputs, labels, tokens).

    cache=True pulls the shard through Ray Data once and keeps it in memory in its stored dtypes
    (MNIST's 60k rows are 47 MB as uint8, IMDb's 22.5k x 256 tokens 23 MB as int32): streaming
    `read_parquet` gave only 2-9k rows/s per worker here, slower than a small MLP trains, so
    re-streaming every epoch would make ingest the bottleneck. cache=False streams from Ray Data every
    epoch (for data that does not fit in memory), in shard order. `shard`: anything with Ray's
    `iter_torch_batches` (a Ray Data shard, or a Dataset in tests). In a GPU worker Ray Data hands the
    batches over on the worker's GPU (`iter_torch_batches`' device "auto"), so the cache is in GPU memory
    and each batch is indexed there.
    """

    def __init__(self, shard: Any, dataset: str, batch_size: int, cache: bool, seed: int,
                 max_steps: int | None = None, drop_last: bool = False, bucket_by_length: bool = False,
                 trim: bool = False):
        self.columns, self.adapt = DATA_ADAPTERS[dataset]
        self.shard, self.batch_size, self.seed, self.max_steps = shard, batch_size, seed, max_steps
        self.drop_last = drop_last  # leave out an epoch's last batch if it is short (pipelines need fixed shapes)
        self.bucket_by_length = bucket_by_length  # shuffled epochs in `bucketed_order` (cached text shards)
        self.trim = trim  # cut each text batch to its longest row: the same outputs, less padding to compute
        self.cached: dict[str, torch.Tensor] | None = None
        self.load_s = 0.0
        if cache:
            start = time.perf_counter()
            parts: dict[str, list[torch.Tensor]] = {c: [] for c in self.columns}
            for batch in shard.iter_torch_batches(batch_size=LOAD_BATCH):
                for column in self.columns:
                    parts[column].append(batch[column])
            self.cached = {c: torch.cat(p) for c, p in parts.items()}
            self.load_s = time.perf_counter() - start

    @classmethod
    def from_columns(cls, columns: dict[str, torch.Tensor], dataset: str, batch_size: int, seed: int,
                     max_steps: int | None = None, drop_last: bool = False, bucket_by_length: bool = False,
                     trim: bool = False) -> "ShardBatches":
        """A shard already in memory (in-process tests, benchmarks): what caching a Ray Data shard gives."""
        batches = cls(None, dataset, batch_size, cache=False, seed=seed, max_steps=max_steps, drop_last=drop_last,
                      bucket_by_length=bucket_by_length, trim=trim)
        batches.cached = {c: columns[c] for c in batches.columns}
        return batches

    def steps(self) -> int:
        """Batches per epoch (known once cached; 0 when streaming)."""
        rows = 0 if self.cached is None else len(self.cached["label"])
        steps = rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)  # floor or ceil
        return min(steps, self.max_steps) if self.max_steps else steps

    def epoch(self, epoch: int, shuffle: bool = True, skip: int = 0) -> Iterator[Batch]:
        """The epoch's batches (a fixed order per epoch), without the first `skip` (already trained on)."""
        return itertools.islice(self._epoch(epoch, shuffle), skip, self.max_steps)

    def _epoch(self, epoch: int, shuffle: bool) -> Iterator[Batch]:
        if self.cached is None:
            for batch in self.shard.iter_torch_batches(batch_size=self.batch_size, drop_last=self.drop_last):
                yield self.adapt(self._trimmed(batch))
            return
        rows = len(self.cached["label"])
        if shuffle:
            order = shuffled_order(rows, self.seed + epoch)  # as the TF backends shuffle
            if self.bucket_by_length:
                lengths = self.cached["length"].cpu().numpy()  # the cache is on the GPU in a GPU worker
                order = bucketed_order(order, lengths, self.batch_size, self.seed + epoch)
            order = torch.from_numpy(order)
        else:
            order = torch.arange(rows)
        end = rows - rows % self.batch_size if self.drop_last else rows
        for start in range(0, end, self.batch_size):
            idx = order[start:start + self.batch_size]
            yield self.adapt(self._trimmed({c: t[idx] for c, t in self.cached.items()}))

    def _trimmed(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch with its token ids cut after its longest row's tokens, when `trim` is set. Padding is masked
        out of attention and pooling, so the model's outputs do not change."""
        if not self.trim or "length" not in batch:
            return batch
        return {**batch, "input_ids": batch["input_ids"][:, :max(int(batch["length"].max()), 1)]}

    def row_keys(self) -> torch.Tensor | None:
        """Sorted keys of the cached text rows (id * 2 + label, unique per review): which rows a rank holds."""
        if self.cached is None or "id" not in self.cached:
            return None
        return (self.cached["id"].long() * 2 + self.cached["label"].long()).sort().values.cpu()


# shuffle seed -> this rank's (train, evaluation) batches: Ray Data shards in a run, generated data in tests
TrainData = Callable[[int], "tuple[ShardBatches, ShardBatches]"]


def worker_data(cfg: Any, seed: int) -> tuple[ShardBatches, ShardBatches]:
    """This worker's train and eval batches (Ray Train dataset shards "train" and "eval"). A pipeline
    (`trainer.pp` > 1) has fixed shapes: training drops a short last batch, evaluation runs in training batches."""
    pipeline = cfg.trainer.get("pp", 1) > 1
    (train_shard, eval_shard), waited_s = dataset_shards("train", "eval")
    train = ShardBatches(train_shard, cfg.data.name, cfg.trainer.batch_size, cfg.data.cache_in_worker, seed,
                         cfg.trainer.max_steps_per_epoch, drop_last=pipeline,
                         bucket_by_length=cfg.data.bucket_by_length, trim=not pipeline)
    evaluation = ShardBatches(eval_shard, cfg.data.name, cfg.trainer.batch_size if pipeline else EVAL_BATCH,
                              cfg.data.cache_in_worker, seed, trim=not pipeline)
    train.load_s += waited_s
    return train, evaluation


def dist_reduce_later(values: list[float], op: str) -> PendingReduce:
    """`AsyncReducer` over torch.distributed (identity when it is not initialised): the all-reduce runs on the
    process group's own threads (NCCL: its stream) until the result is asked for. The values travel on the
    group's device: NCCL (`trainer.use_gpu`) reduces CUDA tensors only."""
    if not (dist.is_available() and dist.is_initialized()):
        return lambda: list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=collective_device())
    work = dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], async_op=True)

    def result() -> list[float]:
        work.wait()
        return tensor.tolist()
    return result


class TorchProfiler:
    """`torch.profiler` over `steps` training steps after one warmup step (the first step pays one-time costs);
    the trace is a Chrome/Perfetto JSON (`trace_rank0.json`: chrome://tracing or ui.perfetto.dev; steps are
    `ProfilerStep#1`...), CUDA kernels included on GPUs."""

    def __init__(self, folder: str, steps: int, cuda: bool):
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.folder, self.steps, self.taken = Path(folder), steps, 0
        self.profile = profile(activities=activities, record_shapes=True,
                               schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                               on_trace_ready=self._export)

    def _export(self, profile: Any) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        profile.export_chrome_trace(str(self.folder / "trace_rank0.json"))

    def start(self) -> None:
        self.profile.start()

    def step(self) -> bool:
        self.profile.step()
        self.taken += 1
        return self.taken > self.steps  # the warmup step and `steps` recorded ones

    def stop(self) -> None:
        self.profile.stop()


class TorchAdapter:
    """The loop's `Adapter` for a PyTorch model, taking optimizer steps the recipe's way (trainers/torch_recipe.py).
    Subclasses override the state hooks (`dense_model_state`, `dense_optimizer_state`, `load_dense_state`) and
    may pass `sync_gradients` (run between the last backward of a step and the optimizer step) and `clip` (the
    global-norm clipping for their layout; default: whole parameters on every rank).

    Gradient accumulation (`recipe.passes` batches per optimizer step): the loss is scaled by 1/passes so a step
    applies the mean gradient over those batches, as one larger batch would. A DDP model skips its all-reduce
    (`no_sync`) on all but the last batch of a step."""

    sharded_checkpoint = False  # rank 0 writes the dense state (`save`)
    loss_is_global = False  # each rank's own batch loss

    def __init__(self, model: nn.Module, recipe: TorchRecipe, train: ShardBatches, evaluation: ShardBatches,
                 device: torch.device, rank: int, reduce_later: AsyncReducer = dist_reduce_later,
                 sync_gradients: Callable[[], None] | None = None, replicas: int = 1,
                 clip: Callable[[float], Any] | None = None):
        self.model, self.recipe, self.optimizer = model, recipe, recipe.optimizer
        self.train, self.evaluation, self.device, self.rank = train, evaluation, device, rank
        self._reduce_later = reduce_later
        self.passes, self.sync_gradients, self.replicas = recipe.passes, sync_gradients, replicas
        self.clip = clip or (lambda max_norm: clip_dense_grad_norm(self.model, max_norm))
        self.load_s = train.load_s + evaluation.load_s
        self.loss_fn = nn.CrossEntropyLoss()
        self.forward: Callable[..., torch.Tensor] = model  # the training forward (`compile_forward`)
        self.pending = 0  # backward passes since the last optimizer step

    def compile_forward(self) -> None:
        """Train through `torch.compile` of the model (wrappers included: DDP's hooks, FSDP's, TP's collectives).
        Evaluation and checkpoints use the model itself, so state-dict keys and the eval graph are unchanged."""
        self.forward = torch.compile(self.model)

    def steps_per_epoch(self) -> int:
        return self.train.steps()

    def batches(self, epoch: int, skip: int) -> Iterator[Batch]:
        self.model.train()  # the epoch starts: evaluation left the model in eval mode
        return self.train.epoch(epoch, skip=skip)

    def train_step(self, batch: Batch) -> tuple[float, int, int]:
        inputs, labels = tuple(x.to(self.device) for x in batch[0]), batch[1].to(self.device)
        recipe = self.recipe
        if self.pending == 0:
            self.optimizer.zero_grad()  # no arguments: Horovod's wrapper takes none (torch's default sets None)
        with self._local_step():
            with torch.autocast(self.device.type, dtype=recipe.autocast_dtype,
                                enabled=recipe.autocast_dtype is not None):
                loss = self.loss_fn(self.forward(*inputs), labels)
            scaled = loss / self.passes if self.passes > 1 else loss
            (recipe.scaler.scale(scaled) if recipe.scaler is not None else scaled).backward()
        self.pending += 1
        if self.pending == self.passes:
            self._optimizer_step()
        return loss.item(), len(labels), batch[2]

    def profiler(self, folder: str, steps: int) -> TorchProfiler:
        return TorchProfiler(folder, steps, cuda=self.device.type == "cuda")

    def _local_step(self) -> Any:
        """DDP's `no_sync` (around forward and backward: DDP arms its all-reduce in the forward) for a batch that
        is not the last of an optimizer step, else nothing."""
        if self.pending + 1 < self.passes and hasattr(self.model, "no_sync"):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def _optimizer_step(self) -> None:
        """Sync, unscale (fp16), clip the global norm, step, advance the schedule."""
        recipe = self.recipe
        if self.sync_gradients is not None:
            self.sync_gradients()
        if recipe.scaler is not None:
            recipe.scaler.unscale_(self.optimizer)
        if recipe.grad_clip is not None:
            self.clip(recipe.grad_clip)
        if recipe.scaler is not None:
            recipe.scaler.step(self.optimizer)
            recipe.scaler.update()
        else:
            self.step_optimizer()
        recipe.scheduler.step()
        self.pending = 0

    def step_optimizer(self) -> None:
        self.optimizer.step()

    def at_update_boundary(self) -> bool:
        return self.pending == 0

    def finish_epoch(self) -> None:
        if self.pending:  # an epoch that is not a multiple of `passes`: step on what has accumulated
            if hasattr(self.model, "no_sync"):  # DDP skipped the all-reduce of those batches
                average_gradients(self.model, None)
            self._optimizer_step()

    @torch.no_grad()
    def evaluate(self, epoch: int) -> tuple[int, int]:
        self.model.eval()
        correct = total = 0
        for inputs, labels, _ in self.evaluation.epoch(epoch, shuffle=False):
            predictions = self.model(*(x.to(self.device) for x in inputs)).argmax(dim=1)
            correct += int((predictions == labels.to(self.device)).sum())
            total += len(labels)
        return correct, total

    def reduce(self, values: list[float], op: str) -> list[float]:
        return self._reduce_later(values, op)()

    def reduce_later(self, values: list[float], op: str) -> PendingReduce:
        return self._reduce_later(values, op)

    def peak_memory_bytes(self) -> float:
        """CUDA allocations on GPU, else the process's peak RSS."""
        if self.device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(self.device))
        return peak_rss_bytes()

    def own_stats(self) -> dict[str, float]:
        """This rank's parameter, gradient and optimizer-state bytes and peak memory (subclasses add their own)."""
        return {**rank_memory(self.model, self.optimizer), "peak_memory_bytes": self.peak_memory_bytes()}

    def epoch_extras(self) -> dict[str, float]:
        """Every rank's `own_stats` as `rank<r>.<name>`, gathered over torch.distributed (a collective); this
        rank's alone without a torch.distributed group (a lone process, Horovod)."""
        stats = self.own_stats()
        if not (dist.is_available() and dist.is_initialized()):
            return {f"rank{self.rank}.{k}": v for k, v in stats.items()}
        gathered: list[dict[str, float] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, stats)
        return {f"rank{r}.{k}": v for r, each in enumerate(gathered) for k, v in each.items()}

    # State: a checkpoint always holds the dense (unsharded, unwrapped) model, so any layout can load it.
    def dense_model_state(self) -> dict[str, torch.Tensor]:
        """The model's dense state dict; a collective where the model is sharded."""
        return unwrap(self.model).state_dict()

    def dense_optimizer_state(self) -> dict:
        """The optimizer's state dict as a dense model's optimizer would hold it; a collective where sharded."""
        return self.optimizer.state_dict()

    def load_dense_state(self, model_state: dict[str, torch.Tensor], optimizer_state: dict | None) -> None:
        unwrap(self.model).load_state_dict(model_state)
        if optimizer_state is not None:
            self.optimizer.load_state_dict(optimizer_state)

    def save(self, directory: str) -> None:
        state = {"model": self.dense_model_state(), "optimizer": self.dense_optimizer_state(),  # may be collective
                 **self.recipe.state_dict()}
        if self.rank == 0:  # the others' folders are discarded (contract/checkpoint.py)
            torch.save(state, os.path.join(directory, STATE_FILE))

    def load(self, directory: str) -> None:
        state = load_state_file(directory)
        self.load_dense_state(state["model"], with_kernels_of(self.optimizer, state["optimizer"]))
        self.recipe.load_state_dict(state)

    def dump(self, directory: str | None) -> None:
        """Debugging aid (`run.dump_params_dir`): this rank's final dense parameters and, for cached text, the
        keys of the rows of its training shard. Collective where `dense_model_state` is."""
        if not directory:
            return
        model_state = self.dense_model_state()
        Path(directory).mkdir(parents=True, exist_ok=True)
        torch.save(model_state, Path(directory) / f"rank{self.rank}.pt")
        keys = self.train.row_keys()
        if keys is not None:
            torch.save(keys, Path(directory) / f"rank{self.rank}_rows.pt")


def load_state_file(directory: str) -> dict[str, Any]:
    """A checkpoint's state, its tensors on the CPU whatever device saved them: a GPU run's checkpoint loads on a
    driver or a resumed worker without one (`load_state_dict` moves each tensor to its parameter's device)."""
    return torch.load(os.path.join(directory, STATE_FILE), map_location="cpu", weights_only=False)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


def torch_trainer(loop: Callable[[dict], None], cfg: Any, datasets: dict, run_id: str, tracking_uri: str,
                  model_inputs: dict, dataset_config: Any = None, callbacks: list | None = None) -> Any:
    """The `TorchTrainer` every PyTorch backend but Horovod uses: gloo on CPU / NCCL on GPU, set up by
    trainers/backend_configs.py (the process group `TorchConfig` sets up, without torch in Ray Train's controller)."""
    from ray.train.torch import TorchTrainer

    from trainers.shard_data import shard_config
    from trainers.backend_configs import TorchGroupConfig

    return TorchTrainer(
        loop,
        train_loop_config=loop_config(cfg, run_id, tracking_uri, model_inputs),
        torch_config=TorchGroupConfig(backend="nccl" if cfg.trainer.use_gpu else "gloo"),
        scaling_config=scaling_config(cfg),
        run_config=run_config(cfg, run_id, callbacks),
        datasets=datasets,
        dataset_config=dataset_config or shard_config(cfg.trainer.num_workers, cfg.data.cache_in_worker),
    )
