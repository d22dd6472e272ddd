"""What a backend gives the one training loop (trainers/loop.py): an `Adapter`, built by the backend's
`build_adapter(cfg, ctx, data)` from the run's config, the worker's `WorkerContext` and its `WorkerData`.
Framework-free: no torch, TensorFlow or Ray imported here.

An adapter owns a model, its optimizer-step recipe (contract/recipe.py), this worker's data shards and the
backend's collectives; the loop owns epochs, resume, STOP, metrics, checkpoints and logging. The hooks a
backend must give raise NotImplementedError here; the others have the defaults of a plain data-parallel worker.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

from contract.data import DataSchema
from contract.metrics import PendingReduce, peak_rss_bytes


class StepProfiler(Protocol):
    """A framework's profiler over some training steps (the adapter makes it; the loop drives it on rank 0)."""

    def start(self) -> None: ...
    def step(self) -> bool: ...   # one training step ended; True: the profile is complete
    def stop(self) -> None: ...   # the trace is in the folder it was made for


@dataclass
class WorkerData:
    """What a worker trains on: the data's features and target as its manifest describes them (`DataSchema`),
    and its shards. `shards(seed)` -> (train, evaluation) in the framework's form (PyTorch: `ShardBatches`,
    shuffled by `seed`, or `StreamedBatches`; TensorFlow: `ShardArrays`, which the adapter shuffles): a run's Ray
    Data shards or streamed files, or data a test made."""
    inputs: DataSchema
    shards: Callable[[int], tuple[Any, Any]]


class Adapter:
    """A backend's side of the loop. Methods marked collective are called by every rank in step."""

    ranks_per_sample: int = 1      # ranks that process each sample (a tensor- or pipeline-parallel group's size)
    loss_is_global: bool = False   # `train_step`'s loss is already the global batch's mean (its step reduced it)
    sharded_checkpoint: bool = False  # every rank's checkpoint folder holds a part (Ray Train merges); else rank 0's
    steps_per_call: int = 1        # steps `train_steps` trains per call (several: less host work per step)
    load_s: float = 0.0            # seconds this worker took to pull its data shards
    forward_s: float = 0.0         # seconds of forward passes so far (contract/stragglers.py; 0: not timed)

    # What every backend gives.
    def steps_per_epoch(self) -> int:
        raise NotImplementedError

    def batches(self, epoch: int, skip: int) -> Iterator[Any]:
        """The epoch's batches in a fixed order per epoch, without the first `skip` (trained before a stop)."""
        raise NotImplementedError

    def train_step(self, batch: Any) -> tuple[float, int, int]:
        """Forward, backward and (at an update boundary) the optimizer step; returns (loss, samples, tokens)."""
        raise NotImplementedError

    def evaluate(self, epoch: int) -> tuple[float, int]:
        """(score, rows) on this worker's evaluation shard: correct predictions (classification) or the sum of
        squared errors (regression), over its rows (contract/metrics.py `epoch_metrics` takes the mean)."""
        raise NotImplementedError

    def reduce_later(self, values: list[float], op: str) -> PendingReduce:
        """`contract.metrics.Reducer` over the backend's collectives, started now and its result asked for later
        (collective from the start until then): asynchronous where the backend's collectives can be, else
        `contract.metrics.reduce_at_once`."""
        raise NotImplementedError

    def save(self, directory: str) -> None:
        """Model and optimizer state into `directory` (collective; see contract/checkpoint.py)."""
        raise NotImplementedError

    def load(self, directory: str) -> None:
        raise NotImplementedError

    def save_in_background(self, directory: str) -> Callable[[], Any] | None:
        """`save` begun now and finished while training goes on (a checkpoint inside an epoch); returns what waits
        until `directory` is written, or None when it already is. Collective. This default: `save`, at once."""
        self.save(directory)
        return None

    def profiler(self, folder: str, steps: int) -> StepProfiler:
        """A profiler recording `steps` training steps into `folder` (`trainer.profile_steps`)."""
        raise NotImplementedError

    # Defaults: one optimizer step per batch, one step per call, nothing more to report.
    def train_steps(self, batches: list[Any]) -> list[tuple[float, int, int]]:
        """`train_step` of each of up to `steps_per_call` consecutive batches, in order."""
        return [self.train_step(batch) for batch in batches]

    def reduce(self, values: list[float], op: str) -> list[float]:
        """`reduce_later`, waited for at once (collective)."""
        return self.reduce_later(values, op)()

    def at_update_boundary(self) -> bool:
        """No accumulated gradients are pending: a stop here loses nothing."""
        return True

    def finish_epoch(self) -> None:
        """Apply gradients still accumulated at the end of an epoch (collective)."""

    def peak_memory_bytes(self) -> float:
        return peak_rss_bytes()

    def epoch_extras(self) -> dict[str, float]:
        """Diagnostics rank 0 logs beside the epoch metrics (collective; {} for none)."""
        return {}

    def dump(self, directory: str | None) -> None:
        """`run.dump_params_dir` (a debugging aid): this rank's final parameters into `directory`, if set."""
