"""The bar of each epoch's training steps (`run.progress`, rank 0), drawn by the driver (trainers/worker.py
`ray_step_bar`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from contract.progress import NoBar, StepBar
from trainers.callbacks.base import LoopCallback

if TYPE_CHECKING:
    from trainers.loop import TrainLoop


class StepBars(LoopCallback):
    """`make_bar(description, steps in the epoch, steps done)`: the epoch's bar."""

    def __init__(self, make_bar: Callable[[str, int, int], StepBar]):
        self.make_bar, self.bar = make_bar, NoBar()

    def on_start(self, loop: TrainLoop) -> None:
        self.adapter, self.epochs = loop.adapter, loop.ctx.epochs

    def on_epoch_start(self, epoch: int, done: int) -> None:
        self.bar = self.make_bar(f"train epoch {epoch}/{self.epochs}", self.adapter.steps_per_epoch(), done)

    def on_steps_end(self, epoch: int, done: int, count: int) -> None:
        self.bar.update(count)

    def on_epoch_trained(self, epoch: int) -> None:
        self.bar.close()
        self.bar = NoBar()
