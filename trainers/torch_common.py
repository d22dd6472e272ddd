"""Pieces every PyTorch backend's worker loop uses: shard ingest, epochs, metrics, checkpoints."""
from __future__ import annotations

import itertools
import os
import resource
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from pipelines.data.mnist import MEAN, STD

LOAD_BATCH = 8192  # rows per Ray Data batch when pulling a shard into memory


Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor, int]  # (model inputs, labels, tokens in batch)


def image_batch(columns: dict[str, torch.Tensor]) -> Batch:
    return (normalise(columns["image"]),), columns["label"].long(), 0


def text_batch(columns: dict[str, torch.Tensor]) -> Batch:
    ids, lengths = columns["input_ids"].long(), columns["length"]
    mask = torch.arange(ids.shape[1]) < lengths[:, None]  # (B, T), True = real token
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
    epoch (for data that does not fit in memory), in shard order.
    """

    def __init__(self, shard: Any, dataset: str, batch_size: int, cache: bool, seed: int):
        self.columns, self.adapt = DATA_ADAPTERS[dataset]
        self.shard, self.batch_size, self.seed = shard, batch_size, seed
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

    def steps(self, max_steps: int | None = None) -> int:
        """Batches per epoch (known once cached; 0 when streaming)."""
        steps = 0 if self.cached is None else -(-len(self.cached["label"]) // self.batch_size)  # ceil
        return min(steps, max_steps) if max_steps else steps

    def epoch(self, epoch: int, shuffle: bool = True, max_steps: int | None = None, skip: int = 0) -> Iterator[Batch]:
        """The epoch's batches (a fixed order per epoch), without the first `skip` (already trained on)."""
        return itertools.islice(self._epoch(epoch, shuffle), skip, max_steps)

    def _epoch(self, epoch: int, shuffle: bool) -> Iterator[Batch]:
        if self.cached is None:
            for batch in self.shard.iter_torch_batches(batch_size=self.batch_size):
                yield self.adapt(batch)
            return
        rows = len(self.cached["label"])
        if shuffle:
            order = torch.randperm(rows, generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            order = torch.arange(rows)
        for start in range(0, rows, self.batch_size):
            idx = order[start:start + self.batch_size]
            yield self.adapt({c: t[idx] for c, t in self.cached.items()})


def worker_data(cfg: Any, seed: int) -> tuple[ShardBatches, ShardBatches]:
    """This worker's train and eval batches (Ray Train dataset shards "train" and "eval")."""
    import ray.train

    train = ShardBatches(ray.train.get_dataset_shard("train"), cfg.data.name, cfg.trainer.batch_size,
                         cfg.data.cache_in_worker, seed)
    evaluation = ShardBatches(ray.train.get_dataset_shard("eval"), cfg.data.name, 256, cfg.data.cache_in_worker,
                              seed)
    return train, evaluation


def rank0_logger(config: dict, rank: int, state: dict | None) -> Any:
    """Rank 0's MLflow epoch logger (None elsewhere). After a restart it records where the run resumed and
    re-logs the checkpoint's epoch, in case the failure hit between the report and the log."""
    from pipelines.tracking import EpochLogger

    if rank != 0:
        return None
    logger = EpochLogger(config["tracking_uri"], config["run_id"])
    if state is not None:
        logger.resumed_from(state["epoch"])
        if state["epoch"] > 0:  # 0: stopped inside the first epoch, nothing finished to log
            logger.log(state["epoch"], state["metrics"])
    return logger


class StopCheck:
    """`should_stop` for `train_epoch`: True on every rank at the same step once the file STOP appears in
    `run.resume_dir` (pipelines/resume.py). Every `every` steps the ranks agree through one all-reduce of a
    flag, so a rank that sees the file late still stops with the others; checking every step would add a
    collective to each step of a small model."""

    def __init__(self, resume_dir: str | None, every: int | None = None, reduce: "Reducer | None" = None):
        from pipelines.resume import STOP_CHECK_EVERY, stop_file

        self.path, self.reduce = stop_file(resume_dir), reduce or dist_reduce
        self.every = every or STOP_CHECK_EVERY

    def __call__(self, steps: int) -> bool:
        if self.path is None or steps % self.every:
            return False
        (flag,) = self.reduce([float(self.path.exists())], "max")
        return flag > 0


def resume_point(state: dict | None) -> tuple[int, dict | None]:
    """(first epoch to train, totals of a half-done epoch to continue or None) from a checkpoint."""
    if state is None:
        return 1, None
    return state["epoch"] + 1, state.get("partial")


def epoch_start(partial: dict | None, epoch: int) -> EpochStats:
    """The totals `epoch` starts from: those of a half-done epoch being continued, else zeros."""
    if partial is not None and partial["epoch"] == epoch:
        return EpochStats(**{**partial["stats"], "stopped": False})
    return EpochStats()


def tag_worker_node(config: dict, rank: int) -> None:
    """Tag `rank<r>.node` = the IP of the Ray node this worker runs on (where the workers landed)."""
    import ray.util
    from pipelines.tracking import set_tag

    set_tag(config["tracking_uri"], config["run_id"], f"rank{rank}.node", ray.util.get_node_ip_address())


def normalise(images: torch.Tensor) -> torch.Tensor:
    return (images.float() / 255.0 - MEAN) / STD


@dataclass
class EpochStats:
    loss_sum: float = 0.0
    samples: int = 0
    steps: int = 0
    data_wait_s: float = 0.0
    train_s: float = 0.0
    tokens: int = 0
    stopped: bool = False  # the epoch ended early on a stop request (StopCheck)


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterator, device: torch.device,
                after_backward: Callable[[], None] | None = None,
                on_step: Callable[[float], None] | None = None,
                stats: EpochStats | None = None,
                should_stop: Callable[[int], bool] | None = None,
                passes: int = 1) -> EpochStats:
    """One pass over `batches`; times the wait for each batch separately from the whole step.
    `after_backward` runs between backward and the optimizer step (e.g. a data-parallel gradient sync);
    `on_step` gets each batch's loss. `stats`: the totals of the epoch so far (a resumed epoch).
    `should_stop(batches done)` is asked after every optimizer step; True ends the epoch early with
    `stats.stopped`. `passes`: batches per optimizer step (gradient accumulation, Horovod's
    `backward_passes_per_step`); the loss is scaled by 1/passes so a step applies the mean gradient over
    those batches, as one larger batch would."""
    model.train()
    stats = stats if stats is not None else EpochStats()
    loss_fn = nn.CrossEntropyLoss()
    start = time.perf_counter()
    pending = 0  # backward passes since the last optimizer step
    while True:
        wait_start = time.perf_counter()
        batch = next(batches, None)
        stats.data_wait_s += time.perf_counter() - wait_start
        if batch is None:
            break
        inputs, labels = tuple(x.to(device) for x in batch[0]), batch[1].to(device)
        if pending == 0:
            optimizer.zero_grad()  # no arguments: Horovod's wrapper takes none (torch's default sets None)
        loss = loss_fn(model(*inputs), labels)
        (loss / passes if passes > 1 else loss).backward()
        pending += 1
        if pending == passes:
            if after_backward is not None:
                after_backward()
            optimizer.step()
            pending = 0
        if on_step is not None:
            on_step(loss.item())
        stats.loss_sum += loss.item() * len(labels)
        stats.samples += len(labels)
        stats.steps += 1
        stats.tokens += batch[2]
        # Only between optimizer steps: a checkpoint must not drop half-accumulated gradients.
        if pending == 0 and should_stop is not None and should_stop(stats.steps):
            stats.stopped = True
            break
    if pending:  # an epoch that is not a multiple of `passes`: step on what has accumulated
        if after_backward is not None:
            after_backward()
        optimizer.step()
    stats.train_s += time.perf_counter() - start
    return stats


