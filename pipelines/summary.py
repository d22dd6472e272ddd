"""The block a training run or a sweep ends its console output with: how it ended, where its run, model, checkpoints
and report are, and the MLflow UI address of its run. Read back from MLflow, so it says what the tracking server
holds, a continued run's earlier attempts included; what the server cannot say is left out, never guessed."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

from contract import tracking
from contract.recipe import Monitor

UI_PORT = 5000  # `mlflow ui`'s default


def mlflow_ui(uri: str, experiment_id: str, run_id: str) -> str:
    """Where to see the run: its page on a tracking server, or the command that serves a local store and the page."""
    page = f"#/experiments/{experiment_id}/runs/{run_id}"
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/{page}"
    beside = Path(sys.executable).parent / "mlflow"  # the environment's own, which a shell's PATH may not have
    command = str(beside) if beside.is_file() else "mlflow"
    return f"{command} ui --backend-store-uri {uri} --port {UI_PORT}, then http://127.0.0.1:{UI_PORT}/{page}"


def best_epoch(client: Any, run_id: str, monitor: Monitor) -> tuple[int, float] | None:
    """(epoch, value) of the best epoch by `monitor` in the run's history (a tie: the later epoch, as the loop
    picks), or None when no epoch reported the metric."""
    best = None
    for point in sorted(client.get_metric_history(run_id, monitor.metric), key=lambda p: (p.step, p.timestamp)):
        if best is None or monitor.better(point.value, best[1]):
            best = (point.step, point.value)
    return best


def logged_model_uri(uri: str, run: Any) -> str | None:
    """The run's model: its registered version when it has one, else the model it logged (`models:/<model id>`)."""
    if registered := run.data.tags.get("registered_model"):
        return f"models:/{registered}"
    models = tracking.logged_models(uri, run.info.run_id)
    return models[-1].model_uri if models else None


def block(title: str, rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(key) for key, _ in rows)
    return [f"--- {title} ---", *(f"{key:<{width}}  {value}" for key, value in rows)]


def duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


def from_server(uri: str, read: Callable[[Any], list[tuple[str, str]]]) -> list[tuple[str, str]]:
    """`read(client)`'s rows, or one row saying the server did not answer (a summary never fails a run). Asks
    whether it answers first: MLflow's client retries a server that is away for minutes."""
    try:
        if not tracking.answers(uri):
            raise ConnectionError(uri)
        return read(tracking.mlflow_client(uri))
    except Exception as err:  # the server went away, or refused: the run's own lines already said what happened
        return [("MLflow", f"the tracking server {uri} did not answer ({type(err).__name__})")]


def run_summary(uri: str, run_id: str, monitor: Monitor, eval_split: str, checkpoints: str,
                seconds: float) -> list[str]:
    """A training run's closing block."""
    def read(client: Any) -> list[tuple[str, str]]:
        run = client.get_run(run_id)
        rows = [("status", run.info.status), ("run", f"{run_id} ({run.info.run_name})")]
        if (best := best_epoch(client, run_id, monitor)) is not None:
            rows.append(("best epoch", f"{best[0]}: {monitor.metric} {best[1]:.4g} (on the {eval_split} split)"))
        final = {name.removeprefix("final_test_"): value for name, value in sorted(run.data.metrics.items())
                 if name.startswith("final_test_") and name != "final_test_rows"}
        if final:  # the chosen model, scored once on the held-out test split
            rows.append(("test split", ", ".join(f"{name} {value:.4g}" for name, value in final.items())))
        if (model := logged_model_uri(uri, run)) is not None:
            rows.append(("model", f"{model}  (rtp evaluate model={run_id})"))
        rows.append(("checkpoints", checkpoints))
        rows.append(("MLflow UI", mlflow_ui(uri, run.info.experiment_id, run_id)))
        return rows

    return block("run", [*from_server(uri, read), ("wall time", duration(seconds))])


def sweep_summary(uri: str, parent_id: str, metric: str, seconds: float) -> list[str]:
    """A sweep's closing block: its parent run, its best trial (the report's pick) and where the report is."""
    def read(client: Any) -> list[tuple[str, str]]:
        parent = client.get_run(parent_id)
        tags, metrics = parent.data.tags, parent.data.metrics
        rows = [("status", parent.info.status), ("sweep run", f"{parent_id} ({parent.info.run_name})")]
        if best_id := tags.get("best.run_id"):
            value = metrics.get(f"best.{metric}")
            rows.append(("best trial", f"{tags.get('best.trial', '')}: {metric} "
                                       f"{'?' if value is None else f'{value:.4g}'} (run {best_id})"))
            if (model := logged_model_uri(uri, client.get_run(best_id))) is not None:
                rows.append(("its model", model))
        if any(item.path == "report" for item in client.list_artifacts(parent_id)):
            rows.append(("report", f"{parent.info.artifact_uri}/report  (rtp report {parent_id})"))
        rows.append(("MLflow UI", mlflow_ui(uri, parent.info.experiment_id, parent_id)))
        return rows

    return block("sweep", [*from_server(uri, read), ("wall time", duration(seconds))])
