"""Scaling from 1 to 2 workers: every data-parallel backend next to its bare framework, in one run, on a
compute-bound model (the MNIST CNN by default).

    python -m benchmarks.scaling [--model cnn] [--epochs 3] [--steps 60] [--batch 128] [--only ddp,bare_torch]
                                 [--pin] [--repeats 1] [--beside-ray] [--set trainer.compile=true ...]

Each row trains `--steps` steps of `--batch` samples per worker per epoch, one thread per worker. Throughput is
global samples/s, the mean of epochs 2..N (median over `--repeats` runs); efficiency = T(2 workers) / (2 x T(1
worker)). A row and its bare counterpart run in alternation (bare, ours, bare, ours, ...), so drifting machine
load hits both, and "vs bare" is the median of the paired ratios; a bare row serving two rows runs with each.
The bare frameworks are plain processes on this machine: torch.distributed (gloo, DDP), tf-keras `fit`
under MultiWorkerMirroredStrategy (1 process: TF's default strategy, as our backend does), and Horovod's own recipes
for PyTorch and TF2 started by `horovodrun --gloo`, each Horovod row's counterpart. TP, FSDP and pipelines
are not here: they do not apply to the CNN (benchmarks/layouts.py compares them on BERT). `--beside-ray`: each
bare run has an idle local Ray head (`ray start --head`) beside it, so that both sides of a ratio share the cores
with Ray's own processes and the ratio is what our code costs; the rows `bare_<x>_beside_ray` (`--only
bare_tf,bare_tf_beside_ray`) pair a bare row with itself beside the idle head: what Ray's processes alone cost.
Last line: `min_efficiency=<lowest efficiency among ddp, horovod_torch and tf_mwms_fit>`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from pipelines.data.mnist import mnist_schema
from benchmarks.common import (MNIST, QUIET_ENV, ROOT, ensure_mnist, free_ports, mnist_arrays, pipeline_run,
                               steady_rate)

PIPELINES = {  # row name -> pipelines.train overrides
    "ddp": ["trainer=ddp"],
    "horovod_torch": ["trainer=horovod", "trainer.framework=torch"],
    "horovod_tf": ["trainer=horovod", "trainer.framework=tf"],
    "tf_mwms_fit": ["trainer=tf_mwms", "trainer.tf_loop=fit"],
    "tf_mwms_custom": ["trainer=tf_mwms", "trainer.tf_loop=custom"],
}
BARE = ("bare_torch", "bare_tf", "bare_horovod_torch", "bare_horovod_tf")
BESIDE_RAY = {f"{name}_beside_ray": name for name in BARE}  # a bare row beside an idle Ray head: what Ray's own
                                                            # processes cost it (not in the default rows)
COUNTERPART = {"ddp": "bare_torch", "horovod_torch": "bare_horovod_torch", "horovod_tf": "bare_horovod_tf",
               "tf_mwms_fit": "bare_tf", "tf_mwms_custom": "bare_tf", **BESIDE_RAY}
GATED = ("ddp", "horovod_torch", "tf_mwms_fit")


def torch_epochs(model, optimizer, rank: int, world: int, barrier, args: argparse.Namespace) -> list[float]:
    """The bare PyTorch loop both bare torch rows run on rank `rank`'s shard; global samples/s per epoch."""
    import torch
    from torch import nn

    from pipelines.data.mnist import MNIST_MEAN, MNIST_STD

    images, labels = (torch.from_numpy(a[rank::world].copy()) for a in mnist_arrays("train"))
    loss_fn, rates = nn.CrossEntropyLoss(), []
    for epoch in range(args.epochs):
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(epoch))
        barrier()
        start = time.perf_counter()
        for step in range(args.steps):
            idx = order[step * args.batch:(step + 1) * args.batch]
            x = ((images[idx].float() / 255.0 - MNIST_MEAN) / MNIST_STD).reshape(-1, 1, 28, 28)
            optimizer.zero_grad()  # sets them to None (torch 2; Horovod takes no argument)
            loss_fn(model(x), labels[idx]).backward()
            optimizer.step()
        barrier()
        rates.append(world * args.steps * args.batch / (time.perf_counter() - start))
    return rates


def channels_last_model(model_name: str):
    """The model and Adam learning rate `trainer=ddp` and `trainer=horovod` train, in their channels-last layout."""
    import torch

    from pipelines.config import load_config
    from trainers.models import build_model

    torch.set_num_threads(1)
    cfg = load_config([f"data.path={MNIST}", f"model={model_name}"])
    torch.manual_seed(0)
    return build_model(cfg.model, mnist_schema()).to(memory_format=torch.channels_last), cfg.trainer.lr