@torch.no_grad()
def count_correct(model: nn.Module, batches: Iterator, device: torch.device) -> tuple[int, int]:
    model.eval()
    correct = total = 0
    for inputs, labels, _ in batches:
        predictions = model(*(x.to(device) for x in inputs)).argmax(dim=1)
        correct += int((predictions == labels.to(device)).sum())
        total += len(labels)
    return correct, total


# (values, "sum" | "max") -> each value reduced over all workers. Backends without torch.distributed (Horovod)
# pass their own to `epoch_metrics`.
Reducer = Callable[[list[float], str], list[float]]


def dist_reduce(values: list[float], op: str) -> list[float]:
    """`Reducer` over torch.distributed (identity when it is not initialised or has one rank)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return tensor.tolist()


def epoch_metrics(stats: EpochStats, correct: int, total: int, replicas: int = 1,
                  reduce: Reducer = dist_reduce) -> dict[str, float]:
    """The shared metric names, reduced over all workers (sums, and the slowest worker's time).
    `test_accuracy` is measured on the dataset's evaluation split (`data.eval_split`). `replicas`: how many
    ranks process each sample (the TP degree), so throughput counts every sample once."""
    loss_sum, samples, steps, wait_s, train_s, tokens, correct_all, total_all = reduce(
        [stats.loss_sum, stats.samples, stats.steps, stats.data_wait_s, stats.train_s, stats.tokens, correct,
         total], "sum")
    slowest_s, peak_bytes = reduce([stats.train_s, peak_memory_bytes()], "max")
    metrics = {
        "train_loss": loss_sum / max(samples, 1),
        "test_accuracy": correct_all / max(total_all, 1),
        "samples_per_s": samples / replicas / max(slowest_s, 1e-9),
        "step_time_ms": 1000.0 * train_s / max(steps, 1),
        "data_wait_fraction": wait_s / max(train_s, 1e-9),
        "epoch_time_s": slowest_s,
        "peak_memory_bytes": peak_bytes,  # the largest worker's peak so far (sweep scaling reports)
    }
    if tokens:
        metrics["tokens_per_s"] = tokens / replicas / max(slowest_s, 1e-9)
    return metrics


def peak_memory_bytes() -> float:
    """This process's peak memory so far: CUDA allocations on GPU, else the peak RSS (Linux reports KiB)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return float(torch.cuda.max_memory_allocated())
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def make_optimizer(model: nn.Module, name: str, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=lr)


def save_checkpoint(directory: str, model_state: dict[str, torch.Tensor], optimizer_state: dict | None,
                    epoch: int, metrics: dict[str, float] | None, partial: dict | None = None) -> None:
    """`model_state` is always the dense (unsharded) state dict, so any parallel layout can load it.
    `epoch`: the last finished epoch; `partial`: totals of the next one if it stopped half-way."""
    state = {"model": model_state, "optimizer": optimizer_state, "epoch": epoch, "metrics": metrics,
             "partial": partial}
    torch.save(state, os.path.join(directory, "state.pt"))


def load_checkpoint(checkpoint: Any) -> dict[str, Any] | None:
    """The state saved by `save_checkpoint`, from a `ray.train.Checkpoint` (or None)."""
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        return torch.load(os.path.join(directory, "state.pt"), weights_only=False)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


def report_epoch(metrics: dict[str, float], model_state: dict[str, torch.Tensor], optimizer_state: dict | None,
                 epoch: int, rank: int) -> None:
    """`ray.train.report` with a checkpoint written by rank 0 (others report metrics only)."""
    import ray.train

    if rank != 0:
        ray.train.report(metrics, checkpoint=None)
        return
    with tempfile.TemporaryDirectory() as directory:
        save_checkpoint(directory, model_state, optimizer_state, epoch, metrics)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))


