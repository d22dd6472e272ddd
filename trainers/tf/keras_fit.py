"""tf-keras `model.fit` on the shared loop (trainers/loop.py), for the TensorFlow backends whose `trainer.tf_loop`
may be `fit` (tf_mwms, tf_ps): Keras keeps its own loop, and callbacks hand each epoch to the loop's `end_epoch`
(metrics, checkpoint, report, MLflow), the step losses to its `step_losses`, and tell the loop's callbacks where
fit is (the step bar, start-up metrics, profiler, hang marks, fault injection). How Keras is fed and fits is the
adapter's (`FitAdapter.fit`).
"""
from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np

from contract.checkpoint import EpochTotals
from trainers.context import WorkerContext
from trainers.loop import TrainLoop


class FitAdapter(Protocol):
    """What `run_epochs` needs of a TF backend's adapter for `fit`, beyond the loop's `Adapter`."""

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
        callbacks = [hand_to_loop(keras, loop, adapter)]
        # Any batch hook makes Keras fetch the loss to the host: step losses only where they are logged (rank 0).
        # Without batch hooks the config refuses step losses, a forced bar and profiling (trainers/tf/specs.py).
        if adapter.batch_hooks and ctx.rank == 0 and ctx.log_every_n_steps > 0:
            callbacks.append(log_step_loss(keras, loop, adapter))
        adapter.fit(loop.first_epoch, ctx.epochs, callbacks)
    return True


def hand_to_loop(keras: Any, loop: TrainLoop, adapter: FitAdapter) -> Any:
    """Tells the loop's callbacks where fit is, and hands each epoch's totals to `loop.end_epoch` (metrics,
    checkpoint, report, MLflow; early stopping). `fit` does not watch STOP: a preempted fit run resumes from its
    last epoch checkpoint. A batch hook ends each compiled call of `tf_steps_per_execution` fit steps: the loop's
    callbacks hear of that many steps at once. Where Keras has no batch hooks (ParameterServerStrategy, which
    refuses a callback that overrides one), they hear of none when fit begins an epoch (so the start-up's
    first-step part is fit's own set-up, the workers' datasets), and of all of them when it ends."""
    callbacks = loop.callbacks

    class HandToLoop(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self._supports_tf_logs = True  # no per-batch copy of the logs to numpy for the batch hook

        def on_epoch_begin(self, epoch, logs=None):  # Keras counts epochs from 0
            self.epoch, self.done = epoch + 1, 0
            callbacks.on_epoch_start(self.epoch, 0)
            callbacks.on_phase(self.epoch, 0, "fit")  # no step marks inside `fit`: the hang watcher waits it out
            if not adapter.batch_hooks:
                callbacks.on_steps_end(self.epoch, 0, 0)
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            if not adapter.batch_hooks:
                callbacks.on_steps_end(self.epoch, adapter.steps, adapter.steps)
            callbacks.on_epoch_trained(self.epoch)
            samples = adapter.steps * adapter.rows_per_step
            # tf.data prefetches inside fit's step function: data waits are not separable here (reported 0).
            totals = EpochTotals(loss_sum=float(logs["loss"]) * samples, samples=samples, steps=adapter.steps,
                                 train_s=time.perf_counter() - self.start,
                                 tokens=int(adapter.epoch_tokens(self.epoch).sum()))
            if loop.end_epoch(self.epoch, totals):
                self.model.stop_training = True  # early stopping (`run.patience`), decided alike on every worker

    class HandToLoopWithBatches(HandToLoop):
        def on_train_batch_end(self, batch, logs=None):
            done = min((batch + 1) * adapter.passes, adapter.steps)
            callbacks.on_steps_end(self.epoch, done, done - self.done)
            self.done = done

    return HandToLoopWithBatches() if adapter.batch_hooks else HandToLoop()


def log_step_loss(keras: Any, loop: TrainLoop, adapter: FitAdapter) -> Any:
    """Keras' running mean loss of the epoch, handed to the loop's `step_losses` at each batch hook."""

    class LogStepLoss(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch, self.seen, self.mean = epoch + 1, 0, 0.0

        def on_train_batch_end(self, batch, logs=None):
            # Called every tf_steps_per_execution fit steps (of `passes` batches each) with the epoch's running
            # mean loss per batch: the batches since the last call had mean (mean_k * k - mean_j * j) / (k - j).
            done, mean = min((batch + 1) * adapter.passes, adapter.steps), float(logs["loss"])
            window = (mean * done - self.mean * self.seen) / (done - self.seen)
            loop.step_losses.log(self.epoch, done, window, since_step=self.seen, global_mean=True)
            self.seen, self.mean = done, mean

    return LogStepLoss()

