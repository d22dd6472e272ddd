"""The MLflow contract every backend shares.

The driver creates the run (so it exists before any worker starts and can always be closed as FAILED),
logs params and the resolved config; rank 0 of the trainer logs per-epoch metrics into that run; the
driver logs the final model and the end status.
"""
from __future__ import annotations

import os
import platform
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Mapping

PROJECT_DIR = Path(__file__).resolve().parents[1]


class TrackingUnavailable(RuntimeError):
    """The MLflow tracking server cannot be reached."""


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{PROJECT_DIR / 'mlflow.db'}"


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, before any cluster resource is taken, when an HTTP tracking server does not answer."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as resp:
            if resp.status == 200:
                return
            reason = f"HTTP {resp.status}"
    except (urllib.error.URLError, OSError) as err:
        reason = str(getattr(err, "reason", err))
    raise TrackingUnavailable(f"MLflow tracking server {uri} is unreachable ({reason}); "
                              "start it or unset MLFLOW_TRACKING_URI to use the local store")


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


def start_run(uri: str, experiment: str, run_name: str, params: Mapping[str, Any],
              config_yaml: str, tags: Mapping[str, str] | None = None) -> str:
    """Create the run, log params/tags and the resolved config; return its id. The run stays RUNNING.
    Extra `tags` are added, e.g. `mlflow.parentRunId` to nest a sweep's trial run under the sweep's run."""
    from mlflow.entities import Param, RunTag

    client = _client(uri)
    tags = {"mlflow.runName": run_name, "mlflow.source.git.commit": git_commit(),
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


def log_params(uri: str, run_id: str, params: Mapping[str, Any]) -> None:
    from mlflow.entities import Param

    _client(uri).log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])


class EpochLogger:
    """Rank 0's per-epoch metrics. Logging is idempotent per (metric, epoch): after a worker failure the
    resumed run may replay an epoch whose metrics were already logged, and MLflow must hold each once."""

    def __init__(self, uri: str, run_id: str):
        self.client = _client(uri)
        self.run_id = run_id

    def logged_epochs(self, metric: str = "train_loss") -> set[int]:
        return {m.step for m in self.client.get_metric_history(self.run_id, metric)}

    def log_step_loss(self, step: int, loss: float) -> None:
        from mlflow.entities import Metric

        self.client.log_batch(self.run_id, metrics=[Metric("step_loss", loss, int(time.time() * 1000), step)])

    def resumed_from(self, epoch: int) -> None:
        """Record a restart from the checkpoint of `epoch` (tag `resumed_from_epoch`, comma-separated)."""
        previous = self.client.get_run(self.run_id).data.tags.get("resumed_from_epoch")
        self.client.set_tag(self.run_id, "resumed_from_epoch", f"{previous},{epoch}" if previous else str(epoch))

    def log_extra(self, epoch: int, metrics: Mapping[str, float]) -> None:
        """Per-epoch diagnostics (per-rank stats) logged as they come, without the once-per-epoch check."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, epoch) for k, v in metrics.items()])

    def log(self, epoch: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        if epoch in self.logged_epochs():
            return
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, epoch) for k, v in metrics.items()])


def log_torch_model(uri: str, run_id: str, model, input_example) -> None:
    import mlflow
    import torch

    mlflow.set_tracking_uri(uri)
    # The fluent API is what log_model uses; the driver sets the final status right after this.
    mlflow.start_run(run_id=run_id, log_system_metrics=False)
    try:
        # Explicit requirements: MLflow's inference imports and scans modules, seconds for nothing here.
        torch_req = f"torch=={torch.__version__.split('+')[0]}"
        mlflow.pytorch.log_model(model, name="model", input_example=input_example,
                                 pip_requirements=[torch_req])
    finally:
        mlflow.end_run()


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


def mark_preempted(uri: str, run_id: str, stopped_at: str) -> None:
    """The run stopped on request with a checkpoint and will be continued: KILLED until then (MLflow has no
    'suspended' state), with the stop point recorded."""
    client = _client(uri)
    previous = client.get_run(run_id).data.tags.get("preempted_at")
    client.set_tag(run_id, "preempted_at", f"{previous},{stopped_at}" if previous else stopped_at)
    client.set_terminated(run_id, status="KILLED")


def log_cluster_startup(uri: str, run_id: str) -> None:
    """Seconds from the cluster job's start to all Ray nodes joined, when a cluster script measured it
    (PIPELINE_CLUSTER_STARTUP_S, set by cluster/slurm); one value per attempt of the run."""
    value = os.environ.get("PIPELINE_CLUSTER_STARTUP_S")
    if not value:
        return
    client = _client(uri)
    attempt = int(client.get_run(run_id).data.tags.get("attempts", "1"))
    client.log_metric(run_id, "cluster_startup_s", float(value), step=attempt)


def set_tag(uri: str, run_id: str, key: str, value: str) -> None:
    _client(uri).set_tag(run_id, key, value)
