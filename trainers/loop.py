"""The one training loop every backend runs, framework-free (no torch, TensorFlow or Ray imported here).

A backend supplies an `Adapter` (trainers/adapter.py: model, optimizer, data shard, one training step, evaluation, state
files, an all-reduce) and a `WorkerContext` (rank, how to report, the checkpoint to resume from; trainers/worker.py
builds it from Ray Train). The loop owns everything the contract promises: epochs and the resume point, skipping the
steps a stopped epoch already trained on, the STOP agreement between ranks, `step_loss`, the epoch metrics
(contract/metrics.py), each rank's step times and the straggler check (contract/stragglers.py), the best epoch and
early stopping (`run.monitor`, `run.patience`), the checkpoint schema (contract/checkpoint.py) and what rank 0
logs. The optimizer-step recipe (schedule, clipping, accumulation, precision) is the adapter's, from
contract/recipe.py. Keras `fit` keeps its own loop and calls `end_epoch` from a callback (trainers/tf/keras_fit.py).
"""
from __future__ import annotations

import itertools
import json
import math
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Protocol

from contract.checkpoint import EpochTotals, TrainState, partial_over_ranks
from contract.mfu import utilisation
from contract.hang import NoProgress, Progress
from contract.metrics import (DIVERGED_FILE, DIVERGED_METRICS, EPOCH_END, REPORTED_EPOCH, PendingReduce, Reducer,
                              epoch_line, epoch_metrics, stop_metrics)
from contract.progress import NoBar, StepBar
from contract.recipe import Monitor
from contract.resume import STOP_CHECK_EVERY
from contract.startup import StartupMarks
from contract.stragglers import STRAGGLER_TAG, RankTimes, gathered, per_step, rank_metrics, straggler_line, stragglers
from contract.console import say
from trainers.adapter import Adapter, StepProfiler


class MetricsSink(Protocol):
    """Rank 0's MLflow logging (contract.tracking.EpochLogger)."""

    def log(self, epoch: int, metrics: dict[str, float]) -> None: ...
    def log_extra(self, epoch: int, metrics: dict[str, float]) -> None: ...
    def log_step_loss(self, step: int, loss: float) -> None: ...
    def flush(self) -> None: ...
    def resumed_from(self, epoch: int) -> None: ...
    def log_artifacts(self, folder: str, path: str) -> None: ...
    def tag(self, key: str, value: str) -> None: ...


@dataclass
class WorkerContext:
    """What the loop needs from the cluster: Ray Train in a run (trainers/worker.py), plain objects in tests."""
    rank: int
    world_size: int
    report: Callable[[dict[str, float], str | None], None]  # (metrics, this rank's checkpoint folder or None)
    epochs: int
    restored: Any = None                  # a checkpoint with `as_directory()` to resume from, or None
    logger: MetricsSink | None = None     # rank 0's MLflow logger; None on the other ranks
    stop_file: Path | None = None         # STOP in `run.resume_dir` (contract/resume.py)
    log_every_n_steps: int = 0            # `step_loss` every n global steps; 0: off
    before_epoch: Callable[[int], None] | None = None  # testing hook (fault injection)
    stop_check_every: int = STOP_CHECK_EVERY
    nan_patience: int = 3                 # `run.nan_patience`: non-finite logged step losses in a row that end a run
    origin: dict[str, Any] | None = None  # what wrote the checkpoints (contract/checkpoint.py checkpoint_origin)
    run_folder: Path | None = None        # rank 0: the Ray Train run's folder (shared storage), for DIVERGED_FILE
    monitor: Monitor = Monitor()          # the best epoch and early stopping (`run.monitor`, `run.patience`)
    evaluated: str = "test_accuracy"      # the task's evaluation metric (contract/metrics.py EVAL_METRICS)
    profile_steps: int = 0                # `trainer.profile_steps`: profile this many steps (rank 0) ...
    profile_dir: Path | None = None       # ... into this folder, logged as the run's `profile/` artifacts
    step_bar: Callable[[str, int, int], StepBar] | None = None  # rank 0 with progress wanted: (description, steps
                                                                 # in the epoch, steps done) -> the epoch's bar
    startup: StartupMarks | None = None   # rank 0, a run's first attempt: logs `startup.*` at its first step
    device: Any = None                    # what the worker computes on (PyTorch: its torch.device; None: the CPU)
    mid_epoch: Callable[[int], None] | None = None  # testing hook (fault injection), halfway through an epoch,
                                                     # where a backend calls it (tf_ps)
    before_step: Callable[[int, int], None] | None = None  # testing hook (a hang): (epoch, global step)
    flops_per_sample: float | None = None  # the model's training FLOPs per sample (contract/mfu.py) ...
    peak_flops: float | None = None       # ... and one device's peak FLOP/s at the run's precision, if known
    progress: Progress = NoProgress()     # this rank's position, for the hang watcher (contract/hang.py)
    straggler_ratio: float = 2.0          # `run.straggler_ratio` (contract/stragglers.py); 0: name none


