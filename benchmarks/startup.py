"""Where the start-up of a run goes: from the command to its first training step, in parts (contract/startup.py).

    python -m benchmarks.startup [--repeats 3] [--set trainer=tf_mwms ...] [--on-cluster]

Runs the MNIST demo (`pipelines.train`, the default MLP on 2 workers) for a few steps, `--repeats` times, with
PIPELINE_STARTED_AT set just before each process starts, and prints the median of each `startup.*` metric the
run logged. Without `--on-cluster` each run starts its own local Ray (as the README's first command does); with
it, runs join the Ray at RAY_ADDRESS (a `ray start --head` already up, as `ray job submit` finds it).
Last line: `startup_total_s=<median seconds from the command to the end of the first step>`.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from benchmarks.common import MNIST, ensure_mnist, pipeline_run
from contract.startup import STARTED_AT_ENV, STARTUP_PARTS, STARTUP_TOTAL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--set", nargs="*", default=[], help="further pipelines.train overrides")
    parser.add_argument("--on-cluster", action="store_true", help="join the Ray at RAY_ADDRESS")
    args = parser.parse_args()
    ensure_mnist()
    overrides = [f"data.path={MNIST}", "trainer.epochs=1", "trainer.max_steps_per_epoch=5",
                 "run.system_metrics=false", *args.set]
    runs = []
    for _ in range(args.repeats):
        os.environ[STARTED_AT_ENV] = repr(time.time())
        _, last = pipeline_run(overrides, on_cluster=args.on_cluster)
        runs.append({name: last[name] for name in (*STARTUP_PARTS, STARTUP_TOTAL)})
        print("  ".join(f"{name.removeprefix('startup.')} {value:.1f}" for name, value in runs[-1].items()),
              flush=True)
    medians = {name: float(np.median([run[name] for run in runs])) for name in runs[0]}
    print(f"median of {args.repeats}: " + ", ".join(f"{name.removeprefix('startup.')} {value:.1f} s"
                                                     for name, value in medians.items()))
    print(f"startup_total_s={medians[STARTUP_TOTAL]:.2f}")


if __name__ == "__main__":
    main()