def bare_torch_worker(args: argparse.Namespace) -> list[float]:
    """One rank of a plain torch.distributed DDP loop on its shard; returns global samples/s per epoch."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world)
    model, lr = channels_last_model(args.model)
    model = DistributedDataParallel(model) if args.world > 1 else model
    rates = torch_epochs(model, torch.optim.Adam(model.parameters(), lr=lr), args.rank, args.world, dist.barrier,
                         args)
    dist.destroy_process_group()
    return rates


def bare_horovod_torch_worker(args: argparse.Namespace) -> list[float]:
    """One rank of Horovod's documented PyTorch recipe (started by `horovodrun`): `DistributedOptimizer` and a
    broadcast of rank 0's weights. Horovod refuses non-contiguous tensors, so the channels-last gradients and
    weights go through contiguous copies, as `trainer=horovod` does (`ContiguousCompression`)."""
    import horovod.torch as hvd
    import torch

    from trainers.horovod.torch import ContiguousCompression, broadcast_from_rank0

    hvd.init()
    model, lr = channels_last_model(args.model)
    broadcast_from_rank0(hvd, model.state_dict())
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=lr),
                                         named_parameters=model.named_parameters(),
                                         compression=ContiguousCompression(hvd.Compression.none))
    return torch_epochs(model, optimizer, hvd.rank(), hvd.size(), hvd.barrier, args)


def tf_shard_batches(tf, rank: int, world: int, batch: int):
    """Both bare TF rows' input: rank `rank`'s shard of MNIST's train split, shuffled, repeated, normalised."""
    from pipelines.data.mnist import MNIST_MEAN, MNIST_STD

    images, labels = (a[rank::world].copy() for a in mnist_arrays("train"))
    return (tf.data.Dataset.from_tensor_slices((images, labels)).shuffle(len(labels), seed=0).repeat().batch(batch)
            .map(lambda x, y: ((tf.cast(x, tf.float32) / 255.0 - MNIST_MEAN) / MNIST_STD, y)).prefetch(2))


def bare_tf_worker(args: argparse.Namespace) -> list[float]:
    """One worker of plain tf-keras `fit` under MultiWorkerMirroredStrategy (TF_CONFIG set by the parent)."""
    import tensorflow as tf
    import tf_keras as keras

    from pipelines.config import load_config
    from trainers.models import build_keras_model

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    strategy = (tf.distribute.MultiWorkerMirroredStrategy() if args.world > 1 else tf.distribute.get_strategy())
    cfg = load_config([f"data.path={MNIST}", f"model={args.model}"])

    def dataset(_context):
        return tf_shard_batches(tf, args.rank, args.world, args.batch)

    with strategy.scope():
        net = build_keras_model(cfg.model, keras, mnist_schema())
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


