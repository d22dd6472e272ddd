"""An elastic run that loses a node: the time from the node's loss to the first training step of the smaller group,
and the run's goodput against the same run without the loss.

    python -m benchmarks.elastic [--rows 48000] [--epochs 2] [--lose-after-s 30] [--checkpoint-every 20]

A local Ray of a head without CPUs for workers and three nodes of one CPU each (cluster/local/ray-local.sh `join`,
on loopback addresses), an MLflow server, and `rtp train` (ddp, an MLP on a generated table, streamed, 3 workers,
`trainer.min_workers=2`, a checkpoint every `--checkpoint-every` steps). `--lose-after-s` seconds into training
one node is killed (SIGKILL to its Ray processes); the run goes on with 2 workers from its last checkpoint. Printed:
the seconds from the kill to the first step the 2 workers trained (the step loss's time), the steps trained again,
and the `goodput` of that run and of the same run on the 3 nodes throughout. The last line, `recovery_s=`, is the
first figure.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

from benchmarks.common import QUIET_ENV, ROOT, mlflow_server
from tests.support.local_ray import LOOPBACK_NODES, join_node, lose_node, started_ray_head


def train(args: list[str], env: dict[str, str], lose: tuple[Path, dict[str, str], float] | None) -> tuple[str, float]:
    """Run `rtp train args`; with `lose` (the head's state and env, seconds), kill node 3 that long after the first
    step.
    Returns the MLflow run id and the kill's time (0: none)."""
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.train", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    run_id = next(line.split()[2] for line in proc.stdout if line.startswith("MLflow run "))
    killed = 0.0
    if lose is not None:
        state, cluster, after_s = lose
        client = MlflowClient(env["MLFLOW_TRACKING_URI"])
        while not client.get_metric_history(run_id, "step_loss"):
            time.sleep(1)
        time.sleep(after_s)
        killed = time.time()
        lose_node(state, cluster, 3)
    proc.communicate(timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"rtp train {' '.join(args)} exited {proc.returncode}")
    return run_id, killed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=48000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lose-after-s", type=float, default=30.0)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, mlflow_server() as uri:
        data = Path(tmp) / "data"
        subprocess.run([sys.executable, "-m", "pipelines.prepare", "synthetic", "--rows", str(args.rows),
                        "--features", "64", "--rows-per-shard", "2000", "--out", str(data)], cwd=ROOT, check=True,
                       capture_output=True, env={**os.environ, **QUIET_ENV})
        common = ["trainer=ddp", "model=mlp", "model.hidden=[256]", f"data.path={data}", "data.cache_in_worker=false",
                  "trainer.num_workers=3", "trainer.min_workers=2", "trainer.batch_size=32",
                  f"trainer.epochs={args.epochs}", "trainer.log_every_n_steps=1", "fault.max_failures=3",
                  f"run.checkpoint_every_n_steps={args.checkpoint_every}", "run.system_metrics=false"]
        goodputs, client = {}, MlflowClient(uri)
        for name in ("without a loss", "one node lost"):
            state = Path(tmp) / f"ray-{len(goodputs)}"
            # A head without CPUs for workers, and three nodes of one CPU each.
            with started_ray_head(state, 0, RAY_LOCAL_NODES="1") as values:
                for slot in LOOPBACK_NODES:
                    join_node(state, values, slot)
                env = {**os.environ, **QUIET_ENV, **values, "MLFLOW_TRACKING_URI": uri}
                lose = (state, values, args.lose_after_s) if goodputs else None
                run_id, killed = train([*common, f"run.storage_path={tmp}/{name.replace(' ', '-')}"], env, lose)
            goodputs[name] = client.get_run(run_id).data.metrics["goodput"]
        steps = client.get_metric_history(run_id, "step_loss")
        after = min((m for m in steps if m.timestamp / 1000 > killed), key=lambda m: m.timestamp)
        again = len(steps) - len({m.step for m in steps})
        recovery = after.timestamp / 1000 - killed
        print(f"node lost {args.lose_after_s:g} s into training: the 2 workers trained step {after.step} "
              f"{recovery:.1f} s later ({again} step(s) trained twice); tags: "
              f"{client.get_run(run_id).data.tags.get('workers')}")
        print(f"goodput: {goodputs['without a loss']:.3f} without a loss, {goodputs['one node lost']:.3f} with one")
        print(f"recovery_s={recovery:.1f}")


if __name__ == "__main__":
    main()
