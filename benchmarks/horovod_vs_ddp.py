"""Horovod (Gloo) vs DDP (gloo) vs a bare PyTorch loop: same MNIST model, batch, optimizer and data, in one run,
with 1 and 2 workers (one thread each).

    python -m benchmarks.horovod_vs_ddp [--epochs 4] [--model mlp] [--batch 128]

The pipeline numbers are what `python -m pipelines.train trainer=ddp|horovod` logs to MLflow (`samples_per_s`,
global over workers, mean of epochs 2..N: epoch 1 includes pulling the shard through Ray Data). The bare loop
is single-process (benchmarks/ddp_vs_bare.py). Last line: `ratio=<horovod/ddp, 2 workers>`.
"""
from __future__ import annotations

import sys

from benchmarks.common import ensure_mnist, mnist_parser, steady_rate
from benchmarks.ddp_vs_bare import bare_pytorch, ray_pipeline


def pipeline_rate(backend: str, overrides: list[str], epochs: int, workers: int) -> float:
    return steady_rate(ray_pipeline([f"trainer={backend}", *overrides], epochs, workers)["samples_per_s"])


def main() -> int:
    args = mnist_parser(__doc__).parse_args()
    ensure_mnist()
    # The same optimizer (Adam), lr, batch per worker and model on every side; the yaml defaults of ddp and
    # horovod agree on these, and they are pinned here so a yaml change cannot skew the comparison.
    overrides = [f"model={args.model}", f"trainer.batch_size={args.batch}", "trainer.threads_per_worker=1",
                 "trainer.optimizer=adam", "trainer.lr=0.001"]

    bare = steady_rate(bare_pytorch(overrides, args.epochs))
    rates = {(backend, workers): pipeline_rate(backend, overrides, args.epochs, workers)
             for workers in (1, 2) for backend in ("ddp", "horovod")}
    print(f"model={args.model} batch={args.batch} per worker, epochs={args.epochs} (mean of epochs 2..{args.epochs})")
    print(f"bare PyTorch, 1 process:   {bare:9.0f} samples/s")
    for workers in (1, 2):
        ddp, hvd = rates[("ddp", workers)], rates[("horovod", workers)]
        print(f"{workers} worker(s): DDP {ddp:9.0f}  Horovod {hvd:9.0f} samples/s (global)   "
              f"horovod/ddp {hvd / ddp:.3f}   horovod/bare {hvd / bare:.3f}   ddp/bare {ddp / bare:.3f}")
    print(f"ratio={rates[('horovod', 2)] / rates[('ddp', 2)]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
