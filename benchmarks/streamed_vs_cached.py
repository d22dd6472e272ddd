"""Streamed data against data held in memory, and what checkpoints inside epochs cost: the same `rtp train` run
(ddp on the bundled MNIST, or `--trainer`, `--data-path`) with `data.cache_in_worker=true` and `false`, or without
and with `run.checkpoint_every_n_steps`, in alternation, at 1 and 2 workers.

    python -m benchmarks.streamed_vs_cached [--model cnn] [--epochs 3] [--workers 1,2] [--repeats 3]
                                            [--trainer ddp] [--data-path data/mnist/parquet]
                                            [--checkpoint-every 0] [--set trainer.batch_size=128 ...]

Each round runs the reference (held in memory; or no step checkpoints) then the other, on a Ray of their own, one
thread per worker; throughput is global samples/s, the mean of epochs 2..N (epoch 1 pulls the shard, or starts Ray
Data's first reads). Printed per round: both rates, their ratio, and the streamed run's `data_wait_fraction` (the
share of the epoch spent waiting for batches). Per worker count: the median of the rounds' ratios; the last line,
`ratio=`, that median at the last worker count. `--checkpoint-every N` compares the held-in-memory run without and
with a checkpoint every N steps instead, and prints what one checkpoint held training up (the run's
`step_checkpoints_s` over `step_checkpoints`) and that time's share of a 60-second interval.
"""
from __future__ import annotations

import argparse

import numpy as np

from benchmarks.common import MNIST, ensure_mnist, pipeline_run, steady_rate


CHECKPOINT_INTERVAL_S = 60.0  # the interval a checkpoint's cost is put against


def rates(overrides: list[str]) -> tuple[list[float], float, float | None]:
    """A run's global samples/s per epoch, its mean data wait fraction over epochs 2..N, and the seconds one
    checkpoint inside an epoch held training up (None: it took none)."""
    history, _ = pipeline_run(overrides)
    taken = sum(history.get("step_checkpoints", []))
    per_checkpoint = sum(history["step_checkpoints_s"]) / taken if taken else None
    return history["samples_per_s"], float(np.mean(history["data_wait_fraction"][1:])), per_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trainer", default="ddp")
    parser.add_argument("--data-path", default=str(MNIST), help="a prepared dataset (its data= choice via --set)")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="steps; 0: compare streamed with held")
    parser.add_argument("--set", nargs="*", default=[], help="more pipelines.train overrides")
    args = parser.parse_args()
    ensure_mnist()
    if args.checkpoint_every:
        reference, other = ["run.checkpoint_every_n_steps=0"], [f"run.checkpoint_every_n_steps={args.checkpoint_every}"]
        names = ("epoch-end checkpoints", f"a checkpoint every {args.checkpoint_every} steps")
    else:
        reference, other = ["data.cache_in_worker=true"], ["data.cache_in_worker=false"]
        names = ("held", "streamed")
    for workers in [int(w) for w in args.workers.split(",")]:
        common = [f"trainer={args.trainer}", f"model={args.model}", f"data.path={args.data_path}",
                  f"trainer.epochs={args.epochs}",
                  f"trainer.num_workers={workers}", "run.system_metrics=false", *args.set]
        ratios = []
        for i in range(1, args.repeats + 1):
            (ref_rates, _, _), (rates_other, wait, per_checkpoint) = (rates([*common, *reference]),
                                                                     rates([*common, *other]))
            ref_rate, other_rate = steady_rate(ref_rates), steady_rate(rates_other)
            ratios.append(other_rate / ref_rate)
            cost = "" if per_checkpoint is None else (
                f", {per_checkpoint:.3f} s a checkpoint ({per_checkpoint / CHECKPOINT_INTERVAL_S:.2%} of "
                f"{CHECKPOINT_INTERVAL_S:.0f} s)")
            print(f"{workers} worker(s), round {i}: {names[0]} {ref_rate:.0f}, {names[1]} {other_rate:.0f} "
                  f"samples/s, ratio {ratios[-1]:.3f}, {names[1]}'s data wait {wait:.1%}{cost}", flush=True)
        print(f"{workers} worker(s): {names[1]} / {names[0]} = {np.median(ratios):.3f} (median of {args.repeats}, "
              f"{min(ratios):.3f}-{max(ratios):.3f})", flush=True)
    print(f"ratio={np.median(ratios):.3f}")


if __name__ == "__main__":
    main()
