"""Whether the tracking server can be used, checked before any cluster resource is taken: an HTTP server answers
and takes our credentials; a local store opens (contract/tracking/store.py)."""
from __future__ import annotations

import base64
import os
import urllib.error
import urllib.request

from contract.tracking.server import TrackingUnavailable
from contract.tracking.store import check_local_store


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
        check_local_store(uri)
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


def answers(uri: str) -> bool:
    """Whether the tracking server answers now (a local store always does)."""
    try:
        check_reachable(uri)
        return True
    except TrackingUnavailable:
        return False
