"""The durable spool: a worker's MLflow writes survive a tracking server that blinks. Records that were not sent
wait in files of the run's spool folder until the driver, or `rtp replay`, sends them."""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from contract.console import say
from contract.files import write_atomically
from contract.tracking.check import answers
from contract.tracking.server import mlflow_client


SPOOL_DIR = "mlflow_spool"  # in the Ray Train run's folder: shared storage on a cluster, like the checkpoints
FINAL_FILE = "final.json"   # in it: the final model still to log (config, checkpoint), then the run to end
SWEEP_FILE = "sweep.json"   # in a sweep's parent run's spool: how each trial ended, for the closing left to do


def ray_run_name(run_id: str, resume_from: str | None = None) -> str:
    """The Ray Train run of an MLflow run is named after it: a rerun finds its checkpoints (trainers/worker.py).
    A run started from another checkpoint (`run.resume_from`) is a Ray Train run of its own, named after that
    checkpoint too: its checkpoints are a new line of training, and the run's earlier ones must not be resumed
    in its place (Ray Train resumes a run's own latest checkpoint before any other)."""
    if not resume_from:
        return f"run-{run_id}"
    return f"run-{run_id}-from-{hashlib.sha1(str(resume_from).encode()).hexdigest()[:10]}"


def run_dir(storage_path: str, run_id: str) -> Path:
    """The Ray Train run's folder in `run.storage_path`: its checkpoints, spool, profile and TensorBoard files."""
    return Path(storage_path) / ray_run_name(run_id)


def spool_dir(storage_path: str, run_id: str) -> Path:
    """Where a run's unsent MLflow records wait."""
    return run_dir(storage_path, run_id) / SPOOL_DIR


class TrackingDown(RuntimeError):
    """The tracking server did not answer; what it missed is kept in the spool folder."""

    def __init__(self, uri: str, run_id: str, folder: Path, pending: int):
        super().__init__(f"MLflow tracking server {uri} is unreachable; {pending} unsent record(s) of run {run_id} "
                         f"and its final model are kept in {folder}: once the server is back, replay them with "
                         f"`rtp replay {folder}`")


def send_record(client: Any, run_id: str, record: dict[str, Any], resend: bool) -> None:
    """One spool record to MLflow. A re-sent record skips the (metric, step) pairs the server has already (the
    first try may have landed without its answer), and `once_per` records skip a step already logged (since
    `since_ms`, when the record has it: by this line of training, see EpochLogger)."""
    from mlflow.entities import Metric

    if record["op"] == "metrics":
        metrics = [Metric(k, float(v), ts, step) for k, v, ts, step in record["metrics"]]
        if record.get("once_per"):
            since = record.get("since_ms", 0)
            logged = {m.step for m in client.get_metric_history(run_id, record["once_per"]) if m.timestamp >= since}
            metrics = [m for m in metrics if m.step not in logged]
        elif resend:
            seen = {key: {m.step for m in client.get_metric_history(run_id, key)} for key in {m.key for m in metrics}}
            metrics = [m for m in metrics if m.step not in seen[m.key]]
        if metrics:
            client.log_batch(run_id, metrics=metrics)
    elif record["op"] == "tag":
        client.set_tag(run_id, record["key"], record["value"])
    elif record["op"] == "artifacts":  # files the worker wrote (a profile): sent again whole if need be
        client.log_artifacts(run_id, record["folder"], record["path"])
    elif record["op"] == "append_tag":  # comma-separated history, e.g. every epoch the run resumed from
        previous = client.get_run(run_id).data.tags.get(record["key"])
        values = previous.split(",") if previous else []
        if not (resend and values and values[-1] == record["value"]):
            client.set_tag(run_id, record["key"], ",".join([*values, record["value"]]))
    else:
        raise ValueError(f"unknown spool record {record['op']!r}")


class TrackingSpool:
    """A Ray worker's MLflow writes, made to survive a tracking server that blinks: each record is sent at once
    (one try, 10 s timeout: training never waits minutes for the server); when the server does not answer, the
    record stays pending, kept in a file of the spool folder, and goes out before the next one. What is pending
    when the worker ends is sent by the driver (`flush_spools`) or `rtp replay`."""

    def __init__(self, uri: str, run_id: str, folder: Path, name: str):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self.client, self.run_id, self.uri = mlflow_client(uri), run_id, uri
        self.file = Path(folder) / f"{name}-{os.getpid()}-{time.time_ns()}.json"
        self.pending: list[dict[str, Any]] = []
        self.failing = False

    def write(self, record: dict[str, Any]) -> None:
        self.pending.append(record)
        self.flush()

    def flush(self) -> bool:
        """Send what is pending, oldest first; False when the server still does not answer."""
        while self.pending:
            try:
                send_record(self.client, self.run_id, self.pending[0], resend=self.failing)
            except Exception as err:  # server down or erroring: keep the record, keep training
                if not self.failing:
                    say(f"tracking: {self.uri} did not answer ({type(err).__name__}); spooling to {self.file}")
                self.failing = True
                self._save()
                return False
            self.pending.pop(0)
        if self.failing:
            say(f"tracking: {self.uri} answers again; the spool is sent")
            self.failing = False
            self._save()
        return True

    def _save(self) -> None:
        write_spool_file(self.file, self.run_id, self.uri, self.pending)


def send_or_spool(uri: str, run_id: str, folder: Path, name: str, records: list[dict[str, Any]]) -> None:
    """Spool records written outside the workers (a sweep trial's own notes): sent now when the server answers,
    else kept in the run's spool folder for the driver's flush or `rtp replay`."""
    pending = list(records)
    if answers(uri):
        client = mlflow_client(uri)
        try:
            while pending:
                send_record(client, run_id, pending[0], resend=False)
                pending.pop(0)
        except Exception as err:  # the server went away meanwhile: keep the rest
            say(f"tracking: {uri} did not answer ({type(err).__name__}); spooling to {folder}")
    write_spool_file(Path(folder) / f"{name}-{os.getpid()}-{time.time_ns()}.json", run_id, uri, pending)


def write_spool_file(path: Path, run_id: str, uri: str, records: list[dict[str, Any]]) -> None:
    """A worker's pending records as one JSON file, replaced whole (atomic); no file when nothing is pending."""
    if not records:
        path.unlink(missing_ok=True)
        return
    write_atomically(path, json.dumps({"run_id": run_id, "uri": uri, "records": records}))


def spool_files(folder: Path) -> list[Path]:
    """The workers' and the driver's spool files (not final.json or sweep.json, not a half-written partial)."""
    if not Path(folder).is_dir():
        return []
    return sorted(path for path in Path(folder).glob("*.json") if path.name not in (FINAL_FILE, SWEEP_FILE))


def spooled(folder: Path) -> int:
    """How many records the spool folder's worker files hold."""
    return sum(len(json.loads(path.read_text())["records"]) for path in spool_files(folder))


def flush_spools(uri: str, run_id: str, folder: Path) -> int:
    """Send every record left in the spool folder's files (workers that ended while the server was down);
    returns how many are still unsent. Files are rewritten as records go out, so a retry never repeats one."""
    client, unsent = mlflow_client(uri), 0
    for path in spool_files(folder):
        records = json.loads(path.read_text())["records"]
        while records:
            try:
                send_record(client, run_id, records[0], resend=True)
            except Exception:
                break
            records.pop(0)
            write_spool_file(path, run_id, uri, records)  # removes the file once it is empty
        unsent += len(records)
    return unsent
