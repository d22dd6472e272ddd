"""One GPU worker's training speed: the shared loop with the DDP adapter (what a `trainer=ddp trainer.use_gpu=true`
worker runs; here in-process on a one-rank NCCL group, as Ray Train makes for one GPU worker, without Ray) against
a bare PyTorch loop on the same model, data, batch and optimizer, eager and through `torch.compile`.

    python -m benchmarks.gpu_loop [--batches 128,512] [--forward eager,compiled] [--epochs 3] [--repeats 2]
                                  [--only bare,ours] [--threads 4]

Both loops prepare each batch on the CPU (index, normalise). The bare loop copies it to the GPU through pinned
memory without waiting, as a DataLoader with `pin_memory` does, and reads no loss back, so it never waits for the
GPU; ours copies it as the adapter does (`.to(device)`) and reads each step's loss. (In a pipeline's GPU worker
the cached shard arrives on the GPU already: Ray Data's `iter_torch_batches` puts it on the worker's device.)
Throughput: samples/s over epochs 2..N (the loop's `samples_per_s`; the bare loop times itself), median over
`--repeats`. Needs a CUDA GPU. Last line: `min_ratio=<lowest ours/bare>` when both ran.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from pipelines.data.mnist import MNIST_MEAN, MNIST_STD, mnist_schema
from benchmarks.common import MNIST, ensure_mnist, mnist_arrays, steady_rate
from pipelines.config import load_config
from trainers.adapter import WorkerData
from trainers.context import WorkerContext
from trainers.models import build_model
from trainers.torch.data import ShardBatches
from trainers.torch.ddp import DDP

CUDA = torch.device("cuda", 0)


def model_config(batch: int, epochs: int, compile_: bool, threads: int) -> DictConfig:
    """The validated pipeline config both loops train with (the CNN, one GPU worker)."""
    return load_config([f"data.path={MNIST}", "model=cnn", f"trainer.batch_size={batch}", f"trainer.epochs={epochs}",
                        "trainer.num_workers=1", "trainer.use_gpu=true", f"trainer.threads_per_worker={threads}",
                        f"trainer.compile={str(compile_).lower()}"])


def bare_rates(cfg: DictConfig, images: torch.Tensor, labels: torch.Tensor) -> list[float]:
    """A plain loop on GPU 0: samples/s per epoch."""
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, mnist_schema()).to(CUDA, memory_format=torch.channels_last)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.trainer.lr)
    forward = torch.compile(model) if cfg.trainer.compile else model
    loss_fn, batch, rates = nn.CrossEntropyLoss(), cfg.trainer.batch_size, []
    for epoch in range(cfg.trainer.epochs):
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(epoch))
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(0, len(labels), batch):
            idx = order[i:i + batch]
            x = ((images[idx].float() / 255.0 - MNIST_MEAN) / MNIST_STD).reshape(-1, 1, 28, 28)  # as the workers scale
            x, y = x.pin_memory().to(CUDA, non_blocking=True), labels[idx].pin_memory().to(CUDA, non_blocking=True)
            optimizer.zero_grad()
            loss_fn(forward(x), y).backward()
            optimizer.step()
        torch.cuda.synchronize()
        rates.append(len(labels) / (time.perf_counter() - start))
    return rates


def loop_rates(cfg: DictConfig, images: torch.Tensor, labels: torch.Tensor,
               test: dict[str, torch.Tensor]) -> list[float]:
    """The shared loop with the DDP adapter on GPU 0 (one worker: no DDP wrapper, as Ray's `prepare_model`
    leaves it); its `samples_per_s` per epoch. Evaluation and checkpoints run as in a pipeline, outside that."""
    data = lambda seed: (ShardBatches.from_columns({"image": images, "label": labels}, mnist_schema(),  # noqa: E731
                                                   cfg.trainer.batch_size, seed),
                         ShardBatches.from_columns(test, mnist_schema(), 1024, seed))
    reports: list[dict[str, float]] = []
    ctx = WorkerContext(rank=0, world_size=1, report=lambda metrics, _folder: reports.append(metrics),
                        epochs=cfg.trainer.epochs, device=CUDA)
    DDP().run_worker(cfg, ctx, WorkerData({}, data))
    return [r["samples_per_s"] for r in reports]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="128,512")
    parser.add_argument("--forward", default="eager,compiled", help="eager, compiled (torch.compile) or both")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", default="bare,ours")
    parser.add_argument("--threads", type=int, default=4, help="torch CPU threads (batch preparation)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    ensure_mnist()
    torch.set_num_threads(args.threads)
    images, labels = (torch.from_numpy(a) for a in mnist_arrays("train"))
    test_images, test_labels = (torch.from_numpy(a) for a in mnist_arrays("test"))
    test = {"image": test_images, "label": test_labels}
    torch.cuda.set_device(CUDA)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{Path(tmp) / 'rendezvous'}", rank=0, world_size=1,
                                device_id=CUDA)
        print(f"{torch.cuda.get_device_name(CUDA)}, torch {torch.__version__}, MNIST CNN, {args.epochs} epochs of "
              f"{len(labels)} samples (samples/s: mean of epochs 2..{args.epochs}, median of {args.repeats})")
        ratios = []
        for batch in (int(b) for b in args.batches.split(",")):
            for compile_ in (mode == "compiled" for mode in args.forward.split(",")):
                cfg = model_config(batch, args.epochs, compile_, args.threads)
                rates = {}
                for row in args.only.split(","):
                    runs = [steady_rate(bare_rates(cfg, images, labels) if row == "bare"
                                        else loop_rates(cfg, images, labels, test)) for _ in range(args.repeats)]
                    rates[row] = float(np.median(runs))
                    print(f"batch {batch:4d} compile={compile_!s:5s} {row:4s} {rates[row]:9.0f} samples/s "
                          f"(runs: {', '.join(f'{r:.0f}' for r in runs)})", flush=True)
                if len(rates) == 2:
                    ratios.append(rates["ours"] / rates["bare"])
                    print(f"batch {batch:4d} compile={compile_!s:5s} ours/bare {ratios[-1]:.3f}", flush=True)
        dist.destroy_process_group()
    if ratios:
        print(f"min_ratio={min(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
