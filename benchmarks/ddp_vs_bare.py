"""Our pipeline (Ray TorchTrainer, 1 worker, 1 thread) against a bare PyTorch loop on the same model, batch
and data, in one run. Also the data-wait fraction of step time with 2 workers.

    python -m benchmarks.ddp_vs_bare [--epochs 4] [--model mlp]

Throughput is the mean of epochs 2..N (epoch 1 of the pipeline includes pulling the shard through Ray
Data, reported separately as data_load_s). Last line: `ratio=<ray/bare>`.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

from pipelines.config import load_config
from pipelines.data.shards import read_manifest, shard_paths
from trainers.models import build_model

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "mnist" / "parquet"


def load_split(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    table = pa.concat_tables(pq.read_table(p) for p in shard_paths(DATA, read_manifest(DATA), split))
    images = table.column("image").combine_chunks().flatten().to_numpy().reshape(-1, 784)
    return torch.from_numpy(images.copy()), torch.from_numpy(table.column("label").to_numpy()).long()


def bare_pytorch(overrides: list[str], epochs: int) -> list[float]:
    """Plain single-process loop: tensors in memory, shuffled batches, Adam. Returns samples/s per epoch."""
    cfg = load_config([f"data.path={DATA}", *overrides])
    torch.set_num_threads(1)
    torch.manual_seed(cfg.run.seed)
    images, labels = load_split("train")
    model = build_model(cfg.model)
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
    """Run `python -m pipelines.train` (local Ray) and read its per-epoch metrics back from MLflow."""
    from mlflow.tracking import MlflowClient

    with tempfile.TemporaryDirectory() as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": "1",
               "RAY_TRAIN_ENABLE_PROGRESS_BAR": "0", "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}
        env.pop("RAY_ADDRESS", None)
        cmd = [sys.executable, "-m", "pipelines.train", f"data.path={DATA}", f"trainer.epochs={epochs}",
               f"trainer.num_workers={workers}", f"run.storage_path={tmp}/ray", *overrides]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"pipeline failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        run_id = proc.stdout.strip().splitlines()[-1].split("=", 1)[1]
        client = MlflowClient(uri)
        names = ("samples_per_s", "data_wait_fraction", "data_load_s", "test_accuracy")
        return {n: [m.value for m in sorted(client.get_metric_history(run_id, n), key=lambda m: m.step)]
                for n in names}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    if not (DATA / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "pipelines.prepare", "mnist", "--out", str(DATA)], check=True)
    overrides = [f"model={args.model}", f"trainer.batch_size={args.batch}", "trainer.threads_per_worker=1"]

    bare = bare_pytorch(overrides, args.epochs)
    one = ray_pipeline(overrides, args.epochs, workers=1)
    two = ray_pipeline(overrides, args.epochs, workers=2)
    bare_rate = float(np.mean(bare[1:]))
    ray_rate = float(np.mean(one["samples_per_s"][1:]))
    print(f"model={args.model} batch={args.batch} epochs={args.epochs} (mean of epochs 2..{args.epochs})")
    print(f"bare PyTorch, 1 thread:         {bare_rate:9.0f} samples/s")
    print(f"Ray TorchTrainer, 1 worker:     {ray_rate:9.0f} samples/s  (data load {one['data_load_s'][0]:.1f} s)")
    print(f"Ray TorchTrainer, 2 workers:    {np.mean(two['samples_per_s'][1:]):9.0f} samples/s global  "
          f"(data load {two['data_load_s'][0]:.1f} s)")
    print(f"data wait / step time, 2 workers: {100 * np.mean(two['data_wait_fraction'][1:]):.2f}% "
          f"(epoch 1: {100 * two['data_wait_fraction'][0]:.2f}%)")
    print(f"test accuracy after {args.epochs} epochs, 2 workers: {two['test_accuracy'][-1]:.4f}")
    print(f"ratio={ray_rate / bare_rate:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
