"""Where the run's start-up went (contract/startup.py): rank 0 of the run's first attempt logs `startup.*` once,
after its first training step."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from contract.startup import StartupMarks
from trainers.callbacks.base import LoopCallback

if TYPE_CHECKING:
    from trainers.loop import TrainLoop


class StartupMetrics(LoopCallback):
    def __init__(self, marks: StartupMarks):
        self.marks, self.due = marks, True

    def on_start(self, loop: TrainLoop) -> None:
        self.began = time.time()  # the model is built and its data pulled
        self.adapter, self.logger = loop.adapter, loop.ctx.logger

    def on_steps_end(self, epoch: int, done: int, count: int) -> None:
        if self.due:
            self.logger.log_extra(epoch, self.marks.metrics(self.began, self.adapter.load_s, time.time()))
            self.due = False
