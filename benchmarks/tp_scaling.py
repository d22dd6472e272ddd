"""Tensor parallelism on this machine: per-rank parameter bytes, step time and its collective share, memory,
for tp in {1, 2, 4} and 2D dp=2 x tp=2, on the same BERT and data in one run. The dense tp=1 run is the
reference (it is plain data-parallel-free PyTorch on one worker).

    bash cluster/local/ray-local.sh start /tmp/bench-ray 6 && source /tmp/bench-ray/ray.env
    python -m benchmarks.tp_scaling [--data data/imdb/parquet] [--steps 30] [--impl megatron]
    bash cluster/local/ray-local.sh stop /tmp/bench-ray

Needs prepared IMDb shards (`python -m pipelines.prepare imdb --source ... --out data/imdb/parquet`), and a Ray
head declaring 6 CPUs (RAY_ADDRESS): the tp=4 and dp=2 x tp=2 layouts run 4 one-thread workers, which the
pipeline refuses on a 2-core machine without one. Every layout runs on that head.
Last line: `ratio=<rank-0 parameter bytes at tp=2 / at tp=1>` (ideal 0.5 for the sharded layers).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.common import ROOT, cluster_missing, pipeline_run

LAYOUTS = [("tp=1", 1, 1), ("tp=2", 2, 2), ("tp=4", 4, 4), ("dp=2 x tp=2", 4, 2)]  # name, workers, tp


def run(data: Path, workers: int, tp: int, steps: int, impl: str) -> dict[str, float]:
    _, last = pipeline_run(["trainer=tp", "data=imdb", "model=bert_tiny", "model.heads=4", f"data.path={data}",
                            f"trainer.num_workers={workers}", f"trainer.tp={tp}", f"trainer.tp_impl={impl}",
                            "trainer.epochs=1", f"trainer.max_steps_per_epoch={steps}", "trainer.batch_size=16"],
                           on_cluster=True)
    return last


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "imdb" / "parquet")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--impl", default="megatron", choices=["megatron", "dtensor"])
    args = parser.parse_args()
    if cluster_missing(6):
        return 2
    results = {name: run(args.data.resolve(), workers, tp, args.steps, args.impl) for name, workers, tp in LAYOUTS}
    dense_bytes = results["tp=1"]["rank0.param_bytes"]
    print(f"BERT tiny (2 layers, hidden 128, 4 heads), batch 16 per DP replica, {args.steps} steps, "
          f"impl={args.impl}, 2 CPU cores")
    print("| layout | step time (ms) | collectives / train time (rank 0) | param bytes / rank | vs tp=1 "
          "| peak RSS rank 0 (MiB) | samples/s |")
    print("|---|---|---|---|---|---|---|")
    for name, m in results.items():
        share = m["rank0.collective_time_s"] / m["epoch_time_s"]
        print(f"| {name} | {m['step_time_ms']:.0f} | {100 * share:.1f}% | {m['rank0.param_bytes'] / 1e6:.2f} MB "
              f"| {m['rank0.param_bytes'] / dense_bytes:.3f} | {m['rank0.peak_memory_bytes'] / 2**20:.0f} "
              f"| {m['samples_per_s']:.1f} |")
    print(f"ratio={results['tp=2']['rank0.param_bytes'] / dense_bytes:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
