"""A run's life in MLflow: created by the driver (params, tags, the resolved config), continued after a stop,
ended FINISHED, FAILED (with the error) or KILLED (interrupted, or preempted until continued)."""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Iterator, Mapping

from contract.resume import interruption
from contract.tracking.provenance import git_commit, library_versions, source_tags
from contract.tracking.check import answers
from contract.tracking.logger import now_ms
from contract.tracking.server import mlflow_client
from contract.tracking.spool import spool_dir, write_spool_file


def experiment_id(client, name: str, uri: str) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    location = None
    if uri.startswith("sqlite:///"):  # keep artifacts beside the local DB, not in the job's working copy
        location = (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").as_uri()
    return client.create_experiment(name, artifact_location=location)


def start_run(uri: str, experiment: str, run_name: str, params: Mapping[str, Any],
              config_yaml: str, tags: Mapping[str, str] | None = None) -> str:
    """Create the run, log params/tags and the resolved config; return its id. The run stays RUNNING.
    Extra `tags` are added, e.g. `mlflow.parentRunId` to nest a sweep's trial run under the sweep's run."""
    from mlflow.entities import Param, RunTag

    client = mlflow_client(uri)
    tags = {"mlflow.runName": run_name, "mlflow.source.git.commit": git_commit(), **source_tags(),
            "ray_address": os.environ.get("RAY_ADDRESS", "local"), **driver_tags(), **(tags or {})}
    run = client.create_run(experiment_id(client, experiment, uri), tags=tags, run_name=run_name)
    run_id = run.info.run_id
    all_params = dict(params)
    all_params.update({f"version.{k}": v for k, v in library_versions().items()})
    items = [Param(k, str(v)[:6000]) for k, v in sorted(all_params.items())]
    with ended_on_error(uri, run_id):
        for start in range(0, len(items), 100):  # MLflow accepts at most 100 params per batch
            client.log_batch(run_id, params=items[start:start + 100],
                             tags=[RunTag("host.cpus", str(os.cpu_count()))])
        client.log_text(run_id, config_yaml, "config.yaml")
    return run_id


@contextlib.contextmanager
def ended_on_error(uri: str, run_id: str) -> Iterator[None]:
    """Around what follows a run's creation or reopening, before its driver has recorded it or can end it: an
    error or interrupt in the block ends the run (`end_unfinished_run`) before it goes on, so that no run is left
    RUNNING with nobody to end it."""
    try:
        yield
    except BaseException as err:
        end_unfinished_run(uri, run_id, err)
        raise


def check_experiment(uri: str, name: str) -> None:
    """The experiment runs go to can take them: named, and not in the tracking server's trash (MLflow refuses
    runs in a deleted experiment); else ValueError, in one line."""
    if not name.strip():
        raise ValueError("run.experiment: empty; name the MLflow experiment the runs go to")
    experiment = mlflow_client(uri).get_experiment_by_name(name)
    if experiment is not None and experiment.lifecycle_stage == "deleted":
        raise ValueError(f"run.experiment: MLflow experiment '{name}' is deleted (in the tracking server's trash); "
                         f"restore it (mlflow experiments restore --experiment-id {experiment.experiment_id}) or "
                         f"name another")


def driver_tags() -> dict[str, str]:
    """The process that drives a run (`host`, `driver.pid`): a later command on this host closes a run whose
    driver died without closing it (`close_orphaned_runs`)."""
    return {"host": socket.gethostname(), "driver.pid": str(os.getpid())}


def close_orphaned_runs(uri: str, experiment: str) -> list[str]:
    """RUNNING runs of `experiment` whose driver ran on this host and no longer exists (killed with SIGKILL, by
    the OOM killer, or its machine's session ended): FAILED, with the `driver_lost` tag. A run driven from another
    host is left alone: its process cannot be seen from here; so is one whose ending waits in its spool for
    `rtp replay`. Each closed run is one line on stderr; returns them."""
    client = mlflow_client(uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    host = socket.gethostname()
    runs = client.search_runs([found.experiment_id], max_results=1000,
                              filter_string=f"attributes.status = 'RUNNING' and tags.host = '{host}'")
    closed = []
    for run in runs:
        pid = run.data.tags.get("driver.pid", "")
        if pid.isdigit() and not process_exists(int(pid)) and not awaits_replay(run):
            client.set_tag(run.info.run_id, "driver_lost", f"its driver, process {pid} on {host}, ended without "
                                                           f"closing the run")
            client.set_terminated(run.info.run_id, status="FAILED")
            closed.append(run.info.run_id)
            print(f"MLflow run {run.info.run_id} was left RUNNING by a driver that no longer exists: marked FAILED "
                  f"(tag driver_lost)", file=sys.stderr)
    return closed


def awaits_replay(run: Any) -> bool:
    """The run's driver ended while the tracking server was away, its ending kept in the run's spool folder for
    `rtp replay` (which closes it as it ended)."""
    storage = run.data.params.get("run.storage_path")
    folder = spool_dir(storage, run.info.run_id) if storage else None
    return folder is not None and folder.is_dir() and any(folder.glob("*.json"))


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def log_attempt_changes(uri: str, run_id: str, params: Mapping[str, Any]) -> dict[str, str]:
    """A continued run whose config differs from the params it was started with (another `trainer.num_workers`
    after a requeue, a longer `trainer.epochs`): MLflow keeps a param's first value, so each value this attempt
    changes is a tag `attempt<k>.<key>`. Returns those tags."""
    client = mlflow_client(uri)
    run = client.get_run(run_id)
    attempt = run.data.tags.get("attempts", "1")
    changed = {f"attempt{attempt}.{key}": str(value)[:5000] for key, value in params.items()
               if key in run.data.params and run.data.params[key] != str(value)[:6000]}
    for key, value in changed.items():
        client.set_tag(run_id, key, value)
    return changed


def log_params(uri: str, run_id: str, params: Mapping[str, Any]) -> None:
    from mlflow.entities import Param

    mlflow_client(uri).log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])


