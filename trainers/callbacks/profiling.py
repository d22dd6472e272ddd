"""`trainer.profile_steps` (rank 0): the adapter's profiler over that many steps of the attempt's first epoch, the
trace logged as the run's `profile/` artifacts. A "step" is one call of `on_steps_end`: a training step in the
shared loop, one call of compiled steps under Keras `fit`."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from trainers.callbacks.base import LoopCallback

if TYPE_CHECKING:
    from trainers.adapter import StepProfiler
    from trainers.loop import TrainLoop


class Profiling(LoopCallback):
    def __init__(self, folder: Path, steps: int):
        self.folder, self.steps = folder, steps
        self.profiler: StepProfiler | None = None
        self.profiled = False  # this attempt has profiled its steps

    def on_start(self, loop: TrainLoop) -> None:
        self.adapter, self.logger, self.first_epoch = loop.adapter, loop.ctx.logger, loop.first_epoch

    def on_epoch_start(self, epoch: int, done: int) -> None:
        if epoch == self.first_epoch and not self.profiled:
            self.profiler = self.adapter.profiler(str(self.folder), self.steps)
            self.profiler.start()
            self.profiled = True

    def on_steps_end(self, epoch: int, done: int, count: int) -> None:
        if self.profiler is not None and self.profiler.step():
            self.on_epoch_trained(epoch)

    def on_epoch_trained(self, epoch: int) -> None:
        """Stop and write the trace (a short epoch: fewer steps than asked); the logger sends it to the run."""
        if self.profiler is None:
            return
        self.profiler.stop()
        self.profiler = None
        self.logger.log_artifacts(str(self.folder), "profile")
