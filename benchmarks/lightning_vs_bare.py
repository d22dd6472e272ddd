"""trainer=lightning (Lightning's Trainer in 2 Ray Train workers, this project's data, loop callback and MLflow)
against bare Lightning on the same machine: its own `Trainer(strategy="ddp", devices=2)` launching 2 CPU processes,
the same model, optimizer, batch per process and MNIST rows in memory (a `DataLoader` Lightning shards with its
`DistributedSampler`), in one run.

    python -m benchmarks.lightning_vs_bare [--epochs 4] [--model mlp] [--batch 128] [--repeats 1]

Throughput: global samples/s, the mean of epochs 2..N (epoch 1 of both pays one-time costs). `--repeats N` runs N
rounds of bare then ours, in turn. Last line: `ratio=<ours/bare>`, the median of the rounds' ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.common import MNIST, QUIET_ENV, ROOT, alternated, ensure_mnist, mnist_parser, pipeline_run

PROCESSES = 2


def bare_lightning(model_name: str, batch: int, epochs: int) -> None:
    """Runs in each of Lightning's processes (it starts the second one itself): prints rank 0's samples/s per
    epoch as JSON."""
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.common import mnist_arrays
    from pipelines.data.mnist import mnist_schema
    from pipelines.config import load_config
    from trainers.models import build_model

    torch.set_num_threads(1)
    cfg = load_config([f"data.path={MNIST}", f"model={model_name}"])
    images, labels = (torch.from_numpy(a) for a in mnist_arrays("train"))

    class Bare(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = build_model(cfg.model, mnist_schema())

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.model((x.float() / 255.0 - 0.1307) / 0.3081), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=cfg.trainer.lr)

    class Rate(pl.Callback):
        def __init__(self):
            self.rates = []

        def on_train_epoch_start(self, trainer, module):
            self.start = time.perf_counter()

        def on_train_epoch_end(self, trainer, module):
            self.rates.append(len(labels) / (time.perf_counter() - self.start))

    rate = Rate()
    trainer = pl.Trainer(accelerator="cpu", devices=PROCESSES, strategy="ddp", max_epochs=epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[rate])
    loader = DataLoader(TensorDataset(images, labels), batch_size=batch, shuffle=True)
    trainer.fit(Bare(), train_dataloaders=loader)
    if trainer.global_rank == 0:
        print(json.dumps(rate.rates))


def bare_rates(model: str, batch: int, epochs: int) -> list[float]:
    """Bare Lightning's per-epoch global samples/s, from a process of its own (its launcher re-runs this file)."""
    env = {**os.environ, **QUIET_ENV, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, __file__, "--bare", "--model", model, "--batch", str(batch),
                           "--epochs", str(epochs)], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = mnist_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of bare then ours (median of their ratios)")
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)  # one of bare Lightning's processes
    args = parser.parse_args()
    if args.bare:
        bare_lightning(args.model, args.batch, args.epochs)
        return 0
    ensure_mnist()
    overrides = [f"data.path={MNIST}", "trainer=lightning", f"model={args.model}", f"trainer.batch_size={args.batch}",
                 f"trainer.epochs={args.epochs}", f"trainer.num_workers={PROCESSES}", "trainer.threads_per_worker=1"]
    print(f"model={args.model} batch={args.batch} per process, {PROCESSES} processes, epochs={args.epochs} (mean of "
          f"epochs 2..{args.epochs}): bare Lightning's Trainer(strategy='ddp', devices={PROCESSES}), then "
          f"trainer=lightning in {PROCESSES} Ray Train workers, {args.repeats} round(s)", flush=True)
    ratio = alternated(args.repeats, lambda: bare_rates(args.model, args.batch, args.epochs),
                       lambda: pipeline_run(overrides)[0]["samples_per_s"])
    print(f"ratio={ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
