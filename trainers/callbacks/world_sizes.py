"""An elastic run's sizes (`trainer.min_workers`): rank 0 adds each attempt's number of workers and where it took
over to the run's `workers` tag ("3 from the start,2 from epoch 1 step 20,3 from epoch 2 step 10") and logs
`world_size` each epoch (the size that ended it)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from trainers.callbacks.base import LoopCallback

if TYPE_CHECKING:
    from trainers.loop import TrainLoop

WORKERS_TAG, WORLD_SIZE = "workers", "world_size"


class WorldSizes(LoopCallback):
    def on_start(self, loop: TrainLoop) -> None:
        self.loop = loop
        ctx = loop.ctx
        if ctx.rank != 0:
            return
        epoch = loop.first_epoch
        steps = loop.state.totals_for(epoch).steps
        where = "the start" if (epoch, steps) == (1, 0) else f"epoch {epoch} step {steps}"
        ctx.logger.append_tag(WORKERS_TAG, f"{ctx.world_size} from {where}")

    def epoch_extras(self, epoch: int, metrics: dict[str, float]) -> dict[str, float]:
        return {WORLD_SIZE: float(self.loop.ctx.world_size)}
