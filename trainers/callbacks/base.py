"""`LoopCallback`: what the shared loop tells a side concern, at named hooks that do nothing unless overridden.
The loop calls each hook of each of its callbacks in order (`Callbacks`); so do the loops of Keras `fit` and
Lightning's Trainer, which hand their steps and epochs to the shared loop (trainers/tf/keras_fit.py,
trainers/torch/lightning_fit.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

if TYPE_CHECKING:
    from trainers.loop import TrainLoop


class LoopCallback:
    def on_start(self, loop: TrainLoop) -> None:
        """The attempt's loop is ready: its adapter built and its checkpoint restored."""

    def on_phase(self, epoch: int, step: int, phase: str) -> None:
        """This rank enters `phase` (contract/hang.py PHASES, or "fit") at `step` (1-based) of `epoch`."""

    def on_epoch_start(self, epoch: int, done: int) -> None:
        """An epoch's training begins; `done` of its steps were trained before a stop (a resumed epoch)."""

    def on_step_start(self, epoch: int, step: int) -> None:
        """The run's global step `step` (1-based, over epochs) is about to be trained."""

    def steps_to_boundary(self, step: int) -> int | None:
        """Steps from the run's global step `step` (about to be trained) to a later step that must begin an
        adapter's call of several steps, because this callback acts before it is trained; None: none."""
        return None

    def on_steps_end(self, epoch: int, done: int, count: int) -> None:
        """`count` more steps were trained (one call of the adapter, or of Keras' compiled steps); `done` of the
        epoch's so far."""

    def on_epoch_trained(self, epoch: int) -> None:
        """The epoch's training ended (every step trained, stopped on request, or diverged), before its
        evaluation."""

    def epoch_extras(self, epoch: int, metrics: dict[str, float]) -> dict[str, float]:
        """Diagnostics rank 0 logs beside the epoch's metrics (collective: every rank calls it at the same point)."""
        return {}

    def on_diverged(self, where: dict[str, float]) -> None:
        """The loss stopped being a number (`where`: contract/metrics.py DIVERGED_METRICS); training ends."""


def _on_each(hook: str) -> Callable[..., None]:
    """`hook` called on each of `Callbacks.callbacks`, in order."""
    def call(self: Callbacks, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(*args)
    call.__name__ = hook
    return call


class Callbacks(LoopCallback):
    """Several callbacks as one: each hook called on each of them, in order."""

    def __init__(self, callbacks: Iterable[LoopCallback] = ()):
        self.callbacks = list(callbacks)

    on_start = _on_each("on_start")
    on_phase = _on_each("on_phase")
    on_epoch_start = _on_each("on_epoch_start")
    on_step_start = _on_each("on_step_start")
    on_steps_end = _on_each("on_steps_end")
    on_epoch_trained = _on_each("on_epoch_trained")
    on_diverged = _on_each("on_diverged")

    def steps_to_boundary(self, step: int) -> int | None:
        ahead = [steps for callback in self.callbacks if (steps := callback.steps_to_boundary(step)) is not None]
        return min(ahead, default=None)

    def epoch_extras(self, epoch: int, metrics: dict[str, float]) -> dict[str, float]:
        extras: dict[str, float] = {}
        for callback in self.callbacks:
            extras.update(callback.epoch_extras(epoch, metrics))
        return extras
