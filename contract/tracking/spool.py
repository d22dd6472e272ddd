"""The MLflow contract every backend shares.

The driver creates the run (so it exists before any worker starts and can always be closed as FAILED),
logs params and the resolved config; rank 0 of the trainer logs per-epoch metrics into that run; the
driver logs the final model and the end status. Workers write through a `TrackingSpool`, so a tracking
server that goes away loses nothing: what it missed waits in the run's storage (`spool_dir`) until the
driver, or `python -m pipelines.replay`, sends it.
"""
from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import logging
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from contract.resume import interruption

PROJECT_DIR = Path(__file__).resolve().parents[1]


class TrackingUnavailable(RuntimeError):
    """The MLflow tracking server cannot be reached."""


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{PROJECT_DIR / 'mlflow.db'}"


def _auth_header() -> dict[str, str]:
    """The Authorization header MLflow's client sends from the environment, if any."""
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user and password:
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, before any cluster resource is taken, when an HTTP tracking server does not answer or refuses
    our credentials (its /health answers anyone; an API call tells whether we may use it), or when a local store
    cannot be opened."""
    if not uri.startswith(("http://", "https://")):
        _check_local_store(uri)
        return
    base = uri.rstrip("/")
    try:
        with urllib.request.urlopen(base + "/health", timeout=timeout_s) as resp:
            reason = "" if resp.status == 200 else f"HTTP {resp.status}"
    except (urllib.error.URLError, OSError) as err:
        reason = str(getattr(err, "reason", err))
    if reason:
        raise TrackingUnavailable(f"MLflow tracking server {uri} is unreachable ({reason}); "
                                  "start it or unset MLFLOW_TRACKING_URI to use the local store")
    probe = urllib.request.Request(base + "/api/2.0/mlflow/experiments/search?max_results=1", headers=_auth_header())
    try:
        urllib.request.urlopen(probe, timeout=timeout_s).close()
    except urllib.error.HTTPError as err:
        if err.code in (401, 403):
            raise TrackingUnavailable(
                f"MLflow tracking server {uri} refused our credentials (HTTP {err.code}); set "
                "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (a Slurm job's own server: source the job "
                "folder's cluster.env)") from err
    except (urllib.error.URLError, OSError):
        pass  # it answered /health a moment ago; the run's first request will tell more


def _check_local_store(uri: str) -> None:
    """Open a local store (sqlite, file) once, so that a refused one is a config error and not a traceback. A new
    sqlite store is created (or migrated) here, one process at a time: MLflow's tracking store creates its tables
    without a lock, and two runs that create one store at once leave it half-migrated for good."""
    import logging

    for name in ("mlflow.store.db.utils", "alembic"):  # "Creating initial MLflow database tables..." and such:
        logging.getLogger(name).setLevel(logging.WARNING)  # a new local store is no news worth two lines
    db = Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None
    try:
        if db is None:
            _client(uri).search_experiments(max_results=1)
        else:
            with exclusive_lock(db.with_name(db.name + ".lock"), STORE_LOCK_TIMEOUT_S, "the MLflow store's lock"), \
                    warnings.catch_warnings():
                warnings.filterwarnings("ignore", module="alembic")  # its notes on the tables it rebuilds
                _client(uri).search_experiments(max_results=1)
    except TrackingUnavailable:
        raise
    except Exception as err:  # which store refuses how is MLflow's business; the user needs one line
        broken = _half_created(db) if db is not None else None
        if broken:
            raise TrackingUnavailable(broken) from err
        first = str(err).split(". ", 1)[0].strip().splitlines()[0]
        hint = ("; MLflow 3 opens file stores only with MLFLOW_ALLOW_FILE_STORE=true: use sqlite:///mlflow.db"
                if "MLFLOW_ALLOW_FILE_STORE" in str(err) else "")
        raise TrackingUnavailable(f"MLflow tracking URI {uri} cannot be opened ({first}){hint}") from err


STORE_LOCK_TIMEOUT_S = 120.0  # creating a store takes seconds; a holder past this is stuck


@contextmanager
def exclusive_lock(path: Path, timeout_s: float, what: str) -> Iterator[None]:
    """Hold an exclusive `flock` on `path` (created if missing) while the block runs; wait at most `timeout_s` for
    it, then raise TrackingUnavailable naming the lock."""
    with open(path, "a") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TrackingUnavailable(f"{what} {path} is held by another process for over {timeout_s:g} s")
                time.sleep(0.1)  # a poll of the lock, bounded by the deadline
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _half_created(db: Path) -> str | None:
    """The one line to print when the sqlite store at `db` was left half-created (the leftovers of an interrupted
    migration in it), saying how to recover; None when it is not."""
    import sqlite3

    try:
        with closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)) as conn:
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            runs = conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] if "runs" in tables else 0
    except sqlite3.Error:
        return None
    leftovers = sorted(t for t in tables if t.startswith("_alembic_tmp_"))
    if not leftovers:
        return None
    if runs == 0:
        return (f"the MLflow store {db} was left half-created (by runs that created it at the same time) and holds "
                f"no runs: move it aside (mv {db} {db}.broken) and run again to create a new one")
    drops = "; ".join(f"DROP TABLE {t}" for t in leftovers)
    return (f"the MLflow store {db} holds {runs} runs and an interrupted schema migration: back it up, then run "
            f"sqlite3 {db} '{drops}' and mlflow db upgrade sqlite:///{db}")


def say(line: str) -> None:
    """One line to stdout, in a Ray Train worker too. Not print(): Ray Train 2.60 replaces it in workers with one
    that, when a library has wrapped sys.stdout (ours are), writes the line and also logs it to stdout: each line
    showed twice in the driver's output."""
    sys.stdout.write(f"{line}\n")
    sys.stdout.flush()