def bare_horovod_tf_worker(args: argparse.Namespace) -> list[float]:
    """One rank of Horovod's documented TF2 recipe (started by `horovodrun`): a compiled step on
    `DistributedGradientTape`, rank 0's variables broadcast before the first step, a tf.data pipeline on the
    rank's shard (as the bare TF row's)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    import tf_keras as keras

    from pipelines.config import load_config
    from trainers.models import build_keras_model

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    cfg = load_config([f"data.path={MNIST}", f"model={args.model}"])
    data = iter(tf_shard_batches(tf, rank, world, args.batch))
    model = build_keras_model(cfg.model, keras, mnist_schema())
    optimizer, loss_fn = keras.optimizers.Adam(cfg.trainer.lr), keras.losses.SparseCategoricalCrossentropy(True)
    optimizer.build(model.trainable_variables)
    hvd.broadcast_variables(model.variables, root_rank=0)
    hvd.broadcast_variables(optimizer.variables, root_rank=0)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    rates = []
    for _ in range(args.epochs):
        hvd.join()
        start = time.perf_counter()
        for _ in range(args.steps):
            loss = step(*next(data))
        float(loss)  # the last step has run
        hvd.join()
        rates.append(world * args.steps * args.batch / (time.perf_counter() - start))
    return rates


BARE_WORKERS = {"torch": bare_torch_worker, "tf": bare_tf_worker, "horovod_torch": bare_horovod_torch_worker,
                "horovod_tf": bare_horovod_tf_worker}


def horovodrun_rates(framework: str, worker_args: list[str], env: dict[str, str], world: int) -> list[float]:
    """`world` ranks of the bare Horovod `framework` loop started by `horovodrun --gloo` on this machine; rank 0's
    per-epoch global samples/s (written to a file: horovodrun prefixes every line the ranks print)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rates.json"
        cmd = ["horovodrun", "-np", str(world), "-H", f"localhost:{world}", "--gloo", sys.executable, "-m",
               "benchmarks.scaling", *worker_args, f"--out={out}"]
        env = {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"}
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"bare {framework} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def bare_run(framework: str, args: argparse.Namespace, world: int) -> list[float]:
    """Run the bare `framework` loop in `world` plain processes (Horovod's: started by `horovodrun`, its own
    launcher); rank 0's per-epoch global samples/s."""
    env = {**os.environ, **QUIET_ENV, "TF_USE_LEGACY_KERAS": "1"}
    common = ["--bare-worker", framework, "--world", str(world), f"--model={args.model}", f"--epochs={args.epochs}",
              f"--steps={args.steps}", f"--batch={args.batch}", *(["--pin"] if args.pin else [])]
    if framework.startswith("horovod"):
        return horovodrun_rates(framework, common, env, world)
    ports = free_ports(world)
    procs = []
    for rank in range(world):
        if framework == "tf" and world > 1:
            env["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                           "task": {"type": "worker", "index": rank}})
        cmd = [sys.executable, "-m", "benchmarks.scaling", *common, "--rank", str(rank), "--port", str(ports[0])]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=dict(env), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
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


def run_once(name: str, args: argparse.Namespace, world: int) -> float:
    """One run of a row at one world size: its steady global samples/s."""
    if name in PIPELINES:
        return steady_rate(pipeline_rates(PIPELINES[name], args, world))
    with idle_ray() if args.beside_ray or name in BESIDE_RAY else contextlib.nullcontext():
        return steady_rate(bare_run(BESIDE_RAY.get(name, name).removeprefix("bare_"), args, world))


@contextlib.contextmanager
def idle_ray() -> Iterator[None]:
    """An idle local Ray head (`ray start --head --block`, its own ports) while the body runs; Ctrl-C to the
    blocking `ray start` stops the processes it started, and only those."""
    port, dashboard, client = free_ports(3)
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    head = subprocess.Popen([ray, "start", "--head", "--block", f"--port={port}", f"--dashboard-port={dashboard}",
                             f"--ray-client-server-port={client}", "--disable-usage-stats"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in head.stdout:  # up once it says it blocks
            if "will now block" in line:
                break
        yield
    finally:
        head.send_signal(signal.SIGINT)
        head.communicate(timeout=60)


def measure(group: list[str], args: argparse.Namespace, world: int) -> dict[str, list[float]]:
    """`--repeats` runs of each row of `group` (a row, or a bare row and ours) at one world size, alternating."""
    runs: dict[str, list[float]] = {name: [] for name in group}
    for _ in range(args.repeats):
        for name in group:
            runs[name].append(run_once(name, args, world))
    return runs


def groups(rows: list[str]) -> list[list[str]]:
    """The rows in the order asked, each of ours with its bare counterpart first when that was asked for too; a
    bare row alone only when no row of ours pairs with it."""
    paired = {COUNTERPART[name] for name in rows if COUNTERPART.get(name) in rows}
    return [[COUNTERPART[name], name] if COUNTERPART.get(name) in rows else [name]
            for name in rows if name not in paired]


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
    parser.add_argument("--beside-ray", action="store_true", help="bare rows run beside an idle local Ray head")
    parser.add_argument("--set", nargs="*", default=[], help="more overrides for every pipeline row")
    parser.add_argument("--bare-worker", choices=list(BARE_WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)  # where a horovodrun rank 0 writes its rates
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_worker:  # a child process of bare_run
        rank = int(os.environ.get("HOROVOD_RANK", args.rank))  # horovodrun starts every rank alike
        if args.pin:
            os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
        rates = BARE_WORKERS[args.bare_worker](args)
        if args.out and rank == 0:
            Path(args.out).write_text(json.dumps(rates))
        print(json.dumps(rates))
        return 0
    ensure_mnist()
    rows = args.only.split(",")
    print(f"model={args.model} batch={args.batch}/worker steps={args.steps}/worker/epoch epochs={args.epochs} "
          f"(mean of epochs 2..{args.epochs}); pipeline overrides {args.set}; load at start {os.getloadavg()[0]:.1f}"
          f"{'; bare rows beside an idle Ray head' if args.beside_ray else ''}",
          flush=True)
    print(f"{'row':18s} {'1 worker':>10s} {'2 workers':>10s} {'efficiency':>10s} {'vs bare (1/2)':>14s} "
          f"{'load (1/2)':>11s}", flush=True)
    results: dict[str, tuple[float, float]] = {}
    for group in groups(rows):
        worlds, loads = {}, []
        for world in (1, 2):
            worlds[world] = measure(group, args, world)
            loads.append(os.getloadavg()[0])
        for name in group:
            one, two = (float(np.median(worlds[world][name])) for world in (1, 2))
            results[name] = (one, two)
            versus = "/".join(f"{np.median(np.array(worlds[w][name]) / np.array(worlds[w][group[0]])):.2f}"
                              for w in (1, 2)) if name != group[0] else "-"
            print(f"{name:18s} {one:10.0f} {two:10.0f} {two / (2 * one):10.3f} {versus:>14s} "
                  f"{loads[0]:5.1f}/{loads[1]:<5.1f}", flush=True)
    gated = [two / (2 * one) for name, (one, two) in results.items() if name in GATED]
    print(f"min_efficiency={min(gated):.3f}" if gated else "min_efficiency=nan (no gated row ran)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
