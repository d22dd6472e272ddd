"""What every benchmark shares: the MNIST data, the common arguments, and one pipeline run read back from
MLflow (a throwaway sqlite store and a local Ray started by the pipeline itself)."""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MNIST = ROOT / "data" / "mnist" / "parquet"
QUIET_ENV = {"OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}


def mnist_parser(description: str | None) -> argparse.ArgumentParser:
    """--epochs, --model, --batch (per worker)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--batch", type=int, default=128)
    return parser


def ensure_mnist() -> None:
    """Prepare the bundled MNIST as Parquet shards if that has not been done yet."""
    if not (MNIST / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "pipelines.prepare", "mnist", "--out", str(MNIST)], check=True)


def mnist_arrays(split: str) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 images [N, 784], int64 labels [N]) of a prepared split, read straight from its Parquet shards."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipelines.data.shards import read_manifest, shard_paths

    table = pa.concat_tables(pq.read_table(p) for p in shard_paths(MNIST, read_manifest(MNIST), split))
    images = table.column("image").combine_chunks().flatten().to_numpy().reshape(-1, 784)
    return images.copy(), table.column("label").to_numpy().astype(np.int64)


def cluster_missing(cpus: int) -> bool:
    """True (after one line on stderr) when no Ray head is set (RAY_ADDRESS): a 4-worker layout needs one that
    declares `cpus` CPUs, since the pipeline refuses more one-thread workers than this machine has cores."""
    if os.environ.get("RAY_ADDRESS"):
        return False
    print(f"error: RAY_ADDRESS: start a Ray head with {cpus} CPUs first (see the module docstring)", file=sys.stderr)
    return True


def pipeline_run(overrides: list[str], on_cluster: bool = False,
                 tracking_uri: str | None = None) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Run `python -m pipelines.train <overrides>` and return (every metric's history in step order, the last
    value of every metric). On a Ray of its own, unless `on_cluster`: then on the one at RAY_ADDRESS. MLflow:
    `tracking_uri`, or a throwaway sqlite store."""
    from mlflow.tracking import MlflowClient

    with tempfile.TemporaryDirectory() as tmp:
        uri = tracking_uri or f"sqlite:///{tmp}/mlflow.db"
        env = {**os.environ, "MLFLOW_TRACKING_URI": uri, **QUIET_ENV}
        if not on_cluster:
            env.pop("RAY_ADDRESS", None)
        cmd = [sys.executable, "-m", "pipelines.train", *overrides, f"run.storage_path={tmp}/ray"]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        run_id = proc.stdout.strip().splitlines()[-1].split("=", 1)[1]
        client = MlflowClient(uri)
        last = client.get_run(run_id).data.metrics
        history = {name: [m.value for m in sorted(client.get_metric_history(run_id, name), key=lambda m: m.step)]
                   for name in last}
        return history, last


def free_ports(count: int) -> list[int]:
    """Loopback ports free right now (all held at once while picking, so they differ)."""
    socks = [socket.socket() for _ in range(count)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def mlflow_server(extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Iterator[str]:
    """A real `mlflow server` on loopback for the duration (sqlite backend, proxied artifacts); yields its URL.
    `extra_args` go on its command line (e.g. `--app-name basic-auth`), `env` into its environment."""
    with tempfile.TemporaryDirectory() as tmp:
        [port] = free_ports(1)
        proc = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
                                 "--port", str(port), "--workers", "1", "--backend-store-uri",
                                 f"sqlite:///{tmp}/mlflow.db", "--artifacts-destination", f"{tmp}/artifacts",
                                 *extra_args],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **(env or {})})
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while not answers(f"{url}/health"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"mlflow server on port {port} did not start")
                time.sleep(0.5)
            yield url
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)


def steady_rate(rates: list[float]) -> float:
    """Mean throughput of epochs 2..N: epoch 1 of a pipeline also pulls the shard through Ray Data."""
    return float(np.mean(rates[1:]))


def alternated(repeats: int, bare: Callable[[], list[float]], ours: Callable[[], list[float]]) -> float:
    """`repeats` rounds of the bare run then ours, in turn, each round's steady rates and ratio printed as it ends;
    returns the median of the rounds' ratios. A drift of the machine then hits both sides of a round alike, and
    the ratio is not one noisy run against another."""
    rounds = []
    for i in range(1, repeats + 1):
        bare_rates, our_rates = bare(), ours()
        bare_rate, our_rate = steady_rate(bare_rates), steady_rate(our_rates)
        rounds.append((bare_rate, our_rate))
        print(f"round {i}: bare {bare_rate:.0f}, ours {our_rate:.0f} samples/s, ratio {our_rate / bare_rate:.3f} "
              f"(per epoch: bare {np.round(bare_rates).astype(int).tolist()}, "
              f"ours {np.round(our_rates).astype(int).tolist()})", flush=True)
    ratios = [o / b for b, o in rounds]
    if repeats > 1:
        print(f"medians of {repeats} rounds: bare {np.median([b for b, _ in rounds]):.0f}, ours "
              f"{np.median([o for _, o in rounds]):.0f} samples/s; ratios {min(ratios):.3f}-{max(ratios):.3f}")
    return float(np.median(ratios))
