"""The one training loop every backend runs, framework-free (no torch, TensorFlow or Ray imported here).

A backend supplies an `Adapter` (trainers/adapter.py: model, optimizer, data shard, one training step, evaluation,
state files, an all-reduce) and a `WorkerContext` (trainers/context.py: rank, how to report, the checkpoint to resume
from; trainers/worker.py builds it from Ray Train). The loop owns what the contract promises: epochs and the resume
point, skipping the steps a stopped epoch already trained on, the STOP agreement between ranks, checkpoints inside
epochs, `step_loss` (trainers/step_losses.py), the epoch metrics (contract/metrics.py), the best epoch and early
stopping (`run.monitor`, `run.patience`), the checkpoint schema (contract/checkpoint.py) and what rank 0 logs. Side
concerns (hang marks, the step bar, profiling, start-up metrics, per-rank step times, MFU, fault injection) are
`LoopCallback`s told at named hooks (trainers/callbacks/). The optimizer-step recipe (schedule, clipping,
accumulation, precision) is the adapter's. Keras `fit` and Lightning keep their own loops and hand their steps and
epochs to this one.
"""
from __future__ import annotations

import itertools
import math
import shutil
import tempfile
import time
from dataclasses import replace

from contract.checkpoint import EpochTotals, TrainState, checkpoint_world_size, partial_over_ranks
from contract.console import say
from contract.metrics import (DIVERGED_METRICS, EPOCH_END, REPORTED_BEST_EPOCH, REPORTED_EPOCH, STEP_CHECKPOINTS,
                              STEP_CHECKPOINTS_S, epoch_line, epoch_metrics, step_checkpoint_metrics, stop_metrics)
from contract.resume import StepChecks
from contract.stragglers import StepClock
from trainers.adapter import Adapter
from trainers.callbacks.base import Callbacks
from trainers.context import WorkerContext
from trainers.step_losses import StepLosses


def train(adapter: Adapter, ctx: WorkerContext, dump_dir: str | None) -> bool:
    """A worker's remaining epochs on the loop, then its final parameters into `dump_dir` (`run.dump_params_dir`,
    if set). False: stopped on request, with a checkpoint."""
    if not TrainLoop(adapter, ctx).run():
        return False
    adapter.dump(dump_dir)
    return True