def answers(uri: str) -> bool:
    """Whether the tracking server answers now (a local store always does)."""
    try:
        check_reachable(uri)
        return True
    except TrackingUnavailable:
        return False


class SystemMetrics:
    """MLflow's system metrics monitor (CPU, memory, disk, network; GPUs when NVML is there) for one process of a
    run: a thread that logs `system/<node>/<metric>` every `interval_s` and ends by itself when the run does. It
    starts after the run's last system metrics step, so a restarted worker logs no step twice. Best effort: a
    tracking server that does not answer ends the thread with a warning and never the training."""

    def __init__(self, uri: str, run_id: str, node: str, interval_s: float):
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # its start and stop lines are noise
        self.uri, self.monitor = uri, None
        try:  # asks the server for the last step: a worker restarted while the server is away goes on without
            self.monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s, node_id=node,
                                                tracking_uri=uri, resume_logging=True)
            self.monitor.start()
        except Exception as err:
            say(f"tracking: no system metrics for {node} ({type(err).__name__}: {err})")

    def stop(self) -> None:
        """Log what is sampled and stop; with the server away, leave the (daemon) thread instead: MLflow's client
        would retry for minutes."""
        if self.monitor is not None and answers(self.uri):
            self.monitor.finish()


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _experiment_id(client, name: str, uri: str) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    location = None
    if uri.startswith("sqlite:///"):  # keep artifacts beside the local DB, not in the job's working copy
        location = (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").as_uri()
    return client.create_experiment(name, artifact_location=location)


def git_commit() -> str:
    if os.environ.get("PIPELINE_GIT_COMMIT"):
        return os.environ["PIPELINE_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_DIR, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("ray", "torch", "mlflow", "pyarrow", "tensorflow"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def command_line() -> tuple[str, str]:
    """(entry point, the command that started this process as one would type it: `python -m pipelines.train
    ...`); a script outside the project keeps its path."""
    script = Path(sys.argv[0]).resolve()
    try:
        entry = ".".join(script.relative_to(PROJECT_DIR).with_suffix("").parts)
        words = ["python", "-m", entry]
    except ValueError:
        entry, words = sys.argv[0], ["python", sys.argv[0]]
    return entry, shlex.join([*words, *sys.argv[1:]])


def source_tags() -> dict[str, str]:
    """MLflow's own source tags (the UI's "Source" field) and the run's description: the command line."""
    entry, command = command_line()
    return {"mlflow.source.name": entry, "mlflow.source.type": "JOB",
            "mlflow.note.content": f"Started on {socket.gethostname()} with:\n\n    {command}\n"}


def start_run(uri: str, experiment: str, run_name: str, params: Mapping[str, Any],
              config_yaml: str, tags: Mapping[str, str] | None = None) -> str:
    """Create the run, log params/tags and the resolved config; return its id. The run stays RUNNING.
    Extra `tags` are added, e.g. `mlflow.parentRunId` to nest a sweep's trial run under the sweep's run."""
    from mlflow.entities import Param, RunTag

    client = _client(uri)
    tags = {"mlflow.runName": run_name, "mlflow.source.git.commit": git_commit(), **source_tags(),
            "host": socket.gethostname(), "ray_address": os.environ.get("RAY_ADDRESS", "local"), **(tags or {})}
    run = client.create_run(_experiment_id(client, experiment, uri), tags=tags, run_name=run_name)
    run_id = run.info.run_id
    all_params = dict(params)
    all_params.update({f"version.{k}": v for k, v in library_versions().items()})
    items = [Param(k, str(v)[:6000]) for k, v in sorted(all_params.items())]
    for start in range(0, len(items), 100):  # MLflow accepts at most 100 params per batch
        client.log_batch(run_id, params=items[start:start + 100], tags=[RunTag("host.cpus", str(os.cpu_count()))])
    client.log_text(run_id, config_yaml, "config.yaml")
    return run_id


def log_data_files(uri: str, run_id: str, data_dir: str, manifest: Mapping[str, Any]) -> None:
    """The dataset's manifest (lineage: sources, checksums, skips) and its tokenizer, if it has one."""
    import json

    client = _client(uri)
    client.log_text(run_id, json.dumps(manifest, indent=2, sort_keys=True), "data_manifest.json")
    if manifest.get("tokenizer"):
        client.log_artifact(run_id, str(Path(data_dir) / manifest["tokenizer"]))


@dataclass
class DatasetRef:
    """A split a run reads, as MLflow lists it among the run's inputs (the UI's "Datasets")."""
    name: str                # e.g. mnist-train
    uri: str                 # where it lives (the prepared folder)
    digest: str              # changes whenever the data does
    columns: dict[str, str]  # column -> MLflow type: integer, long, float, double, string, or array<integer> ...
    context: str             # training | eval | evaluation


def log_dataset_inputs(uri: str, run_id: str, datasets: Sequence[DatasetRef]) -> None:
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.types.schema import Array, ColSpec, DataType, Schema

    def spec(name: str, kind: str) -> ColSpec:
        inner = kind.removeprefix("array<").removesuffix(">")
        return ColSpec(Array(DataType[inner]) if kind.startswith("array<") else DataType[kind], name)

    inputs = []
    for ref in datasets:
        with warnings.catch_warnings():  # a file:// URI fits two of MLflow's local source types; either is right
            warnings.simplefilter("ignore")
            source = resolve_dataset_source(ref.uri)
        schema = Schema([spec(name, kind) for name, kind in ref.columns.items()])
        dataset = MetaDataset(source, name=ref.name, digest=ref.digest, schema=schema)._to_mlflow_entity()
        inputs.append(DatasetInput(dataset, tags=[InputTag("mlflow.data.context", ref.context)]))
    _client(uri).log_inputs(run_id, datasets=inputs)


def log_params(uri: str, run_id: str, params: Mapping[str, Any]) -> None:
    from mlflow.entities import Param

    _client(uri).log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])


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
                         f"`python -m pipelines.replay {folder}`")


