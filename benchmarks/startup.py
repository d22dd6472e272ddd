"""Where the start-up of a run goes: from the command to its first training step, in parts (contract/startup.py).

    python -m benchmarks.startup [--repeats 3] [--set trainer=tf_mwms ...] [--on-cluster | --submit]

Runs the MNIST demo (`pipelines.train`, the default MLP on 2 workers) for a few steps, `--repeats` times, with
PIPELINE_STARTED_AT set just before each process starts, and prints the median of each `startup.*` metric the
run logged. By default each run starts its own local Ray; with `--on-cluster`, runs join the Ray at RAY_ADDRESS
(a `ray start --head` already up); with `--submit`, as the demo (`cluster/local/run-demo.sh`) does: a local head
(`cluster/local/ray-local.sh`), each run sent by `ray job submit` with the demo's runtime environment (its
working directory uploaded), timed from just before `ray job submit` starts.
Last line: `startup_total_s=<median seconds from the command to the end of the first step>`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from benchmarks.common import MNIST, QUIET_ENV, ROOT, ensure_mnist, pipeline_run
from contract.startup import STARTED_AT_ENV, STARTUP_PARTS, STARTUP_TOTAL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--set", nargs="*", default=[], help="further pipelines.train overrides")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--on-cluster", action="store_true", help="join the Ray at RAY_ADDRESS")
    where.add_argument("--submit", action="store_true", help="`ray job submit` to a local head, as the demo")
    args = parser.parse_args()
    ensure_mnist()
    overrides = [f"data.path={MNIST}", "trainer.epochs=1", "trainer.max_steps_per_epoch=5",
                 "run.system_metrics=false", *args.set]
    runs = []
    with local_head() if args.submit else contextlib.nullcontext() as dashboard:
        for _ in range(args.repeats):
            os.environ[STARTED_AT_ENV] = repr(time.time())
            last = submitted_run(overrides, dashboard) if args.submit else \
                pipeline_run(overrides, on_cluster=args.on_cluster)[1]
            runs.append({name: last[name] for name in (*STARTUP_PARTS, STARTUP_TOTAL)})
            print("  ".join(f"{name.removeprefix('startup.')} {value:.1f}" for name, value in runs[-1].items()),
                  flush=True)
    medians = {name: float(np.median([run[name] for run in runs])) for name in runs[0]}
    print(f"median of {args.repeats}: " + ", ".join(f"{name.removeprefix('startup.')} {value:.1f} s"
                                                     for name, value in medians.items()))
    print(f"startup_total_s={medians[STARTUP_TOTAL]:.2f}")


@contextlib.contextmanager
def local_head() -> Iterator[str]:
    """A one-node Ray head on loopback, started and stopped as the demo does; yields its dashboard address."""
    with tempfile.TemporaryDirectory() as state:
        script = str(ROOT / "cluster" / "local" / "ray-local.sh")
        subprocess.run(["bash", script, "start", state], check=True, stdout=subprocess.DEVNULL)
        try:
            env = dict(line.removeprefix("export ").split("=", 1)
                       for line in (Path(state) / "ray.env").read_text().splitlines() if line.startswith("export "))
            yield env["RAY_DASHBOARD_ADDRESS"]
        finally:
            subprocess.run(["bash", script, "stop", state], check=True, stdout=subprocess.DEVNULL)


def submitted_run(overrides: list[str], dashboard: str) -> dict[str, float]:
    """One `ray job submit` of `pipelines.train <overrides>` with the demo's runtime environment (its working
    directory uploaded, the same excludes); the last value of every metric the run logged."""
    from mlflow.tracking import MlflowClient

    with tempfile.TemporaryDirectory() as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        runtime_env = {"excludes": ["/.venv", "/.git", "/data", "/outputs", "/mlflow.db", "/mlartifacts"],
                       "env_vars": {"MLFLOW_TRACKING_URI": uri, STARTED_AT_ENV: os.environ[STARTED_AT_ENV],
                                    **QUIET_ENV}}
        cmd = ["ray", "job", "submit", "--address", dashboard, "--working-dir", str(ROOT), "--runtime-env-json",
               json.dumps(runtime_env), "--", "python", "-m", "pipelines.train", *overrides,
               f"run.storage_path={tmp}/ray"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        ids = [line.split("=", 1)[1] for line in proc.stdout.splitlines() if line.startswith("mlflow_run_id=")]
        if proc.returncode != 0 or not ids:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return MlflowClient(uri).get_run(ids[-1]).data.metrics


if __name__ == "__main__":
    main()
