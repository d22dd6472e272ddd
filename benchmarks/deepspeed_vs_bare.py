"""trainer=deepspeed (DeepSpeed's engine in 2 Ray Train workers, this project's data, loop and MLflow) against bare
DeepSpeed on the same machine: a plain script under DeepSpeed's own launcher (`deepspeed --num_accelerators 2`, the
CPU accelerator over gloo), the same model, torch Adam, ZeRO stage, batch per process and MNIST rows in memory (each
process a half of every epoch's shuffle), in one run.

    python -m benchmarks.deepspeed_vs_bare [--epochs 4] [--model mlp] [--batch 128] [--zero-stage 2] [--repeats 1]
    python -m benchmarks.deepspeed_vs_bare --same-processes [--epochs 6] [--zero-stage 2]

Throughput: global samples/s, the mean of epochs 2..N (epoch 1 of both pays one-time costs). `--repeats N` runs N
rounds of bare then ours, in turn. Last line: `ratio=<ours/bare>`, the median of the rounds' ratios.

`--same-processes`: no Ray and no launcher. Two gloo processes train, epoch by epoch in turn, the bare loop,
`trainer=deepspeed`'s adapter (`DeepSpeedAdapter.train_step` on this project's shard batches) and the bare loop
with the recipe's two parameter groups (decayed matrices, undecayed biases), each on an engine of its own: what
the adapter costs by itself, apart from the machine's drift between runs. Medians of epochs 2..N.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np

from benchmarks.common import (MNIST, QUIET_ENV, ROOT, alternated, ensure_mnist, free_ports, mnist_arrays,
                               mnist_parser, pipeline_run)

PROCESSES = 2
MARK = "bare-deepspeed-rates:"


def bare_deepspeed(model_name: str, batch: int, epochs: int, stage: int) -> None:
    """Runs in each of the launcher's processes: prints rank 0's global samples/s per epoch as JSON."""
    import deepspeed
    import torch

    from pipelines.config import load_config

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = load_config([f"data.path={MNIST}", f"model={model_name}"])
    images, labels = (torch.from_numpy(a) for a in mnist_arrays("train"))
    engine = bare_engine(deepspeed, cfg, batch, stage, lambda model: torch.optim.Adam(model.parameters(), lr=1e-3))
    rates = []
    for epoch in range(epochs):
        start = time.perf_counter()
        bare_epoch(engine, images, labels, batch, epoch)
        rates.append(len(labels) / (time.perf_counter() - start))
    if torch.distributed.get_rank() == 0:
        print(f"{MARK} {json.dumps(rates)}")


def bare_engine(deepspeed: Any, cfg: Any, batch: int, stage: int, optimizer: Callable[[Any], Any]) -> Any:
    """DeepSpeed's engine over a fresh model of `cfg.model` (seed 0) and `optimizer(model)`, as a plain script
    would set it up, on the process group already initialised."""
    import torch

    from pipelines.data.mnist import mnist_schema
    from trainers.models import build_model

    torch.manual_seed(0)
    model = build_model(cfg.model, mnist_schema())
    config = {"train_micro_batch_size_per_gpu": batch, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "steps_per_print": 2**31 - 1}
    return deepspeed.initialize(model=model, optimizer=optimizer(model), config=config, dist_init_required=False)[0]


def bare_epoch(engine: Any, images: Any, labels: Any, batch: int, epoch: int) -> None:
    """One epoch of the plain script's loop: this rank's half of the epoch's shuffle, scaled in the loop."""
    import torch
    from torch import nn

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(epoch))[rank::world]
    for i in range(0, len(order), batch):
        idx = order[i:i + batch]
        x = (images[idx].float() / 255.0 - 0.1307) / 0.3081
        engine.backward(nn.functional.cross_entropy(engine(x), labels[idx]))
        engine.step()