def _send(client: Any, run_id: str, record: dict[str, Any], resend: bool) -> None:
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
    when the worker ends is sent by the driver (`flush_spools`) or `python -m pipelines.replay`."""

    def __init__(self, uri: str, run_id: str, folder: Path, name: str):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self.client, self.run_id, self.uri = _client(uri), run_id, uri
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
                _send(self.client, self.run_id, self.pending[0], resend=self.failing)
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
        _write_spool_file(self.file, self.run_id, self.uri, self.pending)


def send_or_spool(uri: str, run_id: str, folder: Path, name: str, records: list[dict[str, Any]]) -> None:
    """Spool records written outside the workers (a sweep trial's own notes): sent now when the server answers,
    else kept in the run's spool folder for the driver's flush or `python -m pipelines.replay`."""
    pending = list(records)
    if answers(uri):
        client = _client(uri)
        try:
            while pending:
                _send(client, run_id, pending[0], resend=False)
                pending.pop(0)
        except Exception as err:  # the server went away meanwhile: keep the rest
            say(f"tracking: {uri} did not answer ({type(err).__name__}); spooling to {folder}")
    _write_spool_file(Path(folder) / f"{name}-{os.getpid()}-{time.time_ns()}.json", run_id, uri, pending)


def _write_spool_file(path: Path, run_id: str, uri: str, records: list[dict[str, Any]]) -> None:
    """A worker's pending records as one JSON file, replaced whole (atomic); no file when nothing is pending."""
    if not records:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".part")
    part.write_text(json.dumps({"run_id": run_id, "uri": uri, "records": records}))
    part.replace(path)


