"""`step_loss`: every `trainer.log_every_n_steps` global steps, rank 0 logs the global batch's mean loss, whatever
the backend; and a run whose logged step losses stop being numbers `run.nan_patience` times in a row has diverged.
A component of the shared loop (trainers/loop.py), which asks after each step whether the run diverged."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from contract.metrics import PendingReduce

if TYPE_CHECKING:
    from trainers.adapter import Adapter
    from trainers.context import WorkerContext


class StepLosses:
    def __init__(self, adapter: Adapter, ctx: WorkerContext):
        self.adapter, self.ctx = adapter, ctx
        self.in_flight: tuple[int, PendingReduce] | None = None  # a logged step and its all-reduce
        self.non_finite = 0  # logged step losses in a row that are not finite (the same count on every rank)
        self.diverged_at: int | None = None  # the global step where they reached `nan_patience` (0: an epoch's mean)

    def log(self, epoch: int, step_in_epoch: int, loss: float, since_step: int | None = None,
            global_mean: bool = False) -> None:
        """`step_loss` when the global step crosses a multiple of `log_every_n_steps`. `loss` is this rank's batch
        loss, averaged over the ranks by an all-reduce started on those steps (every rank calls) and settled at the
        next one or at the epoch's end. `global_mean`: it already is that mean (`Adapter.loss_is_global`; Keras
        `fit`'s synchronized loss metric, which rank 0 alone hands over, covering the steps since `since_step`)."""
        every = self.ctx.log_every_n_steps
        if every <= 0:
            return
        offset = (epoch - 1) * self.adapter.steps_per_epoch()
        previous = step_in_epoch - 1 if since_step is None else since_step
        if (offset + step_in_epoch) // every <= (offset + previous) // every:
            return
        step = offset + step_in_epoch
        if global_mean:
            self.ctx.logger.log_step_loss(step, loss)
            return
        # The all-reduce runs while the next steps train: a blocking one holds up every logged step
        # (benchmarks/README.md, tracking overhead). By the next logged step it has long ended.
        self.settle()
        self.in_flight = (step, self.adapter.reduce_later([loss], "sum"))

    def settle(self) -> None:
        """Wait for the step loss's all-reduce in flight, if any; rank 0 logs that step's mean over the ranks (every
        rank calls). Ranks of one model replica (TP, PP) hold the same loss: the mean over all ranks is the
        replicas'."""
        if self.in_flight is None:
            return
        (step, pending), self.in_flight = self.in_flight, None
        (total,) = pending()
        self.ctx.logger.log_step_loss(step, total / self.ctx.world_size)
        self.non_finite = 0 if math.isfinite(total) else self.non_finite + 1
        if self.non_finite >= self.ctx.nan_patience and self.diverged_at is None:
            self.diverged_at = step
