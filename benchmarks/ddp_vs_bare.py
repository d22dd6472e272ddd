"""Our pipeline (Ray Train, 1 worker, 1 thread) against a bare PyTorch loop on the same model, batch
and data, in one run. Also the data-wait fraction of step time with 2 workers.

    python -m benchmarks.ddp_vs_bare [--epochs 4] [--model mlp]

Throughput is the mean of epochs 2..N (epoch 1 of the pipeline includes pulling the shard through Ray
Data, reported separately as data_load_s). Last line: `ratio=<ray/bare>`.
"""
from __future__ import annotations

import sys
import time

import numpy as np
import torch
from torch import nn

from pipelines.data.mnist import mnist_schema
from benchmarks.common import MNIST, ensure_mnist, mnist_arrays, mnist_parser, pipeline_run, steady_rate
from pipelines.config import load_config
from trainers.models import build_model


def bare_pytorch(overrides: list[str], epochs: int) -> list[float]:
    """Plain single-process loop: tensors in memory, shuffled batches, Adam. Returns samples/s per epoch."""
    cfg = load_config([f"data.path={MNIST}", *overrides])
    torch.set_num_threads(1)
    torch.manual_seed(cfg.run.seed)
    images, labels = (torch.from_numpy(a) for a in mnist_arrays("train"))
    model = build_model(cfg.model, mnist_schema())
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.trainer.lr)
    loss_fn, batch = nn.CrossEntropyLoss(), cfg.trainer.batch_size
    rates = []
    for epoch in range(epochs):
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(epoch))
        start = time.perf_counter()
        model.train()
        for i in range(0, len(labels), batch):
            idx = order[i:i + batch]
            x = (images[idx].float() / 255.0 - 0.1307) / 0.3081
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(x), labels[idx]).backward()
            optimizer.step()
        rates.append(len(labels) / (time.perf_counter() - start))
    return rates


def ray_pipeline(overrides: list[str], epochs: int, workers: int) -> dict[str, list[float]]:
    """Per-epoch metrics of `python -m pipelines.train` (local Ray) on the same data."""
    history, _ = pipeline_run([f"data.path={MNIST}", f"trainer.epochs={epochs}", f"trainer.num_workers={workers}",
                               *overrides])
    return history


def main() -> int:
    args = mnist_parser(__doc__).parse_args()
    ensure_mnist()
    overrides = [f"model={args.model}", f"trainer.batch_size={args.batch}", "trainer.threads_per_worker=1"]

    bare = bare_pytorch(overrides, args.epochs)
    one = ray_pipeline(overrides, args.epochs, workers=1)
    two = ray_pipeline(overrides, args.epochs, workers=2)
    bare_rate, ray_rate = steady_rate(bare), steady_rate(one["samples_per_s"])
    print(f"model={args.model} batch={args.batch} epochs={args.epochs} (mean of epochs 2..{args.epochs})")
    print(f"bare PyTorch, 1 thread:         {bare_rate:9.0f} samples/s")
    print(f"Ray Train, 1 worker:            {ray_rate:9.0f} samples/s  (data load {one['data_load_s'][0]:.1f} s)")
    print(f"Ray Train, 2 workers:           {np.mean(two['samples_per_s'][1:]):9.0f} samples/s global  "
          f"(data load {two['data_load_s'][0]:.1f} s)")
    print(f"data wait / step time, 2 workers: {100 * np.mean(two['data_wait_fraction'][1:]):.2f}% "
          f"(epoch 1: {100 * two['data_wait_fraction'][0]:.2f}%)")
    print(f"test accuracy after {args.epochs} epochs, 2 workers: {two['test_accuracy'][-1]:.4f}")
    print(f"ratio={ray_rate / bare_rate:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