def spool_files(folder: Path) -> list[Path]:
    """The workers' and the driver's spool files (not final.json or sweep.json, not a half-written .part)."""
    if not Path(folder).is_dir():
        return []
    return sorted(path for path in Path(folder).glob("*.json") if path.name not in (FINAL_FILE, SWEEP_FILE))


def spooled(folder: Path) -> int:
    """How many records the spool folder's worker files hold."""
    return sum(len(json.loads(path.read_text())["records"]) for path in spool_files(folder))


def flush_spools(uri: str, run_id: str, folder: Path) -> int:
    """Send every record left in the spool folder's files (workers that ended while the server was down);
    returns how many are still unsent. Files are rewritten as records go out, so a retry never repeats one."""
    client, unsent = _client(uri), 0
    for path in spool_files(folder):
        records = json.loads(path.read_text())["records"]
        while records:
            try:
                _send(client, run_id, records[0], resend=True)
            except Exception:
                break
            records.pop(0)
            _write_spool_file(path, run_id, uri, records)  # removes the file once it is empty
        unsent += len(records)
    return unsent


STEP_LOSS_SEND_S = 5.0  # rank 0 sends its kept step losses at least this often


class EpochLogger:
    """Rank 0's per-epoch metrics, through its `TrackingSpool`. Logging is idempotent per (metric, epoch): after a
    worker failure the resumed run may replay an epoch whose metrics were already logged, and MLflow must hold
    each once. With `tensorboard_dir` the same epoch metrics (step = epoch) and step losses (step = global step)
    also go to a TensorBoard event file there, logged as the run's `tensorboard/` artifacts after every epoch.

    `since_ms`: the start of this line of training when it continues another checkpoint (`run.resume_from`: a PBT
    trial exploiting another's). Its epochs are logged even where the run already holds that epoch from the
    line it left (Ray Train runs an epoch ahead of Tune's decision to switch): MLflow keeps both points, the
    later one is the step's latest value (and `epoch_values` reads it so)."""

    def __init__(self, spool: TrackingSpool, tensorboard_dir: Path | None = None, since_ms: int = 0):
        self.spool = spool
        self.tensorboard_dir = tensorboard_dir
        self.since_ms = since_ms
        self._events: Any = None
        self._step_losses: list[list] = []  # [name, value, timestamp ms, step], not sent yet
        self._oldest_step_loss = 0.0        # time.monotonic() of the first of them
        self._sender: ThreadPoolExecutor | None = None  # sends kept step losses off the training thread
        self._sending: Future | None = None  # that send, until it is known to be done

    def _to_tensorboard(self, step: int, metrics: Mapping[str, float]) -> None:
        """Written at once: tensorboardX's EventsWriter (its SummaryWriter queues events for a thread, so a flush
        does not promise they are in the file yet); no framework needed."""
        if self.tensorboard_dir is None:
            return
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import scalar

        if self._events is None:
            self.tensorboard_dir.mkdir(parents=True, exist_ok=True)
            self._events = EventsWriter(str(self.tensorboard_dir / "events"))
        for name, value in metrics.items():
            self._events.write_event(Event(wall_time=time.time(), step=step, summary=scalar(name, float(value))))
        self._events.flush()

    def log_step_loss(self, step: int, loss: float) -> None:
        """Kept and sent together, every STEP_LOSS_SEND_S by a thread of the logger's own while training goes on,
        and before anything else is logged (the epoch's end): a request per logged step makes every few steps wait
        for the tracking server's round trip (tens of ms to a server on another node), and even one every 5 s took
        up to 1% of the MNIST MLP's training time on one machine (benchmarks/tracking_overhead.py). A worker that
        dies loses its last few seconds of step losses; the restarted run trains those steps again."""
        if not self._step_losses:
            self._oldest_step_loss = time.monotonic()
        self._step_losses.append(["step_loss", float(loss), now_ms(), step])
        self._to_tensorboard(step, {"step_loss": loss})
        if time.monotonic() - self._oldest_step_loss >= STEP_LOSS_SEND_S:
            self._send_step_losses(wait=False)

    def flush(self) -> None:
        """Send the step losses kept so far, and wait until every one is sent (or spooled)."""
        self._send_step_losses(wait=True)

    def _send_step_losses(self, wait: bool) -> None:
        # One send at a time and every other write after it: the spool is never used by two threads at once.
        if self._sending is not None:
            self._sending.result()
            self._sending = None
        if not self._step_losses:
            return
        record, self._step_losses = {"op": "metrics", "metrics": self._step_losses}, []
        if wait:
            self.spool.write(record)
            return
        if self._sender is None:
            self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlflow-step-losses")
        self._sending = self._sender.submit(self.spool.write, record)

    def resumed_from(self, epoch: int) -> None:
        """Record a restart from the checkpoint of `epoch` (tag `resumed_from_epoch`, comma-separated)."""
        self.flush()
        self.spool.write({"op": "append_tag", "key": "resumed_from_epoch", "value": str(epoch)})

    def log_extra(self, epoch: int, metrics: Mapping[str, float]) -> None:
        """Per-epoch diagnostics (per-rank stats) logged as they come, without the once-per-epoch check."""
        self.flush()
        now = now_ms()
        self.spool.write({"op": "metrics", "metrics": [[k, float(v), now, epoch] for k, v in metrics.items()]})

    def log_artifacts(self, folder: str, path: str) -> None:
        """The files in `folder` (on this worker's node) as the run's artifacts under `path`."""
        self.flush()
        self.spool.write({"op": "artifacts", "folder": folder, "path": path})

    def log(self, epoch: int, metrics: Mapping[str, float]) -> None:
        self.flush()
        now = now_ms()
        self.spool.write({"op": "metrics", "once_per": "train_loss", "since_ms": self.since_ms,
                          "metrics": [[k, float(v), now, epoch] for k, v in metrics.items()]})
        if self.tensorboard_dir is not None:
            self._to_tensorboard(epoch, metrics)
            self.log_artifacts(str(self.tensorboard_dir), "tensorboard")


