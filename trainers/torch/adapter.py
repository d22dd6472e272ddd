"""What every PyTorch backend's adapter shares (ddp, tp, fsdp, deepspeed, horovod torch): `TorchAdapter`, the
loop's adapter (trainers/loop.py) over a PyTorch model and the recipe's optimizer step, its state files, profiler and
evaluation. Backends differ only in how they wrap the model and optimizer, sync gradients, and turn state into the
dense form a checkpoint holds."""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from contract.metrics import AsyncReducer, PendingReduce, peak_rss_bytes
from trainers.adapter import Adapter
from trainers.context import WorkerContext
from trainers.torch.data import Batch, Batches
from trainers.torch.parallel.comm import collective_device
from trainers.torch.parallel.data_parallel import average_gradients
from trainers.torch.parallel.memory import rank_memory
from trainers.torch.recipe import TorchRecipe, clip_dense_grad_norm, task_loss, with_kernels_of

DENSE_STATE_FILE = "state.pt"  # {"model": dense state dict, "optimizer": dense optimizer state, "scheduler": ...}


def batch_score(outputs: torch.Tensor, labels: torch.Tensor, regression: bool) -> float:
    """A batch's evaluation score: its correct predictions (the top logit's class), or its summed squared errors."""
    if regression:
        return float(((outputs.reshape(labels.shape).float() - labels) ** 2).sum())
    return float((outputs.argmax(dim=1) == labels).sum())


def place_model(model: nn.Module, device: torch.device) -> nn.Module:
    """`model` on `device`; a convolutional one in channels-last memory format, which oneDNN (and cuDNN) run
    faster (NCHW max-pooling is a slow path on CPUs: benchmarks/README.md). Horovod takes them through contiguous
    copies (`trainers.horovod.torch.ContiguousCompression`)."""
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


class TorchAdapter(Adapter):
    """The loop's `Adapter` for a PyTorch model, taking optimizer steps the recipe's way (trainers/torch/recipe.py).
    Subclasses override the state hooks (`dense_model_state`, `dense_optimizer_state`, `load_dense_state`) and
    may pass `sync_gradients` (run between the last backward of a step and the optimizer step) and `clip` (the
    global-norm clipping for their layout; default: whole parameters on every rank).

    Gradient accumulation (`recipe.passes` batches per optimizer step): the loss is scaled by 1/passes so a step
    applies the mean gradient over those batches, as one larger batch would. A DDP model skips its all-reduce
    (`no_sync`) on all but the last batch of a step."""

    def __init__(self, model: nn.Module, recipe: TorchRecipe, train: Batches, evaluation: Batches,
                 device: torch.device, rank: int, reduce_later: AsyncReducer = dist_reduce_later,
                 sync_gradients: Callable[[], None] | None = None, ranks_per_sample: int = 1,
                 clip: Callable[[float], Any] | None = None):
        self.model, self.recipe, self.optimizer = model, recipe, recipe.optimizer
        self.train, self.evaluation, self.device, self.rank = train, evaluation, device, rank
        self._reduce_later = reduce_later
        self.passes, self.sync_gradients, self.ranks_per_sample = recipe.passes, sync_gradients, ranks_per_sample
        self.clip = clip or (lambda max_norm: clip_dense_grad_norm(self.model, max_norm))
        self.load_s = train.load_s + evaluation.load_s
        self.regression = train.schema.target.task == "regression"
        self.loss_fn = task_loss(train.schema.target.task)
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
        began = time.perf_counter()
        inputs, labels = tuple(x.to(self.device) for x in batch[0]), batch[1].to(self.device)
        recipe = self.recipe
        if self.pending == 0:
            self.optimizer.zero_grad()  # no arguments: Horovod's wrapper takes none (torch's default sets None)
        with self._local_step():
            with torch.autocast(self.device.type, dtype=recipe.autocast_dtype,
                                enabled=recipe.autocast_dtype is not None):
                loss = self.loss_fn(self.forward(*inputs), labels)
            # On a GPU the host's time: kernels run asynchronously, so a slow host (the usual straggler) shows.
            self.forward_s += time.perf_counter() - began
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
    def evaluate(self, epoch: int) -> tuple[float, int]:
        self.model.eval()
        score, total = 0.0, 0
        for inputs, labels, _ in self.evaluation.epoch(epoch, shuffle=False):
            outputs = self.model(*(x.to(self.device) for x in inputs))
            score += batch_score(outputs, labels.to(self.device), self.regression)
            total += len(labels)
        return score, total

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
        """Every rank's `own_stats` (`gathered_stats`)."""
        return gathered_stats(self.own_stats(), self.rank)

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
            torch.save(state, os.path.join(directory, DENSE_STATE_FILE))

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


def gathered_stats(stats: dict[str, float], rank: int) -> dict[str, float]:
    """Every rank's `stats` as `rank<r>.<name>`, gathered over torch.distributed (a collective); this rank's alone
    without a torch.distributed group (a lone process, Horovod)."""
    if not (dist.is_available() and dist.is_initialized()):
        return {f"rank{rank}.{k}": v for k, v in stats.items()}
    gathered: list[dict[str, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, stats)
    return {f"rank{r}.{k}": v for r, each in enumerate(gathered) for k, v in each.items()}


def load_state_file(directory: str) -> dict[str, Any]:
    """A checkpoint's state, its tensors on the CPU whatever device saved them: a GPU run's checkpoint loads on a
    driver or a resumed worker without one (`load_state_dict` moves each tensor to its parameter's device)."""
    return torch.load(os.path.join(directory, DENSE_STATE_FILE), map_location="cpu", weights_only=False)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


def worker_device(ctx: WorkerContext) -> torch.device:
    return ctx.device if ctx.device is not None else torch.device("cpu")