def log_metrics(uri: str, run_id: str, metrics: Mapping[str, float]) -> None:
    """Metrics the driver logs once (step 0), e.g. the preflight's."""
    from mlflow.entities import Metric

    now = now_ms()
    items = [Metric(k, float(v), now, 0) for k, v in metrics.items()]
    client = mlflow_client(uri)
    for start in range(0, len(items), 1000):  # MLflow takes at most 1000 metrics a batch
        client.log_batch(run_id, metrics=items[start:start + 1000])


def set_tags(uri: str, run_id: str, tags: Mapping[str, str]) -> None:
    client = mlflow_client(uri)
    for key, value in tags.items():
        client.set_tag(run_id, key, value)


def log_hangs(uri: str, run_id: str, folder: Path, lines: list[str]) -> None:
    """The hang watchdog's stacks (`folder`: the run's hang/) as the run's `hang/` artifacts, and each verdict's
    line in the `hang` tag."""
    client = mlflow_client(uri)
    client.log_artifacts(run_id, str(folder), "hang")
    if lines:
        client.set_tag(run_id, "hang", " | ".join(lines)[:5000])


def error_line(error: str) -> str:
    """What a failed run's `error` tag holds: the error's last line, where its traceback (and a Ray worker's, within
    Ray Train's error) ends with the exception that ended the run."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else error)[:5000]


def end_run(uri: str, run_id: str, error: str | None = None, end_ms: int | None = None) -> None:
    """FINISHED, or FAILED with the error's last line as the `error` tag and the whole error as the artifact
    `error.txt`; ended at `end_ms` (else now)."""
    client = mlflow_client(uri)
    if error is None:
        client.set_terminated(run_id, status="FINISHED", end_time=end_ms)
        return
    client.set_tag(run_id, "error", error_line(error))
    try:
        client.log_text(run_id, error, "error.txt")  # the whole error, its traceback included
    except Exception as err:  # an artifact store that fails leaves the run FAILED all the same, not RUNNING
        client.set_tag(run_id, "error.txt", f"not stored: {type(err).__name__}: {err}"[:5000])
    client.set_terminated(run_id, status="FAILED", end_time=end_ms)


def run_exists(uri: str, run_id: str) -> bool:
    """Whether the tracking server at `uri` holds run `run_id` (False: it never had it, or it was deleted)."""
    from mlflow.exceptions import MlflowException

    try:
        return mlflow_client(uri).get_run(run_id).info.lifecycle_stage != "deleted"
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise


def check_recorded_run(uri: str, resume_dir: str, run_id: str) -> None:
    """The run a `run.resume_dir` continues is on this tracking server; else ValueError, in one line."""
    if not run_exists(uri, run_id):
        raise ValueError(f"run.resume_dir: {resume_dir} continues MLflow run {run_id}, which {uri} does not hold: "
                         f"point MLFLOW_TRACKING_URI at the server it was started on, or use a new run.resume_dir")


def reopen_run(uri: str, run_id: str) -> str:
    """Continue a run stopped by preemption: back to RUNNING, `attempts` tag counted up. Returns the status
    the run had (a FINISHED run is left alone)."""
    client = mlflow_client(uri)
    run = client.get_run(run_id)
    status = run.info.status
    if status != "FINISHED":
        attempts = int(run.data.tags.get("attempts", "1")) + 1
        client.set_tag(run_id, "attempts", str(attempts))
        for key, value in driver_tags().items():  # this attempt's driver
            client.set_tag(run_id, key, value)
        client.update_run(run_id, status="RUNNING")
    return status


def mark_preempted(uri: str, run_id: str, stopped_at: str, folder: Path | None = None,
                   end_ms: int | None = None) -> bool:
    """The run stopped on request with a checkpoint and will be continued: KILLED until then (MLflow has no
    'suspended' state), with the stop point recorded. With a spool `folder`, a server that does not answer is not
    an error: the stop point waits there for the continued run (`flush_spools`), the run stays RUNNING, and the
    answer is False."""
    if folder is not None and not answers(uri):
        write_spool_file(Path(folder) / f"driver-{os.getpid()}-{time.time_ns()}.json", run_id, uri,
                          [{"op": "append_tag", "key": "preempted_at", "value": stopped_at}])
        return False
    client = mlflow_client(uri)
    previous = client.get_run(run_id).data.tags.get("preempted_at")
    client.set_tag(run_id, "preempted_at", f"{previous},{stopped_at}" if previous else stopped_at)
    client.set_terminated(run_id, status="KILLED", end_time=end_ms)
    return True


def mark_interrupted(uri: str, run_id: str, how: str) -> None:
    """Stopped from outside (Ctrl-C, SIGTERM) without a stop request: KILLED, not FAILED (nothing went wrong in
    the run), with how in the `interrupted` tag."""
    client = mlflow_client(uri)
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
    client = mlflow_client(uri)
    attempt = int(client.get_run(run_id).data.tags.get("attempts", "1"))
    client.log_metric(run_id, "cluster_startup_s", float(value), step=attempt)