def report_stop(stats: EpochStats, epoch: int, last_metrics: dict[str, float] | None,
                model_state: dict[str, torch.Tensor], optimizer_state: dict | None, rank: int) -> None:
    """Checkpoint a half-done epoch after a stop request; the driver sees `stopped_at_epoch` in the
    result's metrics and marks the run as stopped, not finished."""
    import ray.train
    from dataclasses import asdict

    metrics = {"stopped_at_epoch": float(epoch), "stopped_at_step": float(stats.steps)}
    if rank != 0:
        ray.train.report(metrics, checkpoint=None)
        return
    partial = {"epoch": epoch, "stats": asdict(stats)}
    with tempfile.TemporaryDirectory() as directory:
        save_checkpoint(directory, model_state, optimizer_state, epoch - 1, last_metrics, partial)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))


def step_loss_logger(logger: Any, every: int, epoch: int, steps_per_epoch: int,
                     done: int = 0) -> Callable[[float], None] | None:
    """`on_step` for `train_epoch` that logs `step_loss` every `every` global steps (rank 0 only);
    `done`: steps of this epoch already trained before a resume."""
    if logger is None or every <= 0:
        return None
    step = (epoch - 1) * steps_per_epoch + done

    def on_step(loss: float) -> None:
        nonlocal step
        step += 1
        if step % every == 0:
            logger.log_step_loss(step, loss)
    return on_step


