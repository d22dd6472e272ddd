"""What MLflow tracking costs a training step: the same run with step logging and system metrics on, and off,
against a real `mlflow server` over HTTP, in one run. Epoch metrics are logged either way (between epochs,
outside the timed steps).

    python -m benchmarks.tracking_overhead [--model mlp] [--epochs 3] [--repeats 3] [--every 10]

Pairs alternate (on, off, on, off, ...) so drifting machine load hits both; each figure is the median over the
repeats of the steady step time (mean of epochs 2..N). Last line: `overhead=<median over pairs of on/off - 1>`.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from benchmarks.common import MNIST, ensure_mnist, mlflow_server, pipeline_run, steady_rate


def step_time_ms(uri: str, args: argparse.Namespace, tracking: bool) -> float:
    history, _ = pipeline_run([f"model={args.model}", f"data.path={MNIST}", f"trainer.epochs={args.epochs}",
                               "trainer.num_workers=2", f"trainer.log_every_n_steps={args.every if tracking else 0}",
                               f"run.system_metrics={str(tracking).lower()}"], tracking_uri=uri)
    return steady_rate(history["step_time_ms"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--every", type=int, default=10, help="trainer.log_every_n_steps when tracking is on")
    args = parser.parse_args()
    ensure_mnist()
    on, off = [], []
    with mlflow_server() as uri:
        for _ in range(args.repeats):
            on.append(step_time_ms(uri, args, True))
            off.append(step_time_ms(uri, args, False))
            print(f"step time: tracking on {on[-1]:.2f} ms, off {off[-1]:.2f} ms; load {os.getloadavg()[0]:.1f}",
                  flush=True)
    print(f"model={args.model}, 2 workers, step_loss every {args.every} steps + system metrics vs neither; "
          f"median of {args.repeats}: on {np.median(on):.2f} ms, off {np.median(off):.2f} ms")
    print(f"overhead={np.median(np.array(on) / np.array(off)) - 1:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