def same_processes(rank: int, port: int, args: argparse.Namespace) -> None:
    """One of the `--same-processes` ranks (torch.multiprocessing): the three loops in turn, each epoch timed
    between barriers; rank 0 prints each loop's median samples/s and its ratio to the bare loop's."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(PROCESSES), LOCAL_WORLD_SIZE=str(PROCESSES))
    import torch

    from pipelines.data.mnist import mnist_schema
    from pipelines.config import load_config
    from trainers.adapter import WorkerData
    from trainers.context import WorkerContext
    from trainers.torch import deepspeed as ours
    from trainers.torch.data import ShardBatches
    from trainers.torch.recipe import make_optimizer

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    deepspeed = ours.import_deepspeed(use_gpu=False)
    cfg = load_config([f"data.path={MNIST}", "trainer=deepspeed", f"model={args.model}", f"trainer.batch_size="
                       f"{args.batch}", f"trainer.zero_stage={args.zero_stage}", f"trainer.num_workers={PROCESSES}"])
    images, labels = (torch.from_numpy(a) for a in mnist_arrays("train"))
    half = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))[rank::PROCESSES]
    shard = {"image": images[half], "label": labels[half]}
    data = WorkerData(mnist_schema(), lambda seed: (ShardBatches.from_columns(shard, mnist_schema(), args.batch, seed),
                                                    ShardBatches.from_columns(shard, mnist_schema(), args.batch, seed)))
    with ours.unprinted(verbose=False):
        adapter = ours.build_adapter(cfg, WorkerContext(rank, PROCESSES, lambda *_: None, args.epochs), data)
        bare = bare_engine(deepspeed, cfg, args.batch, args.zero_stage,
                           lambda model: torch.optim.Adam(model.parameters(), lr=cfg.trainer.lr))
        grouped = bare_engine(deepspeed, cfg, args.batch, args.zero_stage,
                              lambda model: make_optimizer(model, cfg.trainer))
    loops = {"bare loop": lambda epoch: bare_epoch(bare, images, labels, args.batch, epoch),
             "trainer=deepspeed's adapter": lambda epoch: [adapter.train_step(b) for b in adapter.batches(epoch, 0)],
             "bare loop, the recipe's two groups": lambda epoch: bare_epoch(grouped, images, labels, args.batch, epoch)}
    rates: dict[str, list[float]] = {name: [] for name in loops}
    for epoch in range(1, args.epochs + 1):
        for name, loop in loops.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            loop(epoch)
            torch.distributed.barrier()
            rates[name].append(len(labels) / (time.perf_counter() - start))
    if rank == 0:
        base = float(np.median(rates["bare loop"][1:]))
        print(f"model={args.model} batch={args.batch} per process, {PROCESSES} gloo processes, ZeRO-{args.zero_stage},"
              f" epochs alternated, median of epochs 2..{args.epochs}")
        for name, values in rates.items():
            median = float(np.median(values[1:]))
            print(f"{name:36s} {median:9.0f} samples/s  ratio={median / base:.3f}")


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
    parser.add_argument("--repeats", type=int, default=1, help="rounds of bare then ours (median of their ratios)")
    parser.add_argument("--same-processes", action="store_true",
                        help="the bare loop and our adapter in turn in the same 2 processes (no Ray, no launcher)")
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)  # one of bare DeepSpeed's processes
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # what DeepSpeed's launcher passes
    args = parser.parse_args()
    if args.bare:
        bare_deepspeed(args.model, args.batch, args.epochs, args.zero_stage)
        return 0
    ensure_mnist()
    if args.same_processes:
        os.environ.update({**QUIET_ENV, "DS_ACCELERATOR": "cpu"})
        import torch.multiprocessing

        torch.multiprocessing.spawn(same_processes, args=(free_ports(1)[0], args), nprocs=PROCESSES)
        return 0
    overrides = [f"data.path={MNIST}", "trainer=deepspeed", f"trainer.zero_stage={args.zero_stage}",
                 f"model={args.model}", f"trainer.batch_size={args.batch}", f"trainer.epochs={args.epochs}",
                 f"trainer.num_workers={PROCESSES}", "trainer.threads_per_worker=1"]
    print(f"model={args.model} batch={args.batch} per process, {PROCESSES} processes, ZeRO-{args.zero_stage}, "
          f"epochs={args.epochs} (mean of epochs 2..{args.epochs}): bare DeepSpeed under its launcher, then "
          f"trainer=deepspeed in {PROCESSES} Ray Train workers, {args.repeats} round(s)", flush=True)
    ratio = alternated(args.repeats, lambda: bare_rates(args.model, args.batch, args.epochs, args.zero_stage),
                       lambda: pipeline_run(overrides)[0]["samples_per_s"])
    print(f"ratio={ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
