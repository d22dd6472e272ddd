"""Every rank's step time, data wait and forward per step, logged each epoch as `rank<r>.*`; a rank far slower
than the others is named in a warning line and the run's `straggler` tag (contract/stragglers.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from contract.console import say
from contract.stragglers import STRAGGLER_TAG, gathered, rank_metrics, straggler_line, stragglers
from trainers.callbacks.base import LoopCallback

if TYPE_CHECKING:
    from trainers.loop import TrainLoop


class StepTimes(LoopCallback):
    """`ratio`: `run.straggler_ratio` (0: name none)."""

    def __init__(self, ratio: float = 2.0):
        self.ratio = ratio

    def on_start(self, loop: TrainLoop) -> None:
        self.loop = loop

    def epoch_extras(self, epoch: int, metrics: dict[str, float]) -> dict[str, float]:
        """This attempt's part of the epoch, gathered from every rank (collective); none after Keras `fit`, which
        times no steps."""
        loop = self.loop
        if loop.clock is None:
            return {}
        ctx = loop.ctx
        times = gathered(loop.clock.means(), ctx.rank, ctx.world_size,
                         lambda values: loop.adapter.reduce(values, "sum"))
        found = stragglers(times, self.ratio)
        if found and ctx.rank == 0:
            line = straggler_line(epoch, times, found, self.ratio)
            say(f"warning: {line}")
            ctx.logger.tag(STRAGGLER_TAG, line)
        return rank_metrics(times)
