"""An elastic run's sizes (`trainer.min_workers`): rank 0 adds each attempt's number of workers, where it took over
and why to the run's `workers` tag ("3 from the start,2 from epoch 1 step 20 (shrunk from 3: workers lost),3 from
epoch 2 step 10 (grown from 2: room for more)"; "restarted" when a failure restarted it at the size that wrote its
checkpoint) and logs `world_size` each epoch (the size that ended it)."""
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
        reason = why(loop.restored_world_size, ctx.world_size)
        ctx.logger.append_tag(WORKERS_TAG, f"{ctx.world_size} from {where}{reason}")

    def epoch_extras(self, epoch: int, metrics: dict[str, float]) -> dict[str, float]:
        return {WORLD_SIZE: float(self.loop.ctx.world_size)}


def why(before: int | None, now: int) -> str:
    """Why an attempt of `now` workers took over from a checkpoint written by `before` (None: none, or not
    recorded)."""
    if before is None:
        return ""
    if now < before:
        return f" (shrunk from {before}: workers lost)"
    return f" (grown from {before}: room for more)" if now > before else " (restarted)"
