"""Progress bars where someone watches them (`run.progress`): in an interactive terminal by default, never in a
log (a job's, Slurm's, CI's), where redrawn bars only add lines. One setting covers Ray Data's bars and the bar of
each epoch's training steps, which rank 0 draws through Ray's distributed tqdm (trainers/worker.py): the driver
renders it, so `python -m pipelines.train` in a terminal shows the steps of the epoch under way."""
from __future__ import annotations

import os
import sys
from typing import Protocol

PROGRESS_SETTINGS = ("auto", "on", "off")


def progress_wanted(setting: str = "auto") -> bool:
    """`on`/`off` as said; `auto`: where the driver's output is a terminal, unless RAY_DATA_DISABLE_PROGRESS_BARS
    (Ray Data's own switch) is set and decides."""
    if setting != "auto":
        return setting == "on"
    asked = os.environ.get("RAY_DATA_DISABLE_PROGRESS_BARS")
    return asked == "0" if asked is not None else sys.stdout.isatty()


class StepBar(Protocol):
    """A bar over an epoch's training steps (tqdm's `update`/`close`)."""

    def update(self, n: int = 1) -> None: ...
    def close(self) -> None: ...


class NoBar:
    """Progress not wanted (every rank but 0, or `run.progress` off)."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass
