"""Where runs are tracked: the tracking URI (MLFLOW_TRACKING_URI, else the project's sqlite store) and the MLflow
client of a URI."""
from __future__ import annotations

import os
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parents[2]


class TrackingUnavailable(RuntimeError):
    """The MLflow tracking server cannot be reached."""


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{PROJECT_DIR / 'mlflow.db'}"


def mlflow_client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)
