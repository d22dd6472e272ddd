"""tf-keras `model.fit` on the shared loop (trainers/loop.py), for the TensorFlow backends whose `trainer.tf_loop`
may be `fit` (tf_mwms, tf_ps): Keras keeps its own loop, and callbacks hand each epoch to the loop's `end_epoch`
(metrics, checkpoint, report, MLflow), the step losses to its `log_step_loss`, and drive its progress bar, start-up
metrics and profiler. How Keras is fed and fits is the adapter's (`FitAdapter.fit`).
"""
from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np

from contract.checkpoint import EpochTotals
from trainers.loop import TrainLoop, WorkerContext


class FitAdapter(Protocol):
    """What `fit_epochs` needs of a TF backend's adapter, beyond the loop's `Adapter`."""

    steps: int           # batches per epoch
    rows_per_step: int   # this worker's rows per batch
    passes: int          # batches per optimizer step (grad_accum)
    batch_hooks: bool    # Keras may call batch-level callbacks (not under ParameterServerStrategy)

    def epoch_tokens(self, epoch: int) -> np.ndarray: ...
    def fit(self, first_epoch: int, epochs: int, callbacks: list) -> None:
        """tf-keras `model.fit` over epochs `first_epoch`..`epochs` (1-based), with `callbacks`."""


def run_epochs(keras: Any, adapter: FitAdapter, ctx: WorkerContext, tf_loop: str) -> bool:
    """The remaining epochs through Keras `fit` (`tf_loop=fit`) or the shared loop's own. False: stopped."""
    loop = TrainLoop(adapter, ctx)
    if tf_loop != "fit":
        return loop.run()
    if loop.first_epoch <= ctx.epochs and not loop.early_stopped():
        fit_epochs(keras, loop, adapter, ctx.epochs)
    return True


def fit_epochs(keras: Any, loop: TrainLoop, adapter: FitAdapter, epochs: int) -> None:
    """tf-keras `model.fit` over the remaining epochs; a callback hands each epoch's totals to `loop.end_epoch`.
    `fit` does not watch STOP: a preempted fit run resumes from its last epoch checkpoint."""
    ctx = loop.ctx
    callbacks = [report_each_epoch(keras, loop, adapter)]
    if loop.startup_due:
        callbacks.append(log_startup(keras, loop, adapter.batch_hooks))
    # Without batch hooks the config refuses step losses, a forced bar and profiling (pipelines/backend_checks.py).
    if adapter.batch_hooks:
        if ctx.logger is not None and ctx.log_every_n_steps > 0:
            callbacks.append(log_step_loss(keras, loop, adapter))
        if ctx.step_bar is not None:
            callbacks.append(show_progress(keras, loop, adapter))
        if ctx.profile_steps and ctx.profile_dir is not None:
            callbacks.insert(0, profile_steps(keras, loop))  # before the report: the trace goes before the epoch's
    adapter.fit(loop.first_epoch, epochs, callbacks)


def report_each_epoch(keras: Any, loop: TrainLoop, adapter: FitAdapter) -> Any:
    """Hands each epoch's totals to `loop.end_epoch` (metrics, checkpoint, report, MLflow); early stopping."""
    ctx = loop.ctx

    class ReportEachEpoch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):  # Keras counts epochs from 0
            if ctx.before_epoch is not None:
                ctx.before_epoch(epoch + 1)
            ctx.progress.at(epoch + 1, 0, "fit")  # no step marks inside `fit`: the hang watcher waits it out
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            samples = adapter.steps * adapter.rows_per_step
            # tf.data prefetches inside fit's step function: data waits are not separable here (reported 0).
            totals = EpochTotals(loss_sum=float(logs["loss"]) * samples, samples=samples, steps=adapter.steps,
                                 train_s=time.perf_counter() - self.start,
                                 tokens=int(adapter.epoch_tokens(epoch + 1).sum()))
            if loop.end_epoch(epoch + 1, totals):
                self.model.stop_training = True  # early stopping (`run.patience`), decided alike on every worker

    return ReportEachEpoch()


def log_step_loss(keras: Any, loop: TrainLoop, adapter: FitAdapter) -> Any:
    """Only added when step_loss is wanted: any batch hook makes Keras fetch the loss to the host."""

    class LogStepLoss(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch, self.seen, self.mean = epoch + 1, 0, 0.0

        def on_train_batch_end(self, batch, logs=None):
            # Called every tf_steps_per_execution fit steps (of `passes` batches each) with the epoch's running
            # mean loss per batch: the batches since the last call had mean (mean_k * k - mean_j * j) / (k - j).
            done, mean = min((batch + 1) * adapter.passes, adapter.steps), float(logs["loss"])
            window = (mean * done - self.mean * self.seen) / (done - self.seen)
            loop.log_step_loss(self.epoch, done, window, since_step=self.seen, global_mean=True)
            self.seen, self.mean = done, mean

    return LogStepLoss()


def show_progress(keras: Any, loop: TrainLoop, adapter: FitAdapter) -> Any:
    """The bar of each epoch's steps (`run.progress`, rank 0); a batch hook ends each compiled call of
    `tf_steps_per_execution` fit steps, so the bar moves by that many batches."""

    class ShowProgress(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.bar, self.done = loop.open_step_bar(epoch + 1, 0), 0

        def on_train_batch_end(self, batch, logs=None):
            done = min((batch + 1) * adapter.passes, adapter.steps)
            self.bar.update(done - self.done)
            self.done = done

        def on_epoch_end(self, epoch, logs=None):
            self.bar.close()

    return ShowProgress()


def log_startup(keras: Any, loop: TrainLoop, batch_hooks: bool) -> Any:
    """`startup.*` (rank 0, the run's first attempt) after fit's first call of `tf_steps_per_execution` steps; where
    Keras has no batch hooks (ParameterServerStrategy, which refuses a callback that overrides one), when fit
    begins its first epoch, so the first-step part is fit's own set-up (the workers' datasets) without the first
    step."""

    class LogStartup(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self._supports_tf_logs = True  # no per-batch copy of the logs to numpy for this hook

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch + 1

        def on_train_batch_end(self, batch, logs=None):
            loop.log_startup(self.epoch)

    class LogStartupAtFirstEpoch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            loop.log_startup(epoch + 1)

    return LogStartup() if batch_hooks else LogStartupAtFirstEpoch()


def profile_steps(keras: Any, loop: TrainLoop) -> Any:
    """Drives the loop's profiler (`trainer.profile_steps`, rank 0). A batch hook here ends a compiled call of
    `tf_steps_per_execution` steps: each profiled "step" is one such call."""

    class ProfileSteps(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            loop.start_profile(epoch + 1)

        def on_train_batch_end(self, batch, logs=None):
            loop.profile_step()

        def on_epoch_end(self, epoch, logs=None):
            loop.stop_profile()

    return ProfileSteps()
