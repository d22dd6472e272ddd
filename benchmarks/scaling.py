"""Scaling from 1 to 2 workers: every data-parallel backend next to its bare framework, in one run, on a
compute-bound model (the MNIST CNN by default).

    python -m benchmarks.scaling [--model cnn] [--epochs 3] [--steps 60] [--batch 128] [--only ddp,bare_torch]
                                 [--pin] [--repeats 1] [--set trainer.compile=true ...]

Each row trains `--steps` steps of `--batch` samples per worker per epoch, one thread per worker. Throughput is
global samples/s, the mean of epochs 2..N (median over `--repeats` runs); efficiency = T(2 workers) / (2 x T(1
worker)). The bare frameworks are plain processes on this machine: torch.distributed (gloo, DDP) and tf-keras `fit`
under MultiWorkerMirroredStrategy (1 process: TF's default strategy, as our backend does). TP, FSDP and pipelines
are not here: they do not apply to the CNN (benchmarks/layouts.py compares them on BERT).
Last line: `min_efficiency=<lowest efficiency among ddp, horovod_torch and tf_mwms_fit>`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from benchmarks.common import (MNIST, QUIET_ENV, ROOT, ensure_mnist, free_ports, mnist_arrays, pipeline_run,
                               steady_rate)

PIPELINES = {  # row name -> pipelines.train overrides
    "ddp": ["trainer=ddp"],
    "horovod_torch": ["trainer=horovod", "trainer.framework=torch"],
    "horovod_tf": ["trainer=horovod", "trainer.framework=tf"],
    "tf_mwms_fit": ["trainer=tf_mwms", "trainer.tf_loop=fit"],
    "tf_mwms_custom": ["trainer=tf_mwms", "trainer.tf_loop=custom"],
}
BARE = ("bare_torch", "bare_tf")
COUNTERPART = {"ddp": "bare_torch", "horovod_torch": "bare_torch", "horovod_tf": "bare_tf",
               "tf_mwms_fit": "bare_tf", "tf_mwms_custom": "bare_tf"}
GATED = ("ddp", "horovod_torch", "tf_mwms_fit")


def bare_torch_worker(args: argparse.Namespace) -> list[float]:
    """One rank of a plain torch.distributed DDP loop on its shard; returns global samples/s per epoch."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from contract.data import MNIST_MEAN, MNIST_STD
    from pipelines.config import load_config
    from trainers.models import build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world)
    cfg = load_config([f"data.path={MNIST}", f"model={args.model}"])
    torch.manual_seed(0)
    images, labels = (torch.from_numpy(a[args.rank::args.world].copy()) for a in mnist_arrays("train"))
    model = build_model(cfg.model).to(memory_format=torch.channels_last)  # as trainer=ddp trains it
    model = DistributedDataParallel(model) if args.world > 1 else model
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.trainer.lr)
    loss_fn, rates = nn.CrossEntropyLoss(), []
    for epoch in range(args.epochs):
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(epoch))
        dist.barrier()
        start = time.perf_counter()
        for step in range(args.steps):
            idx = order[step * args.batch:(step + 1) * args.batch]
            x = ((images[idx].float() / 255.0 - MNIST_MEAN) / MNIST_STD).reshape(-1, 1, 28, 28)
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(x), labels[idx]).backward()
            optimizer.step()
        dist.barrier()
        rates.append(args.world * args.steps * args.batch / (time.perf_counter() - start))
    dist.destroy_process_group()
    return rates


def bare_tf_worker(args: argparse.Namespace) -> list[float]:
    """One worker of plain tf-keras `fit` under MultiWorkerMirroredStrategy (TF_CONFIG set by the parent)."""
    import tensorflow as tf
    import tf_keras as keras

    from contract.data import MNIST_MEAN, MNIST_STD
    from pipelines.config import load_config
    from trainers.models.keras_models import build_keras_model

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    strategy = (tf.distribute.MultiWorkerMirroredStrategy() if args.world > 1 else tf.distribute.get_strategy())
    cfg = load_config([f"data.path={MNIST}", f"model={args.model}"])
    images, labels = (a[args.rank::args.world].copy() for a in mnist_arrays("train"))

    def dataset(_context):
        return (tf.data.Dataset.from_tensor_slices((images, labels)).shuffle(len(labels), seed=0).repeat()
                .batch(args.batch).map(lambda x, y: ((tf.cast(x, tf.float32) / 255.0 - MNIST_MEAN) / MNIST_STD, y))
                .prefetch(2))

    with strategy.scope():
        net = build_keras_model(cfg.model, keras)
        net.compile(optimizer=keras.optimizers.Adam(cfg.trainer.lr),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), steps_per_execution=8)
    rates: list[float] = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            rates.append(args.world * args.steps * args.batch / (time.perf_counter() - self.start))

    data = strategy.distribute_datasets_from_function(dataset) if args.world > 1 else dataset(None)
    net.fit(data, epochs=args.epochs, steps_per_epoch=args.steps, callbacks=[Timer()], verbose=0)
    return rates


