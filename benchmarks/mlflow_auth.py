"""What MLflow's basic-auth app costs a request, with and without its credential cache: the Slurm job's own MLflow
server (cluster/slurm/ray-cluster.sbatch) runs behind basic auth, and every request of a run (metrics, tags, the
final model's artifacts) carries the job's credential. Two real `mlflow server --app-name basic-auth`, one with
`auth_cache_ttl_seconds` (as the sbatch script sets it) and one without (MLflow's default), each sent the same
requests through MlflowClient, alternating, in one run.

    python -m benchmarks.mlflow_auth [--requests 50] [--repeats 5]

Last line: `ratio=<median seconds per request without the cache / with it>`.
"""
from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

from benchmarks.common import mlflow_server

USER = "bench"
CACHE_S = 3600  # as cluster/slurm/ray-cluster.sbatch sets it


@contextmanager
def auth_server(password: str, cache_s: int) -> Iterator[str]:
    """A basic-auth MLflow server whose admin is USER/`password`; `cache_s` 0: no credential cache."""
    with tempfile.TemporaryDirectory() as folder:
        ini = Path(folder) / "auth.ini"
        ini.write_text(f"[mlflow]\ndefault_permission = NO_PERMISSIONS\ndatabase_uri = sqlite:///{folder}/auth.db\n"
                       f"admin_username = {USER}\nadmin_password = {password}\n"
                       "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                       f"auth_cache_ttl_seconds = {cache_s}\n")
        with mlflow_server(("--app-name", "basic-auth"), {"MLFLOW_AUTH_CONFIG_PATH": str(ini),
                                                          "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16)}) \
                as url:
            yield url


def seconds_per_request(url: str, requests: int) -> float:
    """`requests` calls of a run's kind (log a metric, read the run back), timed."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(url)
    run_id = client.create_run(client.create_experiment(f"auth-{time.time_ns()}")).info.run_id
    start = time.perf_counter()
    for step in range(requests // 2):
        client.log_metric(run_id, "loss", 1.0 / (step + 1), step=step)
        client.get_run(run_id)
    return (time.perf_counter() - start) / (2 * (requests // 2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    password = secrets.token_urlsafe(24)
    os.environ.update(MLFLOW_TRACKING_USERNAME=USER, MLFLOW_TRACKING_PASSWORD=password)
    cached, plain = [], []
    with auth_server(password, CACHE_S) as with_cache, auth_server(password, 0) as without:
        for _ in range(args.repeats):  # alternating: drifting load hits both
            cached.append(seconds_per_request(with_cache, args.requests))
            plain.append(seconds_per_request(without, args.requests))
    on, off = float(np.median(cached)), float(np.median(plain))
    print(f"ms per request, median of {args.repeats} x {args.requests}: cache {on * 1e3:.1f} "
          f"({min(cached) * 1e3:.1f}-{max(cached) * 1e3:.1f}), no cache {off * 1e3:.1f} "
          f"({min(plain) * 1e3:.1f}-{max(plain) * 1e3:.1f})")
    print(f"ratio={off / on:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
