"""Stop-and-resume through a folder on shared storage (`run.resume_dir`), for preemptible cluster jobs.

The driver records its MLflow run id in the folder. Whoever wants the run to stop (the Slurm script, on
the scheduler's preemption signal) creates the file STOP there: the workers agree on it at the next step
boundary, report a checkpoint of the half-done epoch and return, and the driver exits with
EXIT_PREEMPTED. A later run with the same folder (the requeued job) continues the same MLflow run, and
Ray Train restores the checkpoint because the Ray Train run is named after the MLflow run. Whoever created
STOP removes it before continuing (the Slurm script does at job start): a run that finds STOP stops at once.
"""
from __future__ import annotations

from pathlib import Path

STOP_FILE = "STOP"
RUN_ID_FILE = "mlflow_run_id"
EXIT_PREEMPTED = 3
# Workers agree on STOP every this many steps (one collective of a flag): often enough to stop within a
# preemption grace time, rare enough not to slow a small model's steps.
STOP_CHECK_EVERY = 10


def stop_file(resume_dir: str | None) -> Path | None:
    return Path(resume_dir) / STOP_FILE if resume_dir else None


def recorded_run_id(resume_dir: str | None) -> str | None:
    if not resume_dir:
        return None
    path = Path(resume_dir) / RUN_ID_FILE
    return path.read_text().strip() or None if path.exists() else None


def record_run_id(resume_dir: str | None, run_id: str) -> None:
    if not resume_dir:
        return
    Path(resume_dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(resume_dir) / f".{RUN_ID_FILE}.tmp"
    tmp.write_text(run_id + "\n")
    tmp.replace(Path(resume_dir) / RUN_ID_FILE)  # atomic: a reader never sees half an id
