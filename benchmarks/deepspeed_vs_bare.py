"""trainer=deepspeed (DeepSpeed's engine in 2 Ray Train workers, this project's data, loop and MLflow) against bare
DeepSpeed on the same machine: a plain script under DeepSpeed's own launcher (`deepspeed --num_accelerators 2`, the
CPU accelerator over gloo), the same model, torch Adam, ZeRO stage, batch per process and MNIST rows in memory (each
process a half of every epoch's shuffle), in one run.

    python -m benchmarks.deepspeed_vs_bare [--epochs 4] [--model mlp] [--batch 128] [--zero-stage 2]

Throughput: global samples/s, the mean of epochs 2..N (epoch 1 of both pays one-time costs). Last line:
`ratio=<ours/bare>`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from benchmarks.common import MNIST, QUIET_ENV, ROOT, ensure_mnist, mnist_parser, pipeline_run, steady_rate

PROCESSES = 2
MARK = "bare-deepspeed-rates:"


def bare_deepspeed(model_name: str, batch: int, epochs: int, stage: int) -> None:
    """Runs in each of the launcher's processes: prints rank 0's global samples/s per epoch as JSON."""
    import deepspeed
    import torch
    from torch import nn

    from benchmarks.common import mnist_arrays
    from contract.data import mnist_schema
    from pipelines.config import load_config
    from trainers.models import build_model

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg = load_config([f"data.path={MNIST}", f"model={model_name}"])
    images, labels = (torch.from_numpy(a) for a in mnist_arrays("train"))
    torch.manual_seed(0)
    model = build_model(cfg.model, mnist_schema())
    config = {"train_micro_batch_size_per_gpu": batch, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "steps_per_print": 2**31 - 1}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
                                           config=config)
    rates = []
    for epoch in range(epochs):
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(epoch))[rank::world]
        start = time.perf_counter()
        for i in range(0, len(order), batch):
            idx = order[i:i + batch]
            x = (images[idx].float() / 255.0 - 0.1307) / 0.3081
            engine.backward(nn.functional.cross_entropy(engine(x), labels[idx]))
            engine.step()
        rates.append(len(labels) / (time.perf_counter() - start))
    if rank == 0:
        print(f"{MARK} {json.dumps(rates)}")


def bare_rates(model: str, batch: int, epochs: int, stage: int) -> list[float]:
    """Bare DeepSpeed's per-epoch global samples/s, from its launcher's 2 processes running this file."""
    env = {**os.environ, **QUIET_ENV, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    proc = subprocess.run([launcher, "--num_accelerators", str(PROCESSES), __file__, "--bare", "--model", model,
                           "--batch", str(batch), "--epochs", str(epochs), "--zero-stage", str(stage)],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bare DeepSpeed failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    line = next(line for line in proc.stdout.splitlines() if MARK in line)  # among the launcher's own lines
    return json.loads(line.split(MARK, 1)[1])


def main() -> int:
    parser = mnist_parser(__doc__)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)  # one of bare DeepSpeed's processes
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # what DeepSpeed's launcher passes
    args = parser.parse_args()
    if args.bare:
        bare_deepspeed(args.model, args.batch, args.epochs, args.zero_stage)
        return 0
    ensure_mnist()
    bare = bare_rates(args.model, args.batch, args.epochs, args.zero_stage)
    ours, _ = pipeline_run([f"data.path={MNIST}", "trainer=deepspeed", f"trainer.zero_stage={args.zero_stage}",
                            f"model={args.model}", f"trainer.batch_size={args.batch}", f"trainer.epochs={args.epochs}",
                            f"trainer.num_workers={PROCESSES}", "trainer.threads_per_worker=1"])
    bare_rate, our_rate = steady_rate(bare), steady_rate(ours["samples_per_s"])
    print(f"model={args.model} batch={args.batch} per process, {PROCESSES} processes, ZeRO-{args.zero_stage}, "
          f"epochs={args.epochs} (mean of epochs 2..{args.epochs})")
    print(f"bare DeepSpeed, its launcher with {PROCESSES} processes: {bare_rate:9.0f} samples/s")
    print(f"trainer=deepspeed, {PROCESSES} Ray Train workers:          {our_rate:9.0f} samples/s  "
          f"(data load {ours['data_load_s'][0]:.1f} s, test accuracy {ours['test_accuracy'][-1]:.4f})")
    print(f"per epoch: bare {np.round(bare).astype(int).tolist()}, "
          f"ours {np.round(ours['samples_per_s']).astype(int).tolist()}")
    print(f"ratio={our_rate / bare_rate:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
