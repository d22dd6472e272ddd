"""`pipelines/fit.py`: a fit interrupted by a signal is known to be still running until its thread returns (the
driver must then say its last line before shutting Ray down: pipelines/train.py main)."""
from __future__ import annotations

import os
import signal
import sys
import threading

import pytest

from pipelines.fit import fit_in_thread, fit_still_running
from tests.conftest import wait_until


class Interrupt(Exception):
    pass


class BlockedTrainer:
    """Stands in for a Ray Train trainer that waits for its workers' resources: `fit` signals this process (as
    Ctrl-C would), then blocks until released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def fit(self) -> str:
        main = threading.main_thread().ident
        wait_until(lambda: sys._current_frames()[main].f_code.co_name == "_wait_for_tstate_lock", 60,
                   "the main thread to wait in join()")
        os.kill(os.getpid(), signal.SIGUSR1)
        self.release.wait(timeout=60)
        return "done"


def test_an_interrupted_fit_counts_as_running_until_its_thread_returns():
    def interrupt(signum, frame):
        raise Interrupt()

    previous = signal.signal(signal.SIGUSR1, interrupt)
    trainer = BlockedTrainer()
    try:
        with pytest.raises(Interrupt):  # raised in the main thread's join
            fit_in_thread(trainer)
        assert fit_still_running()  # Thread.is_alive() says False here (Python 3.11)
    finally:
        trainer.release.set()
        signal.signal(signal.SIGUSR1, previous)
    wait_until(lambda: not fit_still_running(), 60, "the fit thread to return")
