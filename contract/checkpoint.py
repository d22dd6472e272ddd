"""The checkpoint schema every backend writes: `train_state.json` (this file's `TrainState`) beside the backend's
own model and optimizer files (PyTorch: `state.pt`; Keras: `model.weights.h5` + `optimizer.npz`).

Which ranks write: the loop (trainers/loop.py) asks every rank to save into its own temporary folder, because
saving may be collective (TP gathers its shards, a TF strategy needs every worker); rank 0's folder is the one
reported to Ray Train, and backends may skip writing files on the other ranks. A sharded checkpoint (FSDP:
`torch.distributed.checkpoint` files, each rank writing its own part) is reported from every rank, and Ray Train
merges the folders into one; `train_state.json` is rank 0's.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from contract.recipe import Monitor

STATE_FILE = "train_state.json"
ORIGIN_KEY = "origin"  # in STATE_FILE: the backend and model that wrote the checkpoint, and its files' sizes
# Beside Ray Train's checkpoint folders in a run's storage folder: a copy of the best epoch's checkpoint, which
# outlives Ray Train's retention of the last `run.keep_checkpoints` (trainers/keep_best.py).
BEST_CHECKPOINT = "best_checkpoint"


@dataclass
class EpochTotals:
    """Running totals of one epoch on one rank, summed over its steps (a stopped epoch continues from them)."""
    loss_sum: float = 0.0     # sum over samples of the per-sample loss
    samples: int = 0
    steps: int = 0            # steps trained (after a stop: the steps a resumed epoch skips)
    data_wait_s: float = 0.0  # time spent waiting for batches
    train_s: float = 0.0      # wall time of the epoch's steps, waits included
    tokens: int = 0           # real (non-padding) tokens, for text


def partial_over_ranks(totals: EpochTotals, reduce: Callable[[list[float], str], list[float]]) -> EpochTotals:
    """A stopped epoch's totals as its checkpoint keeps them (collective): sums over the ranks, the slowest rank's
    time, and the step count, which is every rank's."""
    loss_sum, samples, data_wait_s, tokens = reduce([totals.loss_sum, totals.samples, totals.data_wait_s,
                                                     totals.tokens], "sum")
    (slowest_s,) = reduce([totals.train_s], "max")
    return EpochTotals(loss_sum=loss_sum, samples=int(samples), steps=totals.steps, data_wait_s=data_wait_s,
                       train_s=slowest_s, tokens=int(tokens))


@dataclass
class TrainState:
    """Where training stands: the last finished epoch and its metrics, the best epoch so far (`run.monitor`), plus
    the totals of the next epoch when it stopped half-way on a stop request."""
    epoch: int = 0                              # last finished epoch; 0: none yet
    metrics: dict[str, float] | None = None     # that epoch's metrics
    partial: EpochTotals | None = None          # epoch + 1 stopped after `partial.steps` steps (global totals)
    best_epoch: int = 0                         # the epoch with the best monitored metric; 0: none yet
    best_value: float | None = None             # its value

    def totals_for(self, epoch: int, rank: int = 0) -> EpochTotals:
        """The totals `epoch` starts from on `rank`: those of a stopped epoch being continued, else zeros. The
        stopped epoch's totals are summed over the ranks (`partial_over_ranks`), so rank 0 continues them and the
        other ranks only their step count (the batches to skip) and the slowest rank's time so far: the epoch's
        sums over the ranks then count every rank's steps once."""
        if self.partial is None or epoch != self.epoch + 1:
            return EpochTotals()
        if rank == 0:
            return EpochTotals(**asdict(self.partial))
        return EpochTotals(steps=self.partial.steps, train_s=self.partial.train_s)

    def write(self, directory: str | Path, origin: dict[str, Any] | None = None) -> None:
        """Into a checkpoint folder the adapter has saved into; `origin`: what wrote it (`checkpoint_origin`), with
        the size of each file there, so that a run resuming from it can be checked before it starts."""
        record = asdict(self)
        if origin is not None:
            files = {str(path.relative_to(directory)): path.stat().st_size
                     for path in sorted(Path(directory).rglob("*")) if path.is_file()}
            record[ORIGIN_KEY] = {**origin, "files": files}
        Path(directory, STATE_FILE).write_text(json.dumps(record, sort_keys=True))

    @classmethod
    def read(cls, directory: str | Path) -> "TrainState":
        raw = json.loads(Path(directory, STATE_FILE).read_text())
        raw.pop(ORIGIN_KEY, None)
        partial = raw.pop("partial")
        return cls(**raw, partial=None if partial is None else EpochTotals(**partial))

    def after_epoch(self, epoch: int, metrics: dict[str, float], monitor: Monitor) -> "TrainState":
        """The state once `epoch` finished with `metrics`: the best epoch moves when the monitored metric improved."""
        value = metrics[monitor.metric]
        if monitor.better(value, self.best_value):
            return TrainState(epoch=epoch, metrics=metrics, best_epoch=epoch, best_value=value)
        return TrainState(epoch=epoch, metrics=metrics, best_epoch=self.best_epoch, best_value=self.best_value)


def checkpoint_origin(backend: str, model: str, world_size: int | None = None) -> dict[str, Any]:
    """What a checkpoint records of the run that wrote it: its backend (each has its own checkpoint format), model
    (the weights' shapes) and number of workers."""
    return {"backend": backend, "model": model, **({"world_size": world_size} if world_size else {})}


def checkpoint_world_size(directory: str | Path) -> int | None:
    """How many workers wrote the checkpoint in `directory` (None: not recorded)."""
    return json.loads(Path(directory, STATE_FILE).read_text()).get(ORIGIN_KEY, {}).get("world_size")


def checkpoint_mismatch(directory: str | Path, backend: str, model: str) -> str | None:
    """Why a run of `backend` training `model` cannot resume from the checkpoint in `directory`, or None: another
    backend's or model's checkpoint, or a file shorter or longer than when it was written (a copy cut short).
    A checkpoint from before origins were recorded is not checked."""
    raw = json.loads(Path(directory, STATE_FILE).read_text())
    origin = raw.get(ORIGIN_KEY)
    if origin is None:
        return None
    if (origin["backend"], origin["model"]) != (backend, model):
        return (f"written by trainer={origin['backend']} model={origin['model']}, this run is trainer={backend} "
                f"model={model} (a checkpoint loads into the backend and model that wrote it)")
    for name, size in origin["files"].items():
        path = Path(directory, name)
        if not path.is_file() or path.stat().st_size != size:
            found = f"{path.stat().st_size} bytes" if path.is_file() else "missing"
            return f"{name} is {found}, it was {size} bytes when written (an incomplete copy?)"
    return None