def now_ms() -> int:
    return int(time.time() * 1000)


def epoch_values(points: list[Any]) -> list[float]:
    """A metric's history (MLflow `Metric`s) as one value per step, in step order: a step logged twice (a PBT trial
    that switched to another's checkpoint) counts its latest value."""
    latest = {m.step: m for m in sorted(points, key=lambda m: (m.step, m.timestamp))}
    return [latest[step].value for step in sorted(latest)]


def lineage_start_ms(folder: Path) -> int:
    """When the Ray Train run in `folder` first started (recorded there by its first attempt; a restarted worker
    group reads it back), in ms."""
    marker = Path(folder) / "lineage_started_ms"
    if not marker.exists():
        folder.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(now_ms()))
    return int(marker.read_text())


def log_torch_model(uri: str, run_id: str, model, input_example, epoch: int) -> None:
    """The model as the run's MLflow model (PyTorch flavour), linked to the metrics of `epoch`, the one whose
    checkpoint it holds (the logged model's page in the UI shows them)."""
    import mlflow
    import torch

    mlflow.set_tracking_uri(uri)
    # log_model checks the input example by loading the model back, on the GPU where this driver sees one; a
    # torch.export model of CPU weights loads on the CPU only.
    os.environ.setdefault("MLFLOW_DEFAULT_PREDICTION_DEVICE", "cpu")
    # The fluent API is what log_model uses; the driver sets the final status right after this.
    mlflow.start_run(run_id=run_id, log_system_metrics=False)
    try:
        # Explicit requirements: MLflow's inference imports and scans modules, seconds for nothing here.
        torch_req = f"torch=={torch.__version__.split('+')[0]}"
        mlflow.pytorch.log_model(model, name="model", input_example=input_example,
                                 pip_requirements=[torch_req], step=epoch)
    finally:
        mlflow.end_run()