def maybe_inject_failure(fault: Any, epoch: int, rank: int, world_size: int) -> None:
    """Testing hook: fail once, in the last rank, at `fault.inject_at_epoch`."""
    if fault.inject_at_epoch != epoch or rank != world_size - 1 or not fault.inject_marker:
        return
    marker = Path(fault.inject_marker)
    if marker.exists():
        return
    marker.write_text(f"failed at epoch {epoch} in rank {rank}\n")
    raise RuntimeError(f"injected failure at epoch {epoch} (rank {rank})")


def dump_state(directory: str | None, model_state: dict[str, torch.Tensor], rank: int,
               train: ShardBatches | None = None) -> None:
    """Debugging aid (`run.dump_params_dir`): this rank's final parameters and, when cached, the row keys of
    its training shard (for text: id * 2 + label, unique per review)."""
    if not directory:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    torch.save(model_state, Path(directory) / f"rank{rank}.pt")
    if train is not None and train.cached is not None and "id" in train.cached:
        keys = train.cached["id"].long() * 2 + train.cached["label"].long()
        torch.save(keys.sort().values, Path(directory) / f"rank{rank}_rows.pt")


def torch_trainer(loop: Callable[[dict], None], cfg: Any, datasets: dict, run_id: str, tracking_uri: str,
                  model_inputs: dict, dataset_config: Any = None, callbacks: list | None = None) -> Any:
    """The `TorchTrainer` every PyTorch backend uses: gloo on CPU / NCCL on GPU, one CPU per worker thread,
    a run named after the MLflow run, restarts from checkpoints up to `fault.max_failures`. `callbacks`: extra
    Ray Train callbacks (a sweep passes Tune's `TuneReportCallback`)."""
    from omegaconf import OmegaConf
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from trainers.shard_data import shard_config

    use_gpu = cfg.trainer.use_gpu
    return TorchTrainer(
        loop,
        train_loop_config={"cfg": OmegaConf.to_container(cfg, resolve=True), "run_id": run_id,
                           "tracking_uri": tracking_uri, "model_inputs": model_inputs},
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=cfg.trainer.num_workers, use_gpu=use_gpu,
                                     resources_per_worker={"CPU": cfg.trainer.threads_per_worker},
                                     placement_strategy=cfg.trainer.placement_strategy),
        run_config=RunConfig(name=f"run-{run_id}", storage_path=cfg.run.storage_path,
                             failure_config=FailureConfig(max_failures=cfg.fault.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2), callbacks=list(callbacks or [])),
        datasets=datasets,
        dataset_config=dataset_config or shard_config(cfg.trainer.num_workers, cfg.data.cache_in_worker),
    )