def train(adapter: Adapter, ctx: WorkerContext, dump_dir: str | None) -> bool:
    """A worker's remaining epochs on the loop, then its final parameters into `dump_dir` (`run.dump_params_dir`,
    if set). False: stopped on request, with a checkpoint."""
    if not TrainLoop(adapter, ctx).run():
        return False
    adapter.dump(dump_dir)
    return True


class StopAgreement:
    """True on every rank at the same step once STOP exists. Every `every` steps the ranks agree through one
    all-reduce of a flag, so a rank that sees the file late still stops with the others; checking every step
    would add a collective to each step of a small model."""

    def __init__(self, path: Path | None, reduce: Reducer, every: int):
        self.path, self.reduce, self.every = path, reduce, every

    def __call__(self, steps: int) -> bool:
        if self.path is None or steps % self.every:
            return False
        (flag,) = self.reduce([float(self.path.exists())], "max")
        return flag > 0


@dataclass
class StepClock:
    """This attempt's part of an epoch, timed on this rank: steps, the seconds they took (waiting for batches
    included), the part spent waiting for batches and the part in the adapter's forward passes."""
    forward_at_start: float
    steps: int = 0
    step_s: float = 0.0
    data_wait_s: float = 0.0
    forward_s: float = 0.0

    def stop(self, started: float, forward_now: float) -> None:
        self.step_s = time.perf_counter() - started
        self.forward_s = forward_now - self.forward_at_start

    def means(self) -> RankTimes:
        return per_step(self.step_s, self.data_wait_s, self.forward_s, self.steps)


