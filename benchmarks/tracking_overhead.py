"""What MLflow tracking costs a training step: the same run with step logging and system metrics on, and off,
against a real `mlflow server` over HTTP, in one run. Epoch metrics are logged either way (between epochs,
outside the timed steps).

    python -m benchmarks.tracking_overhead [--model mlp] [--epochs 3] [--repeats 7] [--every 10]

Pairs alternate (on, off, on, off, ...) so drifting machine load hits both; each run's figure is its steady step
time (mean of epochs 2..N). The overhead is the median over the pairs of on/off - 1, printed with a
distribution-free confidence interval for that median (order statistics of the pair ratios, at least 90%): on a
loaded 2-core machine single pairs move by +-10%, so the interval says what the run can and cannot tell.
Last line: `overhead=<median over pairs of on/off - 1>`.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

from benchmarks.common import MNIST, ensure_mnist, mlflow_server, pipeline_run, steady_rate


def step_time_ms(uri: str, args: argparse.Namespace, tracking: bool) -> float:
    history, _ = pipeline_run([f"model={args.model}", f"data.path={MNIST}", f"trainer.epochs={args.epochs}",
                               "trainer.num_workers=2", f"trainer.log_every_n_steps={args.every if tracking else 0}",
                               f"run.system_metrics={str(tracking).lower()}"], tracking_uri=uri)
    return steady_rate(history["step_time_ms"])


def median_interval(values: list[float], coverage: float = 0.9) -> tuple[float, float, float]:
    """(low, high, confidence) of the narrowest order-statistic interval [x_(k), x_(n+1-k)] that holds the median
    with at least `coverage` whatever the distribution: confidence = 1 - 2 P(Binomial(n, 1/2) < k). The widest
    interval (k = 1) when even that falls short."""
    ordered, n = sorted(values), len(values)

    def confidence(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n

    k = 1
    while k + 1 <= (n + 1) // 2 and confidence(k + 1) >= coverage:
        k += 1
    return ordered[k - 1], ordered[n - k], confidence(k)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
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
    ratios = list(np.array(on) / np.array(off) - 1)
    low, high, confidence = median_interval(ratios)
    print("pairs: " + ", ".join(f"{r:+.1%}" for r in ratios))
    print(f"median overhead {np.median(ratios):+.1%}, {confidence:.0%} interval for it [{low:+.1%}, {high:+.1%}]")
    print(f"overhead={np.median(ratios):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
