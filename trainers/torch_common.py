"""Pieces every PyTorch backend's worker loop uses: shard ingest, epochs, metrics, checkpoints."""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from pipelines.data.mnist import MEAN, STD

LOAD_BATCH = 8192  # rows per Ray Data batch when pulling a shard into memory


class ShardBatches:
    """Batches of (normalised images, labels) from this worker's Ray Data shard.

    cache=True pulls the shard through Ray Data once and keeps it in memory as uint8 (MNIST's 60k rows
    are 47 MB): streaming `read_parquet` gave only 2-9k rows/s per worker here, slower than a small
    MLP trains, so re-streaming every epoch would make ingest the bottleneck. cache=False streams
    from Ray Data every epoch (for data that does not fit in memory).
    """

    def __init__(self, shard: Any, batch_size: int, cache: bool, seed: int):
        self.shard, self.batch_size, self.seed = shard, batch_size, seed
        self.images: torch.Tensor | None = None
        self.labels: torch.Tensor | None = None
        self.load_s = 0.0
        if cache:
            start = time.perf_counter()
            images, labels = [], []
            for batch in shard.iter_torch_batches(batch_size=LOAD_BATCH):
                images.append(batch["image"])
                labels.append(batch["label"])
            self.images, self.labels = torch.cat(images), torch.cat(labels).long()
            self.load_s = time.perf_counter() - start

    def epoch(self, epoch: int, shuffle: bool = True) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.images is None:
            for batch in self.shard.iter_torch_batches(batch_size=self.batch_size):
                yield normalise(batch["image"]), batch["label"].long()
            return
        rows = len(self.labels)
        if shuffle:
            order = torch.randperm(rows, generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            order = torch.arange(rows)
        for start in range(0, rows, self.batch_size):
            idx = order[start:start + self.batch_size]
            yield normalise(self.images[idx]), self.labels[idx]


def normalise(images: torch.Tensor) -> torch.Tensor:
    return (images.float() / 255.0 - MEAN) / STD


@dataclass
class EpochStats:
    loss_sum: float = 0.0
    samples: int = 0
    steps: int = 0
    data_wait_s: float = 0.0
    train_s: float = 0.0


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterator, device: torch.device
                ) -> EpochStats:
    """One pass over `batches`; times the wait for each batch separately from the whole step."""
    model.train()
    stats = EpochStats()
    loss_fn = nn.CrossEntropyLoss()
    start = time.perf_counter()
    while True:
        wait_start = time.perf_counter()
        batch = next(batches, None)
        stats.data_wait_s += time.perf_counter() - wait_start
        if batch is None:
            break
        images, labels = batch[0].to(device), batch[1].to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(images), labels)
        loss.backward()
        optimizer.step()
        stats.loss_sum += loss.item() * len(labels)
        stats.samples += len(labels)
        stats.steps += 1
    stats.train_s = time.perf_counter() - start
    return stats


@torch.no_grad()
def count_correct(model: nn.Module, batches: Iterator, device: torch.device) -> tuple[int, int]:
    model.eval()
    correct = total = 0
    for images, labels in batches:
        predictions = model(images.to(device)).argmax(dim=1)
        correct += int((predictions == labels.to(device)).sum())
        total += len(labels)
    return correct, total


def _all_reduce(values: list[float], op: dist.ReduceOp) -> list[float]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def epoch_metrics(stats: EpochStats, correct: int, total: int) -> dict[str, float]:
    """The shared metric names, reduced over all workers (sums, and the slowest worker's time)."""
    loss_sum, samples, steps, wait_s, train_s, correct_all, total_all = _all_reduce(
        [stats.loss_sum, stats.samples, stats.steps, stats.data_wait_s, stats.train_s, correct, total],
        dist.ReduceOp.SUM)
    (slowest_s,) = _all_reduce([stats.train_s], dist.ReduceOp.MAX)
    return {
        "train_loss": loss_sum / max(samples, 1),
        "test_accuracy": correct_all / max(total_all, 1),
        "samples_per_s": samples / max(slowest_s, 1e-9),
        "step_time_ms": 1000.0 * train_s / max(steps, 1),
        "data_wait_fraction": wait_s / max(train_s, 1e-9),
        "epoch_time_s": slowest_s,
    }


def make_optimizer(model: nn.Module, name: str, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=lr)


def save_checkpoint(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int,
                    metrics: dict[str, float]) -> None:
    state = {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
             "metrics": metrics}
    torch.save(state, os.path.join(directory, "state.pt"))


def load_checkpoint(checkpoint: Any) -> dict[str, Any] | None:
    """The state saved by `save_checkpoint`, from a `ray.train.Checkpoint` (or None)."""
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        return torch.load(os.path.join(directory, "state.pt"), weights_only=False)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


def report_epoch(metrics: dict[str, float], model: nn.Module, optimizer: torch.optim.Optimizer,
                 epoch: int, rank: int) -> None:
    """`ray.train.report` with a checkpoint written by rank 0 (others report metrics only)."""
    import ray.train

    if rank != 0:
        ray.train.report(metrics, checkpoint=None)
        return
    with tempfile.TemporaryDirectory() as directory:
        save_checkpoint(directory, model, optimizer, epoch, metrics)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))


def maybe_inject_failure(fault: Any, epoch: int, rank: int, world_size: int) -> None:
    """Testing hook: fail once, in the last rank, at `fault.inject_at_epoch`."""
    if fault.inject_at_epoch != epoch or rank != world_size - 1 or not fault.inject_marker:
        return
    marker = Path(fault.inject_marker)
    if marker.exists():
        return
    marker.write_text(f"failed at epoch {epoch} in rank {rank}\n")
    raise RuntimeError(f"injected failure at epoch {epoch} (rank {rank})")


def dump_params(directory: str | None, model: nn.Module, rank: int) -> None:
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        torch.save(unwrap(model).state_dict(), Path(directory) / f"rank{rank}.pt")