class TrainLoop:
    """Epochs of `adapter` under `ctx`. Construction restores the checkpoint (if any) into the adapter."""

    def __init__(self, adapter: Adapter, ctx: WorkerContext):
        self.adapter, self.ctx = adapter, ctx
        self.callbacks = Callbacks(ctx.callbacks)
        self.checks = StepChecks(ctx.stop_file, adapter.reduce, ctx.stop_check_every, ctx.checkpoint_every_n_steps,
                                 ctx.checkpoint_every_s)
        self.step_losses = StepLosses(adapter, ctx)
        self.restored_world_size: int | None = None  # the workers that wrote the checkpoint it resumed from
        self.state = self._restore()
        self.first_epoch = self.state.epoch + 1  # of this attempt
        self.checks.checkpointed(self.global_step(self.first_epoch, self.state.totals_for(self.first_epoch).steps))
        self.clock: StepClock | None = None  # this attempt's step times of the epoch (None: Keras `fit` ran it)
        self.step_checkpoints: list[float] = []  # the seconds each checkpoint inside the epoch held training up
        self.callbacks.on_start(self)

    def _restore(self) -> TrainState:
        if self.ctx.restored is None:
            return TrainState()
        self.callbacks.on_phase(0, 0, "restore")
        with self.ctx.restored.as_directory() as directory:
            self.adapter.load(directory)
            state = TrainState.read(directory)
            self.restored_world_size = checkpoint_world_size(directory)
        self.ctx.logger.resumed_from(state.epoch, state.partial.steps if state.partial is not None else 0)
        if state.metrics is not None:  # the failure may have hit between the report and the log
            self.ctx.logger.log(state.epoch, state.metrics)
        return state

    def global_step(self, epoch: int, steps: int) -> int:
        """The run's step count after `steps` of `epoch`."""
        return (epoch - 1) * self.adapter.steps_per_epoch() + steps

    @property
    def diverged_at(self) -> int | None:
        """The global step whose logged loss showed the run diverged (0: an epoch's mean), or None."""
        return self.step_losses.diverged_at

    def run(self) -> bool:
        """Train the remaining epochs. False: stopped on request, with a checkpoint of the half-done epoch."""
        if self.early_stopped():
            return True
        for epoch in range(self.first_epoch, self.ctx.epochs + 1):
            totals = self.state.totals_for(epoch, self.ctx.rank)
            stopped = not self.train_epoch(epoch, totals)
            if self.diverged_at is not None:
                self.report_diverged(epoch)
                return True
            if stopped:
                self.report_stop(epoch, totals)
                return False
            if self.end_epoch(epoch, totals):
                break  # early stopping: the run is finished
        return True

    def early_stopped(self) -> bool:
        """The restored state had already run out of patience (a restart after early stopping trains no more)."""
        return self.state.epoch > 0 and self.ctx.monitor.exhausted(self.state.epoch, self.state.best_epoch)

    def train_epoch(self, epoch: int, totals: EpochTotals) -> bool:
        """One pass, continuing `totals`; the wait for each batch is timed apart from the whole step. Returns
        False when the ranks agreed to stop (only at an update boundary: no accumulated gradient is lost).

        An adapter that trains several steps per call (`Adapter.steps_per_call`) gets them together; a call never
        crosses a step where the ranks check for STOP, so they stop where one step per call would stop."""
        adapter, callbacks = self.adapter, self.callbacks
        callbacks.on_epoch_start(epoch, totals.steps)
        batches = adapter.batches(epoch, skip=totals.steps)
        clock = self.clock = StepClock(adapter.forward_s)
        start = time.perf_counter()
        stopped = False
        while True:
            callbacks.on_phase(epoch, totals.steps + 1, "data")
            wait_start = time.perf_counter()
            turns = list(itertools.islice(batches, self.steps_in_call(epoch, totals.steps)))
            waited = time.perf_counter() - wait_start
            totals.data_wait_s += waited
            clock.data_wait_s += waited
            if not turns:
                break
            clock.steps += len(turns)
            callbacks.on_step_start(epoch, self.global_step(epoch, totals.steps + 1))
            callbacks.on_phase(epoch, totals.steps + 1, "step")
            self.count_steps(epoch, totals, adapter.train_steps(turns))
            if self.diverged_at is not None:
                break  # every rank at once: each settled the same all-reduced losses
            if adapter.at_update_boundary() and self.after_steps(epoch, totals, start):
                stopped = True
                break
        self.step_losses.settle()
        if not stopped and self.diverged_at is None:
            adapter.finish_epoch()
        totals.train_s += time.perf_counter() - start
        clock.stop(start, adapter.forward_s)
        callbacks.on_epoch_trained(epoch)
        return not stopped

    def count_steps(self, epoch: int, totals: EpochTotals, results: list[tuple[float, int, int]]) -> None:
        """The (loss, samples, tokens) of each step trained into the epoch's totals and step losses, each step told
        to the callbacks, up to a step whose loss shows the run diverged."""
        for loss, samples, tokens in results:
            totals.loss_sum += loss * samples
            totals.samples += samples
            totals.steps += 1
            totals.tokens += tokens
            self.step_losses.log(epoch, totals.steps, loss, global_mean=self.adapter.loss_is_global)
            if self.diverged_at is not None:
                return
            self.callbacks.on_steps_end(epoch, totals.steps, 1)

    def steps_in_call(self, epoch: int, done: int) -> int:
        """How many steps the adapter's next call trains: its `steps_per_call`, ending where the ranks may stop or
        checkpoint, or before a step a callback acts at (a fault injected at that step)."""
        per_call = self.adapter.steps_per_call
        if per_call == 1:
            return 1
        boundary = self.callbacks.steps_to_boundary(self.global_step(epoch, done + 1)) or per_call
        return min(per_call, self.checks.steps_to_next(done, self.global_step(epoch, done)), boundary)

    def after_steps(self, epoch: int, totals: EpochTotals, started: float) -> bool:
        """At an update boundary: checkpoint the half-done epoch where one is due (its training time counted from
        `started`); True when the ranks agreed to stop. Collective."""
        stop, checkpoint = self.checks(totals.steps, self.global_step(epoch, totals.steps))
        if checkpoint and not stop:
            began = time.perf_counter()
            self.report_step(epoch, replace(totals, train_s=began - started + totals.train_s))
            self.step_checkpoints.append(time.perf_counter() - began)
        return stop

    def end_epoch(self, epoch: int, totals: EpochTotals) -> bool:
        """Evaluate, reduce the metrics over the ranks, checkpoint, report, and log (rank 0). Collective. True when
        `run.patience` epochs have passed without a better monitored metric (the same on every rank: the metrics
        are reduced over all of them)."""
        adapter, callbacks = self.adapter, self.callbacks
        callbacks.on_phase(epoch, totals.steps, "evaluate")
        began = time.perf_counter()
        score, total = adapter.evaluate(epoch)
        callbacks.on_phase(epoch, totals.steps, "metrics")
        metrics = epoch_metrics(totals, score, total, adapter.reduce, adapter.peak_memory_bytes(),
                                adapter.ranks_per_sample, self.ctx.evaluated)
        if not math.isfinite(metrics["train_loss"]):  # reduced over the ranks: every rank sees it
            self.step_losses.diverged_at = 0
            self.report_diverged(epoch)
            return True
        if epoch == self.first_epoch:
            metrics["data_load_s"] = adapter.load_s
        extras = {**adapter.epoch_extras(), **callbacks.epoch_extras(epoch, metrics)}
        self.state = self.state.after_epoch(epoch, metrics, self.ctx.monitor)
        callbacks.on_phase(epoch, totals.steps, "checkpoint")
        self._checkpoint_and_report({**metrics, REPORTED_EPOCH: epoch, REPORTED_BEST_EPOCH: self.state.best_epoch},
                                    self.state)
        self.checks.checkpointed(self.global_step(epoch + 1, 0))
        extras[EPOCH_END] = time.perf_counter() - began  # evaluation, metrics, checkpoint: the run's goodput counts it
        if self.step_checkpoints:  # inside the epoch's time: the run's goodput counts them apart
            taken = self.step_checkpoints
            extras[STEP_CHECKPOINTS_S], extras[STEP_CHECKPOINTS] = sum(taken), len(taken)
            self.step_checkpoints = []
        if self.ctx.rank == 0:
            say(epoch_line(epoch, self.ctx.epochs, metrics))
        self.ctx.logger.log(epoch, metrics)
        self.ctx.logger.log_extra(epoch, extras)
        return self.ctx.monitor.exhausted(epoch, self.state.best_epoch)

    def report_stop(self, epoch: int, totals: EpochTotals) -> None:
        """Checkpoint the half-done epoch; the driver sees STOP_METRICS and marks the run as stopped. The report
        scores the monitored metric worst: a sweep's scheduler, which sees it, never takes it for a good epoch."""
        self.callbacks.on_phase(epoch, totals.steps, "checkpoint")
        state = replace(self.state, partial=partial_over_ranks(totals, self.adapter.reduce))
        monitor = self.ctx.monitor
        self._checkpoint_and_report({**stop_metrics(epoch, totals.steps), monitor.metric: monitor.worst()}, state)
        self.ctx.logger.flush()  # the stopped epoch's step losses

    def report_step(self, epoch: int, totals: EpochTotals) -> None:
        """A checkpoint of the half-done epoch, training going on (`run.checkpoint_every_n_steps`, `_every_s`): a run
        restarted from it trains the rest of the epoch. Saved here, written to storage in the background. The step
        losses up to here are sent first: a restart from it logs only the steps after it."""
        self.callbacks.on_phase(epoch, totals.steps, "checkpoint")
        self.step_losses.settle()
        if self.diverged_at is not None:  # no checkpoint of a diverged state: the loop ends the run at the next step
            return
        self.ctx.logger.flush()
        state = replace(self.state, partial=partial_over_ranks(totals, self.adapter.reduce))
        self._checkpoint_and_report(step_checkpoint_metrics(epoch, totals.steps), state, background=True)
        self.checks.checkpointed(self.global_step(epoch, totals.steps))

    def report_diverged(self, epoch: int) -> None:
        """The loss stopped being a number: report where (every rank, no checkpoint: the last one reported is the
        last finite state) and train no more; the driver sees DIVERGED_METRICS and fails the run."""
        self.ctx.logger.flush()  # the step losses that show it
        where = dict(zip(DIVERGED_METRICS, (float(epoch), float(self.diverged_at))))
        self.callbacks.on_diverged(where)
        monitor = self.ctx.monitor
        self.ctx.report({**where, monitor.metric: monitor.worst()}, None)

    def _checkpoint_and_report(self, metrics: dict[str, float], state: TrainState, background: bool = False) -> None:
        """Every rank saves into a folder of its own (saving may be collective) and reports it; `background`: the
        adapter may finish writing the folder while training goes on (`save_in_background`), and the report's
        upload to storage, which waits for it, too; the upload removes the folder when done."""
        directory = tempfile.mkdtemp(prefix="rtp-checkpoint-")
        reports_folder = self.ctx.rank == 0 or self.adapter.sharded_checkpoint
        written = None
        try:
            if background:
                written = self.adapter.save_in_background(directory)
            else:
                self.adapter.save(directory)
            if self.ctx.rank == 0:  # the one state file: Ray Train merges every rank's folder of a sharded checkpoint
                state.write(directory, self.ctx.origin)
            self.ctx.report(metrics, directory if reports_folder else None, background, written)
        finally:
            if not (background and reports_folder):
                if written is not None:
                    written()
                shutil.rmtree(directory, ignore_errors=True)
