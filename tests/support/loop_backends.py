"""One attempt of a backend's worker in this (fresh) process, on the shared loop without Ray:

    python -m tests.support.loop_backends BACKEND FOLDER ATTEMPT [RESTORE]
    python -m tests.support.loop_backends ps_dropout|dtensor_dropout FOLDER

BACKEND: a key of BACKENDS; ATTEMPT: straight | stopped | resumed.
Prints the attempt as JSON (tests/support/loop_harness.py) on its last line; `ps_dropout`, `dtensor_dropout`: what
`ps_dropout_draws` and `dtensor_dropout_draws` return. A fresh process per attempt: TensorFlow fixes
its threads and logical devices at its first op, and tf-keras needs TF_USE_LEGACY_KERAS=1 before TF is imported.
Horovod runs as a lone process (size 1, no rendezvous). The TF backends also check they never import torch.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from contract.data import DataSchema
from pipelines.data.imdb import imdb_schema
from pipelines.data.mnist import mnist_schema
from tests.support.loop_harness import (attempt_to_json, config, imdb_columns, make_context, mnist_columns,
                                        run_attempt, shard)

MODEL_INPUTS = imdb_schema(64, 16)


def schema_of(cfg) -> DataSchema:
    """The schema of the data `data_for(cfg)` generates."""
    return MODEL_INPUTS if cfg.data.name == "imdb" else mnist_schema()
COMMON = ["trainer.epochs=2", "trainer.batch_size=16", "trainer.optimizer=sgd", "trainer.lr=0.01",
          "trainer.num_workers=1", "model.dropout=0"]
# The recipe (contract/recipe.py) on the TF runs: 2 batches per update, so the stop at step 10 lands on an update
# boundary. SGD with momentum (COMMON), whose updates scale with the gradient (Adam's would hide a wrong
# 1/grad_accum); the clipping at 5 is active in the first updates only (averaged gradient norms 13.5, 9.0, 6.8,
# 7.4, then 3-5, measured unclipped).
USER_LIGHTNING = ["trainer=lightning", "plugins=[tests.support.user_lightning]", "model=smoothed_mlp",
                  *[key for key in COMMON if not key.startswith("model.")]]
DTENSOR_2X2 = ["trainer.devices_per_worker=4", "trainer.mesh.batch=2", "trainer.mesh.model=2"]
TF_RECIPE = ["trainer.lr_schedule=cosine", "trainer.warmup_steps=3", "trainer.grad_clip=5.0", "trainer.grad_accum=2"]
CONSTANT_LR = ["trainer.lr_schedule=constant", "trainer.warmup_steps=0"]
ONE_DEVICE = ["trainer=tf_mwms", "trainer.tf_loop=custom", "model.hidden=[32]", *COMMON, *TF_RECIPE]
BACKENDS = {
    # clipping after Horovod's synchronize(), the schedule stepped by its DistributedOptimizer and checkpointed; a
    # CNN, trained channels-last: its convolutions' weights, gradients and momentum buffers are not contiguous
    # tensors, which Horovod takes through contiguous copies (all-reduce, the broadcasts at the start and the restore)
    "horovod_torch": ["trainer=horovod", "trainer.grad_accum=2", "model=cnn", "model.channels=[4,8]",
                      "model.hidden=16", *COMMON,
                      "trainer.lr_schedule=cosine", "trainer.warmup_steps=3", "trainer.grad_clip=1.0"],
    # Lightning's Trainer on the recipe: accumulation (the stop at step 10 on an update boundary), clipping and a
    # schedule, each applied by Lightning (trainers/torch/lightning_fit.py) from this project's keys
    "lightning": ["trainer=lightning", "trainer.grad_accum=2", "model.hidden=[32]", *COMMON,
                  "trainer.lr_schedule=cosine", "trainer.warmup_steps=3", "trainer.grad_clip=1.0"],
    # a user's own LightningModule (tests/support/user_lightning.py): its training_step and optimizer, not the recipe
    "lightning_user": [*USER_LIGHTNING, "model.lr=0.1"],
    "lightning_user_frozen": [*USER_LIGHTNING, "model.lr=0"],
    # DeepSpeed's engine at each ZeRO stage: accumulation (the stop at step 10 on a boundary), clipping and a
    # schedule, the recipe's, applied by the engine
    **{f"deepspeed_zero{stage}": ["trainer=deepspeed", f"trainer.zero_stage={stage}", "trainer.grad_accum=2",
                                  "model.hidden=[32]", *COMMON, "trainer.lr_schedule=cosine", "trainer.warmup_steps=3",
                                  "trainer.grad_clip=1.0"] for stage in (1, 2, 3)},
    "horovod_tf": ["trainer=horovod", "trainer.framework=tf", "model.hidden=[32]", *COMMON,
                   "trainer.optimizer=adamw", "trainer.weight_decay=0.01", "trainer.lr_schedule=linear",
                   "trainer.warmup_steps=3", "trainer.grad_clip=1.0", "trainer.grad_accum=2"],
    # two logical CPU devices under MirroredStrategy: the strategy's gather and per-replica batches
    "tf_mwms_custom": ["trainer=tf_mwms", "trainer.tf_loop=custom", "trainer.devices_per_worker=2", "model.hidden=[32]",
                       *COMMON, *TF_RECIPE],
    # without accumulation: 4 steps per call of the compiled step loop (trainer.tf_steps_per_execution), a call ending
    # at each STOP check (every 10 steps: calls of 4, 4 and 2 steps)
    "tf_mwms_steps_per_call": ["trainer=tf_mwms", "trainer.tf_loop=custom", "trainer.tf_steps_per_execution=4",
                               "model.hidden=[32]", *COMMON, *TF_RECIPE, "trainer.grad_accum=1"],
    # one device with 32 rows vs two with 16 each (and fit over the same two, and the other ways of summing over
    # them): the same steps
    "tf_one_device": [*ONE_DEVICE, "trainer.batch_size=32"],
    "tf_two_devices_fit": ["trainer=tf_mwms", "trainer.tf_loop=fit", "trainer.devices_per_worker=2",
                           "model.hidden=[32]", "trainer.tf_steps_per_execution=2", "trainer.log_every_n_steps=2",
                           *COMMON, *TF_RECIPE],
    **{f"tf_{ops}": ["trainer=tf_mwms", "trainer.tf_loop=custom", "trainer.devices_per_worker=2", "model.hidden=[32]",
                     *COMMON, *TF_RECIPE, f"trainer.tf_cross_device_ops={ops}"]
       for ops in ("reduce_to_one", "hierarchical_copy")},
    # at a constant rate, without accumulation (config errors there), against one device with 64 rows
    "tf_big_batch_constant_lr": [*ONE_DEVICE, "trainer.batch_size=64", "trainer.grad_accum=1", *CONSTANT_LR],
    "tf_central_storage": ["trainer=tf_mwms", "trainer.tf_loop=custom", "trainer.devices_per_worker=2",
                           "model.hidden=[32]", *COMMON, *TF_RECIPE, "trainer.batch_size=32", "trainer.grad_accum=1",
                           *CONSTANT_LR, "trainer.tf_strategy=central_storage"],
    # the updates of all three: 64 rows each, in one batch
    "tf_big_batch": [*ONE_DEVICE, "trainer.batch_size=64", "trainer.grad_accum=1"],
    "tf_bf16": [*ONE_DEVICE, "trainer.batch_size=32", "trainer.precision=bf16"],
    # a 2x2 mesh of logical CPU devices (2D: batch and model sharded), 8 rows per batch coordinate
    "tf_dtensor": ["trainer=tf_dtensor", *DTENSOR_2X2, "model.hidden=[32]", *COMMON, "trainer.batch_size=8",
                   "trainer.lr_schedule=cosine", "trainer.warmup_steps=3", "trainer.grad_clip=5.0"],
    # one chief, two parameter servers (the weights split in 2 shards: min 4 KiB), one worker: in order, so exact
    "tf_ps": ["trainer=tf_ps", "trainer.num_ps=2", "trainer.ps_min_shard_bytes=4096", "model.hidden=[32]", *COMMON,
              "trainer.lr_schedule=cosine", "trainer.warmup_steps=3", "trainer.grad_clip=5.0"],
    # Keras fit driving the coordinator: 20 steps an epoch, 4 per scheduled function
    "tf_ps_fit": ["trainer=tf_ps", "trainer.tf_loop=fit", "trainer.num_ps=2", "trainer.ps_min_shard_bytes=4096",
                  "trainer.tf_steps_per_execution=4", "trainer.log_every_n_steps=0", "model.hidden=[32]", *COMMON],
    # 20 batches per epoch in groups of 3 (the last of 2), in bf16
    "tf_mwms_fit": ["trainer=tf_mwms", "trainer.tf_loop=fit", "data=imdb", "model=embed_pool", "model.embed_dim=8",
                    "model.hidden=8", "trainer.tf_steps_per_execution=4", *COMMON, "trainer.optimizer=adamw",
                    "trainer.weight_decay=0.01", "trainer.lr_schedule=linear", "trainer.warmup_steps=2",
                    "trainer.grad_accum=3", "trainer.precision=bf16"],
}
# The loss-parity gate (test_loss_parity_with_the_ddp_reference): one seed, data order and recipe through each backend.
# SGD with momentum at a constant rate: PyTorch and Keras define momentum alike only while the rate is constant
# (torch scales the whole velocity by the current rate, Keras each gradient as it enters the velocity).
PARITY = ["model.hidden=[32]", "model.dropout=0", "trainer.optimizer=sgd", "trainer.momentum=0.9", "trainer.lr=0.01",
          "trainer.batch_size=16", "trainer.epochs=2", "trainer.num_workers=1", "trainer.log_every_n_steps=1"]
PARITY_BACKENDS = {
    "ddp": ["trainer=ddp", *PARITY],
    "lightning": ["trainer=lightning", *PARITY],
    "deepspeed": ["trainer=deepspeed", "trainer.zero_stage=3", *PARITY],
    "horovod_torch": ["trainer=horovod", *PARITY],
    "horovod_tf": ["trainer=horovod", "trainer.framework=tf", *PARITY],
    "tf_mwms_custom": ["trainer=tf_mwms", "trainer.tf_loop=custom", *PARITY],
    "tf_mwms_fit": ["trainer=tf_mwms", "trainer.tf_loop=fit", "trainer.tf_steps_per_execution=1", *PARITY],
    # the global batch of 16 as 2 batch coordinates of 8 rows, the weights sharded over 2 devices
    "tf_dtensor": ["trainer=tf_dtensor", *DTENSOR_2X2, *PARITY, "trainer.batch_size=8"],
    # one worker's steps, in order, on weights split over 2 parameter servers
    "tf_ps": ["trainer=tf_ps", "trainer.num_ps=2", "trainer.ps_min_shard_bytes=4096", *PARITY],
}
BACKENDS.update({f"parity_{name}": overrides for name, overrides in PARITY_BACKENDS.items()})


def data_for(cfg):
    if cfg.data.name == "imdb":
        return imdb_columns(320, 64, 16), imdb_columns(64, 64, 16, seed=1)
    return mnist_columns(320), mnist_columns(64, seed=1)


def runner(cfg):
    """`run(ctx) -> finished` of the backend `cfg` names, on generated data."""
    from trainers import get_backend
    from trainers.adapter import WorkerData

    train, evaluation = data_for(cfg)
    trainer = cfg.trainer
    if trainer.backend in ("ddp", "lightning", "deepspeed") or trainer.get("framework") == "torch":
        import torch

        from trainers.torch.data import ShardBatches

        def batches(seed):
            as_torch = lambda cols: {k: torch.from_numpy(v) for k, v in cols.items()}  # noqa: E731
            return (ShardBatches.from_columns(as_torch(train), mnist_schema(), trainer.batch_size, seed),
                    ShardBatches.from_columns(as_torch(evaluation), mnist_schema(), 64, seed))
        if trainer.backend == "deepspeed":
            lone_process_group()
        from trainers.torch import lightning_fit  # in-process: Lightning's strategy over this process group

        run_worker = lightning_fit.run_worker if trainer.backend == "lightning" else get_backend(trainer).run_worker
        return lambda ctx: run_worker(cfg, ctx, WorkerData(mnist_schema(), batches))  # one rank
    from trainers.tf.data import ShardArrays

    if trainer.backend == "tf_ps":
        return ps_runner(cfg, train, ShardArrays.from_columns(evaluation, schema_of(cfg)))
    arrays = (ShardArrays.from_columns(train, schema_of(cfg)), ShardArrays.from_columns(evaluation, schema_of(cfg)))
    return lambda ctx: get_backend(trainer).run_worker(cfg, ctx, WorkerData(schema_of(cfg), lambda seed: arrays))


def lone_process_group() -> None:
    """A one-rank gloo group and torchrun's variables, as Ray Train sets them up for a worker (DeepSpeed's engine
    runs on them)."""
    import torch.distributed as dist

    from tests.conftest import free_ports

    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_ports(1)[0]}", rank=0, world_size=1)


def ps_runner(cfg, train, evaluation):
    """tf_ps in this process as its chief (`ps_cluster`)."""
    from trainers.adapter import WorkerData
    from trainers.tf.tf_ps import ParameterServers

    shards = ps_cluster(cfg, train)
    data = WorkerData(schema_of(cfg), lambda seed: (shards, evaluation))
    return lambda ctx: ParameterServers().run_worker(cfg, ctx, data)


def ps_cluster(cfg, train):
    """Real TensorFlow servers (trainers/tf/ps/server.py's, in child processes of tests/support/tf_ps_servers.py) for
    the
    parameter servers and workers of `cfg`'s tf_ps cluster on this machine, each worker's shard written as a
    Ray worker writes it, and TF_CONFIG naming this process its chief; returns the workers' shards. The servers end
    with this process."""
    import subprocess
    import tempfile

    from tests.conftest import free_ports
    from trainers.tf.data import ShardArrays
    from trainers.tf.ps.cluster import PublishedShards, roles, tf_config, write_shard

    trainer = cfg.trainer
    world = 1 + trainer.num_ps + trainer.num_workers
    addresses = [f"127.0.0.1:{port}" for port in free_ports(world)]
    published = []
    groups: list[list[str]] = [[] for _ in range(trainer.num_workers)]  # a process per worker, the PS in the first
    for rank, (kind, index) in enumerate(roles(world, trainer.num_ps)):
        if kind == "worker":
            rows = shard(train, index, trainer.num_workers)
            published.append(write_shard(ShardArrays.from_columns(rows, schema_of(cfg)), tempfile.mkdtemp()))
        if kind != "chief":
            groups[index if kind == "worker" else 0].append(tf_config(addresses, trainer.num_ps, rank))
    for group in groups:
        subprocess.Popen([sys.executable, "-m", "tests.support.tf_ps_servers", str(trainer.threads_per_worker), *group],
                         env={**os.environ, "TF_PS_PARENT": str(os.getpid()), "TF_CPP_MIN_LOG_LEVEL": "2"})
    os.environ["TF_CONFIG"] = tf_config(addresses, trainer.num_ps, 0)
    return PublishedShards(published)


def ps_dropout_draws(folder: Path) -> dict[int, list[list[float]]]:
    """The model tf_ps trains (trainers/tf/tf_ps.py `ParameterServers.build_adapter`: MNIST MLP, dropout 0.5, 2
    workers, 1 parameter server) applied to one all-ones image in training mode by functions the coordinator
    schedules, until each worker has run at least 4: {worker index: the logits of each of its functions, in the
    order they ran}. The weights do not change, so two draws differ only by their dropout masks."""
    import tensorflow as tf

    from trainers.adapter import WorkerData
    from trainers.tf.data import ShardArrays
    from trainers.tf.tf_ps import ParameterServers

    cfg = config(folder / "cfg", ["trainer=tf_ps", "trainer.num_ps=1", "trainer.num_workers=2", "model.hidden=[32]",
                                  "model.dropout=0.5", "trainer.epochs=1", "trainer.batch_size=16"])
    train, evaluation = data_for(cfg)
    context = make_context(0, 1, 1, folder / "checkpoints", None, [])
    shards = ps_cluster(cfg, train), ShardArrays.from_columns(evaluation, mnist_schema())
    adapter = ParameterServers().build_adapter(cfg, context, WorkerData(mnist_schema(), lambda seed: shards))

    @tf.function
    def draw():
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        logits = adapter.strategy.run(lambda: adapter.model(tf.ones([1, 784]), training=True))
        return tf.concat([tf.cast([worker], tf.float32), tf.reshape(logits, [-1])], 0)

    draws: dict[int, list[list[float]]] = {0: [], 1: []}
    for _ in range(50):  # bounded: a worker slow to connect may run none of a round's functions
        results = [adapter.coordinator.schedule(draw) for _ in range(8)]
        adapter.coordinator.join()
        for result in results:
            values = result.fetch()
            draws[int(values[0])].append(values[1:].tolist())
        if min(len(runs) for runs in draws.values()) >= 4:
            break
    return draws


def dtensor_dropout_draws(folder: Path) -> list[list[list[float]]]:
    """tf_dtensor's model (MNIST MLP, dropout 0.5) on a 2 x 2 mesh (batch x model) of this process' 4 CPU devices,
    one training-mode forward pass of the step's seed on a batch of identical all-ones images: each device's logits
    [rows, 10], devices in mesh order (0, 1: batch coordinate 0; 2, 3: coordinate 1)."""
    import numpy as np
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    from trainers.tf.adapter import set_threads
    from trainers.models import build_module
    from trainers.tf.dtensor.mesh import DTensorMesh, parallelize_dtensor
    from trainers.tf.tf_dtensor import mesh_dims

    cfg = config(folder / "cfg", ["trainer=tf_dtensor", *DTENSOR_2X2, "model.hidden=[32]", "model.dropout=0.5",
                                  "trainer.batch_size=4", "trainer.num_workers=1"])
    set_threads(tf, 1)
    mesh = DTensorMesh(mesh_dims(cfg.trainer), 0, "CPU")
    model = parallelize_dtensor(build_module(cfg.model, mnist_schema(), cfg.run.seed), mesh)
    rows = cfg.trainer.batch_size * mesh.dims.coords_per_client
    images = mesh.pack_batch(np.ones((rows, 784), np.float32), cfg.trainer.batch_size)
    seed = mesh.put(np.array([cfg.run.seed, 3], np.int32))  # as DTensorAdapter.train_step's, at update 3
    logits = tf.function(lambda x, s: model(x, training=True, seed=s))(images, seed)
    return [shard.numpy().tolist() for shard in dtensor.unpack(logits)]


def logged_lightning_module(folder: Path, tracking_uri: str) -> dict[str, float]:
    """A user's LightningModule (`lightning_user`) trained 2 epochs, its final checkpoint logged as trainer=lightning
    logs it (`log_final_model`) to a new run on `tracking_uri`, and loaded back from MLflow: how far the loaded
    model's outputs are from the trained module's on a batch, and whether training moved its weights."""
    import mlflow
    import torch
    from mlflow.tracking import MlflowClient
    from ray.train import Checkpoint

    from trainers.models import build_lightning_module
    from trainers.torch.lightning import Lightning
    from trainers.torch.lightning_checkpoint import module_state

    cfg = config(folder / "cfg", BACKENDS["lightning_user"])
    result = run_attempt(runner(cfg), 0, 1, cfg.trainer.epochs, folder / "run")
    client = MlflowClient(tracking_uri)
    run_id = client.create_run(client.create_experiment("logged-lightning-module")).info.run_id
    checkpoint = Checkpoint.from_directory(str(result.checkpoint))
    Lightning().log_final_model(tracking_uri, run_id, cfg, checkpoint, mnist_schema())
    mlflow.set_tracking_uri(tracking_uri)
    [logged] = mlflow.search_logged_models(filter_string=f"source_run_id = '{run_id}'", output_format="list",
                                           experiment_ids=[client.get_run(run_id).info.experiment_id])
    trained = build_lightning_module(cfg.model, mnist_schema())
    initial = trained.net[0].weight.detach().clone()
    trained.load_state_dict(module_state(str(result.checkpoint)))
    images = torch.randn(8, 784)
    with torch.no_grad():
        gap = (mlflow.pytorch.load_model(logged.model_uri)(images) - trained.eval()(images)).abs().max()
    return {"max_output_gap": float(gap), "trained": not torch.equal(trained.net[0].weight, initial)}


def main(backend: str, folder: str, attempt: str = "", restore: str | None = None) -> None:
    base = Path(folder)
    if backend == "logged_lightning_module":
        print(json.dumps(logged_lightning_module(base, attempt)))
        return
    if backend in ("ps_dropout", "dtensor_dropout"):
        draws = ps_dropout_draws if backend == "ps_dropout" else dtensor_dropout_draws
        print(json.dumps(draws(base)))
        return
    # The TF runs leave their final weights in `ATTEMPT/params/rank0.npz` (run.dump_params_dir).
    dump = [f"run.dump_params_dir={base / attempt / 'params'}"] if backend != "horovod_torch" else []
    cfg = config(base / "cfg", [*BACKENDS[backend], *dump])
    result = run_attempt(runner(cfg), 0, 1, cfg.trainer.epochs, base / attempt,
                         restored=Path(restore) if restore else None, stop=attempt == "stopped")
    if cfg.trainer.backend in ("tf_mwms", "tf_dtensor", "tf_ps") or cfg.trainer.get("framework") == "tf":
        assert "torch" not in sys.modules, "a TensorFlow worker imported torch"
    print(json.dumps(attempt_to_json(result)))


if __name__ == "__main__":
    main(*sys.argv[1:])
