"""Stop-and-resume through a folder on shared storage (`run.resume_dir`), for preemptible cluster jobs.

The driver records its MLflow run id in the folder. Whoever wants the run to stop (the Slurm script, on
the scheduler's preemption signal) creates the file STOP there: the workers agree on it within STOP_CHECK_EVERY
steps, report a checkpoint of the half-done epoch and return, and the driver exits with
EXIT_PREEMPTED. A later run with the same folder (the requeued job) continues the same MLflow run, and
Ray Train restores the checkpoint because the Ray Train run is named after the MLflow run. Whoever created
STOP removes it before continuing (the Slurm script does at job start): a run that finds STOP stops at once.

A sweep (`pipelines.sweep`) records its parent run and its trials' child runs instead (SWEEP_FILE); a rerun
continues that parent and re-runs the trials whose child run has not finished, each resuming its own checkpoint.

Stopped without a checkpoint from outside (Ctrl-C, SIGTERM: `ray job stop`, `kill`), a driver marks its run
KILLED with the `interrupted` tag (`interruption` tells an interrupt from a failure).
"""
from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

from contract.files import write_atomically
from contract.metrics import Reducer

STOP_FILE = "STOP"
RUN_ID_FILE = "mlflow_run_id"
SWEEP_FILE = "mlflow_sweep.json"  # {"parent": run id, "children": {trial index: run id}}
EXIT_PREEMPTED = 3
# Workers agree on STOP every this many steps (one collective of a flag): often enough to stop within a
# preemption grace time, rare enough not to slow a small model's steps.
STOP_CHECK_EVERY = 10


def stop_file(resume_dir: str | None) -> Path | None:
    return Path(resume_dir) / STOP_FILE if resume_dir else None


def stop_requested(resume_dir: str | None) -> bool:
    stop = stop_file(resume_dir)
    return stop is not None and stop.exists()


def recorded_run_id(resume_dir: str | None) -> str | None:
    if not resume_dir:
        return None
    path = Path(resume_dir) / RUN_ID_FILE
    return path.read_text().strip() or None if path.exists() else None


def record_run_id(resume_dir: str | None, run_id: str) -> None:
    _write_atomic(resume_dir, RUN_ID_FILE, run_id + "\n")


def recorded_sweep(resume_dir: str | None) -> tuple[str, dict[int, str]] | None:
    """(parent run id, {trial index: child run id}) of the sweep recorded in `resume_dir`, if any."""
    path = Path(resume_dir) / SWEEP_FILE if resume_dir else None
    if path is None or not path.exists():
        return None
    recorded = json.loads(path.read_text())
    return recorded["parent"], {int(index): run_id for index, run_id in recorded["children"].items()}


def record_sweep(resume_dir: str | None, parent_id: str, children: dict[int, str]) -> None:
    _write_atomic(resume_dir, SWEEP_FILE, json.dumps({"parent": parent_id, "children": children}, indent=1))


def _write_atomic(resume_dir: str | None, name: str, text: str) -> None:
    if not resume_dir:
        return
    write_atomically(Path(resume_dir) / name, text)


class Interrupted(Exception):
    """A signal asked the driver to stop (SIGTERM: `ray job stop`, a scheduler, `kill`)."""


def _raise_interrupted(signum: int, frame: object) -> None:
    raise Interrupted(signal.Signals(signum).name)


def raise_on_sigterm() -> None:
    """SIGTERM raises `Interrupted` in the driver's main thread (its default ends the process at once, which
    would leave the MLflow run RUNNING)."""
    signal.signal(signal.SIGTERM, _raise_interrupted)


@contextlib.contextmanager
def interrupts_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored in the block (in the main thread; elsewhere no handler can be set): a driver
    ending its run after an interrupt finishes ending it when the signal comes again (a second Ctrl-C, a
    scheduler's repeated SIGTERM), where the signal would leave the run RUNNING. SIGKILL still ends it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def interruption(err: BaseException) -> str | None:
    """How the driver was interrupted, or None for a real failure. Ctrl-C arrives as KeyboardInterrupt, or as
    SystemExit from the SIGINT handler Ray Train installs during fit (it aborts the run, then exits)."""
    if isinstance(err, Interrupted):
        return str(err)
    if isinstance(err, (KeyboardInterrupt, SystemExit)):
        return "SIGINT"
    if isinstance(err, SystemError) and err.__cause__ is not None:  # raised by the signal's handler inside a C
        return interruption(err.__cause__)                          # call (Ray's `wait`), which wraps it so
    return None


class StepChecks:
    """Where every rank stops (once STOP exists) or checkpoints the half-done epoch (`run.checkpoint_every_n_steps`
    global steps, or `run.checkpoint_every_s` seconds of training on any rank, since the last checkpoint), all at
    the same step. Every `every` steps of an epoch the ranks agree through one all-reduce of both flags, so a rank
    that sees STOP late, or whose clock runs behind, still acts with the others; checking every step would add a
    collective to each step of a small model. Steps are counted alike on every rank, so a checkpoint every n steps
    needs no agreement."""

    def __init__(self, path: Path | None, reduce: Reducer, every: int, every_n_steps: int = 0,
                 every_s: float = 0.0):
        self.path, self.reduce, self.every = path, reduce, every
        self.every_n_steps, self.every_s = every_n_steps, every_s
        self.checkpointed(0)

    def checkpointed(self, global_step: int) -> None:
        """A checkpoint was written after `global_step` (an epoch's end, a step checkpoint, the restored one)."""
        self.last_step, self.last_time = global_step, time.monotonic()

    def steps_to_next(self, steps: int, global_step: int) -> int:
        """Steps from here (`steps` into the epoch, `global_step` in the run) to the next step at which the ranks
        may stop or checkpoint: where a call of several steps must end."""
        ahead = [self.every - steps % self.every] if self.path is not None or self.every_s else []
        if self.every_n_steps:
            ahead.append(max(1, self.last_step + self.every_n_steps - global_step))
        return min(ahead, default=1 << 30)

    def __call__(self, steps: int, global_step: int) -> tuple[bool, bool]:
        """(stop, checkpoint) after `steps` of the epoch, `global_step` of the run. Collective at agreement steps."""
        due = bool(self.every_n_steps) and global_step - self.last_step >= self.every_n_steps
        if steps % self.every or (self.path is None and not self.every_s):
            return False, due
        late = bool(self.every_s) and time.monotonic() - self.last_time >= self.every_s
        stop, checkpoint = self.reduce([float(self.path is not None and self.path.exists()), float(late)], "max")
        return stop > 0, due or checkpoint > 0