def register_logged_model(uri: str, run_id: str, name: str) -> str:
    """Register the model the run logged as a new version of registered model `name` (created if new); tags the
    version and the run with each other. Returns the version."""
    import mlflow

    client = _client(uri)
    mlflow.set_tracking_uri(uri)
    experiment_id = client.get_run(run_id).info.experiment_id
    models = mlflow.search_logged_models(experiment_ids=[experiment_id], output_format="list",
                                         filter_string=f"source_run_id = '{run_id}'")
    if len(models) != 1:
        raise RuntimeError(f"run {run_id} logged {len(models)} models, not one: nothing registered as {name}")
    version = mlflow.register_model(models[0].model_uri, name, tags={"training_run_id": run_id}).version
    client.set_tag(run_id, "registered_model", f"{name}/{version}")
    return str(version)


def set_tags(uri: str, run_id: str, tags: Mapping[str, str]) -> None:
    client = _client(uri)
    for key, value in tags.items():
        client.set_tag(run_id, key, value)


def end_run(uri: str, run_id: str, error: str | None = None) -> None:
    """FINISHED, or FAILED with the error recorded as a tag and a text artifact."""
    client = _client(uri)
    if error is None:
        client.set_terminated(run_id, status="FINISHED")
        return
    client.set_tag(run_id, "error", error[:5000])
    client.log_text(run_id, error, "error.txt")
    client.set_terminated(run_id, status="FAILED")


def reopen_run(uri: str, run_id: str) -> str:
    """Continue a run stopped by preemption: back to RUNNING, `attempts` tag counted up. Returns the status
    the run had (a FINISHED run is left alone)."""
    client = _client(uri)
    run = client.get_run(run_id)
    status = run.info.status
    if status != "FINISHED":
        attempts = int(run.data.tags.get("attempts", "1")) + 1
        client.set_tag(run_id, "attempts", str(attempts))
        client.update_run(run_id, status="RUNNING")
    return status


def mark_preempted(uri: str, run_id: str, stopped_at: str, folder: Path | None = None) -> bool:
    """The run stopped on request with a checkpoint and will be continued: KILLED until then (MLflow has no
    'suspended' state), with the stop point recorded. With a spool `folder`, a server that does not answer is not
    an error: the stop point waits there for the continued run (`flush_spools`), the run stays RUNNING, and the
    answer is False."""
    if folder is not None and not answers(uri):
        _write_spool_file(Path(folder) / f"driver-{os.getpid()}-{time.time_ns()}.json", run_id, uri,
                          [{"op": "append_tag", "key": "preempted_at", "value": stopped_at}])
        return False
    client = _client(uri)
    previous = client.get_run(run_id).data.tags.get("preempted_at")
    client.set_tag(run_id, "preempted_at", f"{previous},{stopped_at}" if previous else stopped_at)
    client.set_terminated(run_id, status="KILLED")
    return True


def mark_interrupted(uri: str, run_id: str, how: str) -> None:
    """Stopped from outside (Ctrl-C, SIGTERM) without a stop request: KILLED, not FAILED (nothing went wrong in
    the run), with how in the `interrupted` tag."""
    client = _client(uri)
    client.set_tag(run_id, "interrupted", how)
    client.set_terminated(run_id, status="KILLED")


def end_unfinished_run(uri: str, run_id: str, err: BaseException) -> str | None:
    """End a run its driver could not finish: KILLED with the `interrupted` tag after an interrupt
    (`contract.resume.interruption`), else FAILED with the error. Returns how it was interrupted, or None."""
    how = interruption(err)
    if how:
        mark_interrupted(uri, run_id, how)
    else:
        end_run(uri, run_id, error=f"{type(err).__name__}: {err}\n\n{traceback.format_exc()}")
    return how


def log_cluster_startup(uri: str, run_id: str) -> None:
    """Seconds from the cluster job's start to all Ray nodes joined, when a cluster script measured it
    (PIPELINE_CLUSTER_STARTUP_S, set by cluster/slurm); one value per attempt of the run."""
    value = os.environ.get("PIPELINE_CLUSTER_STARTUP_S")
    if not value:
        return
    client = _client(uri)
    attempt = int(client.get_run(run_id).data.tags.get("attempts", "1"))
    client.log_metric(run_id, "cluster_startup_s", float(value), step=attempt)