def bare_run(framework: str, args: argparse.Namespace, world: int) -> list[float]:
    """Start `world` plain processes of the bare `framework` loop; rank 0's per-epoch global samples/s."""
    ports = free_ports(world)
    procs = []
    for rank in range(world):
        env = {**os.environ, **QUIET_ENV, "TF_USE_LEGACY_KERAS": "1"}
        if framework == "tf" and world > 1:
            env["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                           "task": {"type": "worker", "index": rank}})
        cmd = [sys.executable, "-m", "benchmarks.scaling", "--bare-worker", framework, "--rank", str(rank),
               "--world", str(world), "--port", str(ports[0]), f"--model={args.model}", f"--epochs={args.epochs}",
               f"--steps={args.steps}", f"--batch={args.batch}", *(["--pin"] if args.pin else [])]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outputs = [p.communicate() for p in procs]
    for p, (out, err) in zip(procs, outputs):
        if p.returncode != 0:
            raise RuntimeError(f"bare {framework} worker failed:\n{out[-2000:]}\n{err[-3000:]}")
    return json.loads(outputs[0][0].strip().splitlines()[-1])


def pipeline_rates(overrides: list[str], args: argparse.Namespace, world: int) -> list[float]:
    history, _ = pipeline_run([*overrides, f"model={args.model}", f"data.path={MNIST}", f"trainer.epochs={args.epochs}",
                               f"trainer.num_workers={world}", f"trainer.batch_size={args.batch}",
                               f"trainer.max_steps_per_epoch={args.steps}", "trainer.threads_per_worker=1",
                               *args.set])
    return history["samples_per_s"]


def measure(name: str, args: argparse.Namespace, world: int) -> tuple[float, float]:
    """(steady global samples/s, median over `--repeats` runs; the machine's 1-minute load average at the end) of
    one row at one world size."""
    rates = []
    for _ in range(args.repeats):
        if name in BARE:
            rates.append(steady_rate(bare_run(name.removeprefix("bare_"), args, world)))
        else:
            rates.append(steady_rate(pipeline_rates(PIPELINES[name], args, world)))
    return float(np.median(rates)), os.getloadavg()[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="steps per worker per epoch")
    parser.add_argument("--batch", type=int, default=128, help="per worker")
    parser.add_argument("--only", default=",".join([*BARE, *PIPELINES]), help="comma-separated rows")
    parser.add_argument("--pin", action="store_true", help="bare rows only: pin rank r's process to CPU r, so one "
                        "worker has exactly one core (TF otherwise runs its input pipeline on a second one)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per row and world size (median)")
    parser.add_argument("--set", nargs="*", default=[], help="more overrides for every pipeline row")
    parser.add_argument("--bare-worker", choices=["torch", "tf"], help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_worker:  # a child process of bare_run
        if args.pin:
            os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[args.rank]})
        rates = (bare_torch_worker if args.bare_worker == "torch" else bare_tf_worker)(args)
        print(json.dumps(rates))
        return 0
    ensure_mnist()
    rows = args.only.split(",")
    print(f"model={args.model} batch={args.batch}/worker steps={args.steps}/worker/epoch epochs={args.epochs} "
          f"(mean of epochs 2..{args.epochs}); pipeline overrides {args.set}; load at start {os.getloadavg()[0]:.1f}",
          flush=True)
    print(f"{'row':16s} {'1 worker':>10s} {'2 workers':>10s} {'efficiency':>10s} {'vs bare (1/2)':>14s} "
          f"{'load (1/2)':>11s}", flush=True)
    results: dict[str, tuple[float, float]] = {}
    for name in rows:
        (one, load1), (two, load2) = measure(name, args, 1), measure(name, args, 2)
        results[name] = (one, two)
        bare = results.get(COUNTERPART.get(name, ""))
        versus = f"{one / bare[0]:.2f}/{two / bare[1]:.2f}" if bare else "-"
        print(f"{name:16s} {one:10.0f} {two:10.0f} {two / (2 * one):10.3f} {versus:>14s} "
              f"{load1:5.1f}/{load2:<5.1f}", flush=True)
    gated = [two / (2 * one) for name, (one, two) in results.items() if name in GATED]
    print(f"min_efficiency={min(gated):.3f}" if gated else "min_efficiency=nan (no gated row ran)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
