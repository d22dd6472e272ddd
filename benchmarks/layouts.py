"""Parallel layouts of the same model at 4 workers, in one run: what each rank holds (parameter, gradient and
optimizer-state bytes, as the backends log them every epoch; the largest rank's) and the step time, for DDP, FSDP2,
HSDP, DTensor TP, FSDP x TP, and pipelines (2 stages, 1F1B, 4 micro-batches) with TP or FSDP, on BERT small (4 layers,
hidden 256, 4 heads) and the same IMDb shards, at the same global batch.

    bash cluster/local/ray-local.sh start /tmp/bench-ray 6 && source /tmp/bench-ray/ray.env
    python -m benchmarks.layouts [--data data/imdb/parquet] [--steps 20] [--global-batch 32]
    bash cluster/local/ray-local.sh stop /tmp/bench-ray

Needs prepared IMDb shards (`python -m pipelines.prepare imdb --source ... --out data/imdb/parquet`), and a Ray
head declaring 6 CPUs (RAY_ADDRESS; 4 for the workers, 2 for Ray Data's readers): without one, the pipeline
refuses 4 one-thread workers on a 2-core machine.
Last line: `ratio=<FSDP's parameter bytes per rank / DDP's>` (ideal 0.25 at 4 workers).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.common import ROOT, cluster_missing, pipeline_run

# name, overrides, ranks that share a batch (pp x tp): the per-replica batch is global / (4 / that)
LAYOUTS = [
    ("ddp", ["trainer=ddp"], 1),
    ("fsdp", ["trainer=fsdp"], 1),
    ("hsdp 2 replicas x 2 shards", ["trainer=fsdp", "trainer.dp_replicate=2"], 1),
    ("tp 4 (dtensor)", ["trainer=tp", "trainer.tp=4", "trainer.tp_impl=dtensor"], 4),
    ("fsdp 2 x tp 2", ["trainer=fsdp", "trainer.tp=2"], 2),
    ("pp 2 x tp 2", ["trainer=fsdp", "trainer.pp=2", "trainer.tp=2"], 4),
    ("pp 2 x fsdp 2", ["trainer=fsdp", "trainer.pp=2"], 2),
]
WORKERS = 4


def run(data: Path, overrides: list[str], batch: int, steps: int) -> dict[str, float]:
    _, last = pipeline_run([*overrides, "data=imdb", "model=bert_small", f"data.path={data}",
                            f"trainer.num_workers={WORKERS}", "trainer.epochs=1", f"trainer.batch_size={batch}",
                            f"trainer.max_steps_per_epoch={steps}", "run.system_metrics=false"], on_cluster=True)
    return last


def largest(metrics: dict[str, float], name: str) -> float:
    """The largest rank's `name` (pipeline stages hold different parts: the first the embeddings)."""
    return max(metrics[f"rank{r}.{name}"] for r in range(WORKERS))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "imdb" / "parquet")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=32)
    args = parser.parse_args()
    if cluster_missing(6):
        return 2
    results = {name: run(args.data.resolve(), overrides, args.global_batch * tp // WORKERS, args.steps)
               for name, overrides, tp in LAYOUTS}
    mib = 2 ** 20
    print(f"BERT small (4 layers, hidden 256, 4 heads), {WORKERS} workers x 1 thread, global batch "
          f"{args.global_batch}, {args.steps} steps, Adam")
    print("| layout | params / rank (MiB) | grads / rank (MiB) | Adam state / rank (MiB) | params vs ddp "
          "| peak RSS rank 0 (MiB) | step time (ms) | samples/s |")
    print("|---|---|---|---|---|---|---|---|")
    ddp_bytes = largest(results["ddp"], "param_bytes")
    for name, m in results.items():
        print(f"| {name} | {largest(m, 'param_bytes') / mib:.2f} | {largest(m, 'grad_bytes') / mib:.2f} "
              f"| {largest(m, 'optimizer_state_bytes') / mib:.2f} | {largest(m, 'param_bytes') / ddp_bytes:.3f} "
              f"| {m['rank0.peak_memory_bytes'] / mib:.0f} | {m['step_time_ms']:.0f} | {m['samples_per_s']:.1f} |")
    print(f"ratio={largest(results['fsdp'], 'param_bytes') / ddp_bytes:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