class TrainLoop:
    """Epochs of `adapter` under `ctx`. Construction restores the checkpoint (if any) into the adapter."""

    def __init__(self, adapter: Adapter, ctx: WorkerContext):
        self.adapter, self.ctx = adapter, ctx
        self.should_stop = StopAgreement(ctx.stop_file, adapter.reduce, ctx.stop_check_every)
        self.state = self._restore()
        self.began = time.time()  # the model is built and its data pulled (contract/startup.py)
        self.startup_due = ctx.startup is not None and ctx.logger is not None
        self.first_epoch = self.state.epoch + 1  # of this attempt
        self.profiler: StepProfiler | None = None
        self.profiled = False  # this attempt has profiled its steps
        self.step_loss_in_flight: tuple[int, PendingReduce] | None = None  # a logged step and its all-reduce
        self.non_finite_losses = 0  # logged step losses in a row that are not finite (the same count on every rank)
        self.diverged_at: int | None = None  # the global step where they reached `nan_patience` (0: an epoch's mean)
        self.clock: StepClock | None = None  # this attempt's step times of the epoch (None: Keras `fit` ran it)

    def _restore(self) -> TrainState:
        if self.ctx.restored is None:
            return TrainState()
        self.ctx.progress.at(0, 0, "restore")
        with self.ctx.restored.as_directory() as directory:
            self.adapter.load(directory)
            state = TrainState.read(directory)
        if self.ctx.logger is not None:
            self.ctx.logger.resumed_from(state.epoch)
            if state.metrics is not None:  # the failure may have hit between the report and the log
                self.ctx.logger.log(state.epoch, state.metrics)
        return state

    def run(self) -> bool:
        """Train the remaining epochs. False: stopped on request, with a checkpoint of the half-done epoch."""
        if self.early_stopped():
            return True
        for epoch in range(self.first_epoch, self.ctx.epochs + 1):
            if self.ctx.before_epoch is not None:
                self.ctx.before_epoch(epoch)
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
        adapter, progress, before_step = self.adapter, self.ctx.progress, self.ctx.before_step
        batches = adapter.batches(epoch, skip=totals.steps)
        bar = self.open_step_bar(epoch, totals.steps)
        self.start_profile(epoch)
        clock = self.clock = StepClock(adapter.forward_s)
        start = time.perf_counter()
        stopped = False
        while True:
            progress.at(epoch, totals.steps + 1, "data")
            wait_start = time.perf_counter()
            turns = list(itertools.islice(batches, self.steps_in_call(totals.steps)))
            waited = time.perf_counter() - wait_start
            totals.data_wait_s += waited
            clock.data_wait_s += waited
            if not turns:
                break
            clock.steps += len(turns)
            if before_step is not None:
                before_step(epoch, (epoch - 1) * adapter.steps_per_epoch() + totals.steps + 1)
            progress.at(epoch, totals.steps + 1, "step")
            self.count_steps(epoch, totals, adapter.train_steps(turns), bar)
            if self.diverged_at is not None:
                break  # every rank at once: each settled the same all-reduced losses
            if adapter.at_update_boundary() and self.should_stop(totals.steps):
                stopped = True
                break
        self.settle_step_losses()
        if not stopped and self.diverged_at is None:
            adapter.finish_epoch()
        totals.train_s += time.perf_counter() - start
        clock.stop(start, adapter.forward_s)
        bar.close()
        self.stop_profile()  # a short epoch: fewer steps than asked
        return not stopped

    def count_steps(self, epoch: int, totals: EpochTotals, results: list[tuple[float, int, int]], bar: StepBar) -> None:
        """The (loss, samples, tokens) of each step trained into the epoch's totals, step losses, start-up metrics,
        progress bar and profile, up to a step whose loss shows the run diverged."""
        for loss, samples, tokens in results:
            totals.loss_sum += loss * samples
            totals.samples += samples
            totals.steps += 1
            totals.tokens += tokens
            self.log_step_loss(epoch, totals.steps, loss, global_mean=self.adapter.loss_is_global)
            if self.diverged_at is not None:
                return
            self.log_startup(epoch)
            bar.update(1)
            self.profile_step()

    def steps_in_call(self, done: int) -> int:
        """How many steps the adapter's next call trains: its `steps_per_call`, ending at the next STOP check."""
        per_call = self.adapter.steps_per_call
        if per_call == 1 or self.ctx.stop_file is None:
            return per_call
        every = self.ctx.stop_check_every
        return min(per_call, every - done % every)

    def log_startup(self, epoch: int) -> None:
        """After the attempt's first step: rank 0 logs where the run's start-up went (`startup.*`), once."""
        if not self.startup_due:
            return
        self.ctx.logger.log_extra(epoch, self.ctx.startup.metrics(self.began, self.adapter.load_s, time.time()))
        self.startup_due = False

    def open_step_bar(self, epoch: int, done: int) -> StepBar:
        """The progress bar of the epoch's training steps (`run.progress`, rank 0), `done` of them trained before."""
        if self.ctx.step_bar is None:
            return NoBar()
        return self.ctx.step_bar(f"train epoch {epoch}/{self.ctx.epochs}", self.adapter.steps_per_epoch(), done)

    def start_profile(self, epoch: int) -> None:
        """Rank 0, the first epoch of the attempt: start the adapter's profiler (`trainer.profile_steps`)."""
        ctx = self.ctx
        if ctx.profile_steps and ctx.profile_dir is not None and epoch == self.first_epoch and not self.profiled:
            self.profiler = self.adapter.profiler(str(ctx.profile_dir), ctx.profile_steps)
            self.profiler.start()
            self.profiled = True

    def profile_step(self) -> None:
        if self.profiler is not None and self.profiler.step():
            self.stop_profile()

    def stop_profile(self) -> None:
        """Stop and write the trace; rank 0's logger sends the folder to the run (`profile/`)."""
        if self.profiler is None:
            return
        self.profiler.stop()
        self.profiler = None
        if self.ctx.logger is not None:
            self.ctx.logger.log_artifacts(str(self.ctx.profile_dir), "profile")

    def log_step_loss(self, epoch: int, step_in_epoch: int, loss: float, since_step: int | None = None,
                      global_mean: bool = False) -> None:
        """`step_loss` when the global step crosses a multiple of `log_every_n_steps`: the mean loss of the global
        batch, whatever the backend. `loss` is this rank's batch loss, averaged over the ranks by an all-reduce
        started on those steps (every rank calls) and settled at the next one or at the epoch's end. `global_mean`:
        it already is that mean (`Adapter.loss_is_global`; Keras `fit`'s synchronized loss metric, which rank 0
        alone hands over, covering the steps since `since_step`)."""
        every = self.ctx.log_every_n_steps
        if every <= 0:
            return
        offset = (epoch - 1) * self.adapter.steps_per_epoch()
        previous = step_in_epoch - 1 if since_step is None else since_step
        if (offset + step_in_epoch) // every <= (offset + previous) // every:
            return
        step = offset + step_in_epoch
        if global_mean:
            if self.ctx.logger is not None:
                self.ctx.logger.log_step_loss(step, loss)
            return
        # The all-reduce runs while the next steps train: a blocking one holds up every logged step
        # (benchmarks/README.md, tracking overhead). By the next logged step it has long ended.
        self.settle_step_losses()
        self.step_loss_in_flight = (step, self.adapter.reduce_later([loss], "sum"))

    def settle_step_losses(self) -> None:
        """Wait for the step loss's all-reduce in flight, if any; rank 0 logs that step's mean over the ranks (every
        rank calls). Ranks of one model replica (TP, PP) hold the same loss: the mean over all ranks is the
        replicas'."""
        if self.step_loss_in_flight is None:
            return
        (step, pending), self.step_loss_in_flight = self.step_loss_in_flight, None
        (total,) = pending()
        if self.ctx.logger is not None:
            self.ctx.logger.log_step_loss(step, total / self.ctx.world_size)
        self.non_finite_losses = 0 if math.isfinite(total) else self.non_finite_losses + 1
        if self.non_finite_losses >= self.ctx.nan_patience and self.diverged_at is None:
            self.diverged_at = step

    def end_epoch(self, epoch: int, totals: EpochTotals) -> bool:
        """Evaluate, reduce the metrics over the ranks, checkpoint, report, and log (rank 0). Collective. True when
        `run.patience` epochs have passed without a better monitored metric (the same on every rank: the metrics
        are reduced over all of them)."""
        adapter, progress = self.adapter, self.ctx.progress
        progress.at(epoch, totals.steps, "evaluate")
        began = time.perf_counter()
        score, total = adapter.evaluate(epoch)
        progress.at(epoch, totals.steps, "metrics")
        metrics = epoch_metrics(totals, score, total, adapter.reduce, adapter.peak_memory_bytes(),
                                adapter.ranks_per_sample, self.ctx.evaluated)
        if not math.isfinite(metrics["train_loss"]):  # reduced over the ranks: every rank sees it
            self.diverged_at = 0
            self.report_diverged(epoch)
            return True
        if epoch == self.first_epoch:
            metrics["data_load_s"] = adapter.load_s
        extras = {**adapter.epoch_extras(), **self.rank_times(epoch)}
        if self.ctx.flops_per_sample:  # `tflops_per_rank`, and `mfu` where the device's peak is known
            extras.update(utilisation(self.ctx.flops_per_sample, metrics["samples_per_s"], self.ctx.world_size,
                                      self.ctx.peak_flops))
        self.state = self.state.after_epoch(epoch, metrics, self.ctx.monitor)
        progress.at(epoch, totals.steps, "checkpoint")
        self._checkpoint_and_report({**metrics, REPORTED_EPOCH: epoch}, self.state)
        extras[EPOCH_END] = time.perf_counter() - began  # evaluation, metrics, checkpoint: the run's goodput counts it
        if self.ctx.rank == 0:
            say(epoch_line(epoch, self.ctx.epochs, metrics))
        if self.ctx.logger is not None:
            self.ctx.logger.log(epoch, metrics)
            self.ctx.logger.log_extra(epoch, extras)
        return self.ctx.monitor.exhausted(epoch, self.state.best_epoch)

    def rank_times(self, epoch: int) -> dict[str, float]:
        """Every rank's step time, data wait and forward per step in this attempt's part of the epoch, gathered
        (collective; none after Keras `fit`, which times no steps); rank 0 names a straggler in a warning line and
        the run's `straggler` tag (contract/stragglers.py)."""
        if self.clock is None:
            return {}
        ctx = self.ctx
        times = gathered(self.clock.means(), ctx.rank, ctx.world_size,
                         lambda values: self.adapter.reduce(values, "sum"))
        found = stragglers(times, ctx.straggler_ratio)
        if found and ctx.rank == 0:
            line = straggler_line(epoch, times, found, ctx.straggler_ratio)
            say(f"warning: {line}")
            if ctx.logger is not None:
                ctx.logger.tag(STRAGGLER_TAG, line)
        return rank_metrics(times)

    def report_stop(self, epoch: int, totals: EpochTotals) -> None:
        """Checkpoint the half-done epoch; the driver sees STOP_METRICS and marks the run as stopped. The report
        scores the monitored metric worst, so Ray Train never keeps this checkpoint as a best one."""
        self.ctx.progress.at(epoch, totals.steps, "checkpoint")
        state = replace(self.state, partial=partial_over_ranks(totals, self.adapter.reduce))
        monitor = self.ctx.monitor
        self._checkpoint_and_report({**stop_metrics(epoch, totals.steps), monitor.metric: monitor.worst()}, state)
        if self.ctx.logger is not None:
            self.ctx.logger.flush()  # the stopped epoch's step losses

    def report_diverged(self, epoch: int) -> None:
        """The loss stopped being a number: report where (every rank, no checkpoint: the last one reported is the
        last finite state) and train no more; the driver sees DIVERGED_METRICS and fails the run."""
        if self.ctx.logger is not None:
            self.ctx.logger.flush()  # the step losses that show it
        where = dict(zip(DIVERGED_METRICS, (float(epoch), float(self.diverged_at))))
        if self.ctx.run_folder is not None:
            self.ctx.run_folder.mkdir(parents=True, exist_ok=True)
            (self.ctx.run_folder / DIVERGED_FILE).write_text(json.dumps(where))
        monitor = self.ctx.monitor
        self.ctx.report({**where, monitor.metric: monitor.worst()}, None)

    def _checkpoint_and_report(self, metrics: dict[str, float], state: TrainState) -> None:
        with tempfile.TemporaryDirectory() as directory:
            self.adapter.save(directory)  # every rank: saving may be collective
            if self.ctx.rank == 0:  # the one state file: Ray Train merges every rank's folder of a sharded checkpoint
                state.write(directory, self.ctx.origin)
            reports_folder = self.ctx.rank == 0 or self.adapter.sharded_checkpoint
            self.ctx.report(metrics, directory if reports_folder else None)
