"""What the hang watchdog and the straggler clock cost a training step: the same run with the watcher on
(`fault.hang_timeout_s`, its default) and off (0), in pairs, on the MNIST MLP (the cheapest step, where a per-step
cost shows most).

    python -m benchmarks.hang_watch [--repeats 5] [--epochs 3] [--set trainer=tf_mwms ...]

The loop marks each rank's position twice a step (a tuple assignment, counted here too), and each rank's watcher
thread publishes it every few seconds; neither adds a collective or a device sync. Pairs alternate (on, off, ...)
so drifting machine load hits both; each run's figure is its steady step time (epochs 2..N). Printed: each pair's
ratio, their median with a distribution-free interval (benchmarks/tracking_overhead.py's method), and the marks'
own cost against the step, with the straggler clock's (contract/stragglers.py: a clock read and three sums a step
in the loop, a clock read and a sum in the forward; always on, counted). Last line: `overhead=<median over pairs
of on/off - 1>`.
"""
from __future__ import annotations

import argparse
import time
import timeit

import numpy as np

from benchmarks.common import MNIST, ensure_mnist, pipeline_run, steady_rate
from benchmarks.tracking_overhead import median_interval
from contract.hang import Progress
from contract.stragglers import StepClock
from trainers.callbacks.base import Callbacks
from trainers.callbacks.hang_marks import HangMarks


def step_time_ms(args: argparse.Namespace, watched: bool) -> float:
    history, _ = pipeline_run(["model=mlp", f"data.path={MNIST}", f"trainer.epochs={args.epochs}",
                               "trainer.num_workers=2", "run.system_metrics=false",
                               f"fault.hang_timeout_s={600 if watched else 0}", *args.set])
    return steady_rate(history["step_time_ms"])


def mark_ns() -> float:
    """One position mark, as the loop makes it (twice a step): through its callbacks to the hang watcher's."""
    callbacks, calls = Callbacks([HangMarks(Progress())]), 1_000_000
    return timeit.timeit(lambda: callbacks.on_phase(2, 17, "step"), number=calls) / calls * 1e9


def clock_ns() -> float:
    """The straggler clock's work in one step: as the loop and the PyTorch adapter do it."""
    clock, calls = StepClock(0.0), 1_000_000

    def step() -> None:
        waited = time.perf_counter() - 1.0
        clock.data_wait_s += waited
        clock.steps += 1
        clock.forward_s += time.perf_counter() - 1.0
    return timeit.timeit(step, number=calls) / calls * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--set", nargs="*", default=[], help="more training overrides")
    args = parser.parse_args()
    ensure_mnist()
    on, off = [], []
    for _ in range(args.repeats):
        on.append(step_time_ms(args, True))
        off.append(step_time_ms(args, False))
        print(f"watched {on[-1]:.3f} ms, unwatched {off[-1]:.3f} ms", flush=True)
    ratios = list(np.array(on) / np.array(off) - 1)
    low, high, confidence = median_interval(ratios)
    print("pairs: " + ", ".join(f"{r:+.1%}" for r in ratios))
    print(f"median overhead {np.median(ratios):+.1%}, {confidence:.0%} interval for it [{low:+.1%}, {high:+.1%}]")
    marks = 2 * mark_ns() / 1e6
    print(f"marks: {marks * 1e3:.2f} us a step, {marks / np.median(off):.4%} of the unwatched step")
    clock = clock_ns() / 1e6
    print(f"straggler clock: {clock * 1e3:.2f} us a step, {clock / np.median(off):.4%} of the unwatched step")
    print(f"overhead={np.median(ratios):.4f}")


if __name__ == "__main__":
    main()
