"""`WorkerContext`: what the shared loop (trainers/loop.py) needs from the cluster, and rank 0's metrics sink. Ray
Train's in a run (trainers/worker.py `ray_context`), plain objects in tests."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from contract.recipe import Monitor
from contract.resume import STOP_CHECK_EVERY
from trainers.callbacks.base import LoopCallback


class MetricsSink(Protocol):
    """Rank 0's MLflow logging (contract.tracking.EpochLogger); `NoMetrics` on the other ranks."""

    def log(self, epoch: int, metrics: dict[str, float]) -> None: ...
    def log_extra(self, epoch: int, metrics: dict[str, float]) -> None: ...
    def log_step_loss(self, step: int, loss: float) -> None: ...
    def flush(self) -> None: ...
    def resumed_from(self, epoch: int, steps: int = 0) -> None: ...
    def log_artifacts(self, folder: str, path: str) -> None: ...
    def tag(self, key: str, value: str) -> None: ...
    def append_tag(self, key: str, value: str) -> None: ...


class NoMetrics:
    """What a rank other than 0 logs: nothing."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


@dataclass
class WorkerContext:
    """What the loop needs from the cluster: Ray Train in a run (trainers/worker.py), plain objects in tests."""
    rank: int
    world_size: int
    # (metrics, this rank's checkpoint folder or None, background: upload it later, written: waits until the
    # adapter has written the folder (`Adapter.save_in_background`), or None when it has)
    report: Callable[..., None]
    epochs: int
    restored: Any = None                  # a checkpoint with `as_directory()` to resume from, or None
    logger: MetricsSink = field(default_factory=NoMetrics)  # rank 0's MLflow logger
    stop_file: Path | None = None         # STOP in `run.resume_dir` (contract/resume.py)
    log_every_n_steps: int = 0            # `step_loss` every n global steps; 0: off
    stop_check_every: int = STOP_CHECK_EVERY
    checkpoint_every_n_steps: int = 0     # `run.checkpoint_every_n_steps`: a checkpoint inside the epoch; 0: none
    checkpoint_every_s: float = 0.0       # `run.checkpoint_every_s`: or after this long; 0: none
    nan_patience: int = 3                 # `run.nan_patience`: non-finite logged step losses in a row that end a run
    origin: dict[str, Any] | None = None  # what wrote the checkpoints (contract/checkpoint.py checkpoint_origin)
    monitor: Monitor = Monitor()          # the best epoch and early stopping (`run.monitor`, `run.patience`)
    evaluated: str = "test_accuracy"      # the task's evaluation metric (contract/metrics.py EVAL_METRICS)
    device: Any = None                    # what the worker computes on (PyTorch: its torch.device; None: the CPU)
    callbacks: list[LoopCallback] = field(default_factory=list)  # the side concerns (trainers/callbacks/)
