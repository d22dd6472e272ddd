"""TensorFlow `MultiWorkerMirroredStrategy` on Ray Train (`TensorflowTrainer`, which sets `TF_CONFIG`).

Two loops, one contract (`trainer.tf_loop`): the shared loop (trainers/loop.py) driving a custom step
(`strategy.run` of a `tf.function` with `GradientTape`; stops mid-epoch on STOP), or tf-keras `model.fit` with a
callback that hands each epoch to the same loop's `end_epoch` (metrics, checkpoint, report, MLflow).
`trainer.tf_devices > 1` gives a worker several replicas: its GPUs, or logical CPU devices (one worker:
`MirroredStrategy`, one machine). Keras: tf-keras, see trainers/tf_common.py.
"""
from __future__ import annotations

import time
from typing import Any, Iterator

import numpy as np
from omegaconf import DictConfig

from contract.checkpoint import EpochTotals
from trainers import tf_common as tfc
from trainers.loop import TrainLoop, WorkerContext

log_final_model = tfc.log_final_model  # the backend's logged-model flavour (MLflow tensorflow)


def make_strategy(tf: Any, trainer: DictConfig) -> Any:
    """Threads, then the strategy: it must exist before any other TF op ("Collective ops must be configured
    at program startup")."""
    tfc.set_threads(tf, trainer.threads_per_worker)
    if trainer.num_workers == 1:
        if trainer.tf_devices > 1:
            return tf.distribute.MirroredStrategy(devices=local_devices(tf, trainer.tf_devices, trainer.use_gpu))
        # One replica: nothing to mirror or all-reduce; TF's default strategy has the same API without the
        # per-step collective machinery of MWMS (measured: benchmarks/README.md, tf_vs_bare).
        return tf.distribute.get_strategy()
    impl = {"auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
            "ring": tf.distribute.experimental.CommunicationImplementation.RING,
            "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL}[trainer.tf_communication]
    options = tf.distribute.experimental.CommunicationOptions(implementation=impl)
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)


def local_devices(tf: Any, count: int, use_gpu: bool) -> list[str]:
    """`count` local device names: GPUs, or the CPU split into logical devices (tests, GPU-less machines)."""
    if use_gpu:
        gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
        if len(gpus) < count:
            raise RuntimeError(f"trainer.tf_devices={count} but this worker sees {len(gpus)} GPUs")
        return gpus[:count]
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    return [d.name for d in tf.config.list_logical_devices("CPU")][:count]


class MirroredAdapter(tfc.KerasAdapter):
    """The loop's adapter under a strategy. The per-example loss is averaged over the GLOBAL batch (per-replica
    batch x replicas): the all-reduce sums gradients, so this gives the mean. Every worker writes the
    checkpoint files: saving under a strategy must not be rank-dependent."""

    def __init__(self, keras: Any, world_size: int, *args: Any, **kwargs: Any):
        super().__init__(*args, save_on_every_rank=True, **kwargs)
        self.world_size = world_size
        self.step_fn = self._make_step(keras)

    def _make_step(self, keras: Any) -> Any:
        tf, strategy, model = self.tf, self.strategy, self.model
        global_batch = self.batch_size * strategy.num_replicas_in_sync
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                             reduction=keras.losses.Reduction.NONE)

        def replica_step(images, labels):
            with tf.GradientTape() as tape:
                per_example = loss_fn(labels, model(images, training=True))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        @tf.function
        def step(images, labels):  # the global batch's mean loss
            return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica_step, args=(images, labels)),
                                   axis=None)
        return step

    def batches(self, epoch: int, skip: int) -> Iterator[Any]:
        # From a function: its batches are per replica (not re-batched by the strategy).
        iterator = iter(self.strategy.distribute_datasets_from_function(lambda _: self.epoch_dataset(epoch, skip)))
        for tokens in self.epoch_tokens(epoch)[skip:]:
            yield next(iterator), int(tokens)

    def train_step(self, batch: Any) -> tuple[float, int, int]:
        (images, labels), tokens = batch
        return float(self.step_fn(images, labels)), self.rows_per_step, tokens

    def reduce(self, values: list[float], op: str) -> list[float]:
        rows = self._gather(values)
        return (rows.sum(axis=0) if op == "sum" else rows.max(axis=0)).tolist()

    def _gather(self, values: list[float]) -> np.ndarray:
        """[world_size, len(values)]: every worker's values (an all-gather across workers)."""
        if self.world_size == 1 and self.local_replicas == 1:
            return np.array([values])
        local = self.tf.constant([values], dtype=self.tf.float32)
        rows = self.strategy.gather(self.strategy.run(lambda: local), axis=0).numpy()
        return rows[::self.local_replicas]  # one row per replica, replicas grouped by worker


def fit_epochs(keras: Any, loop: TrainLoop, adapter: MirroredAdapter, epochs: int) -> None:
    """tf-keras `model.fit` over the remaining epochs; a callback hands each epoch's totals to `loop.end_epoch`.
    `fit` does not watch STOP: a preempted fit run resumes from its last epoch checkpoint."""
    ctx = loop.ctx

    class ReportEachEpoch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):  # Keras counts epochs from 0
            if ctx.before_epoch is not None:
                ctx.before_epoch(epoch + 1)
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            samples = adapter.steps * adapter.rows_per_step
            # tf.data prefetches inside fit's step function: data waits are not separable here (reported 0).
            totals = EpochTotals(loss_sum=float(logs["loss"]) * samples, samples=samples, steps=adapter.steps,
                                 train_s=time.perf_counter() - self.start,
                                 tokens=int(adapter.epoch_tokens(epoch + 1).sum()))
            if loop.end_epoch(epoch + 1, totals):
                self.model.stop_training = True  # early stopping (`run.patience`), decided alike on every worker

    class LogStepLoss(keras.callbacks.Callback):
        """Only added when step_loss is wanted: any batch hook makes Keras fetch the loss to the host."""

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch, self.seen, self.mean = epoch + 1, 0, 0.0

        def on_train_batch_end(self, batch, logs=None):
            # Called every tf_steps_per_execution steps with the epoch's running mean loss: the steps since
            # the last call had mean (mean_k * k - mean_j * j) / (k - j).
            done, mean = batch + 1, float(logs["loss"])
            window = (mean * done - self.mean * self.seen) / (done - self.seen)
            loop.log_step_loss(self.epoch, done, window, since_step=self.seen)
            self.seen, self.mean = done, mean

    callbacks = [ReportEachEpoch()]
    if ctx.logger is not None and ctx.log_every_n_steps > 0:
        callbacks.append(LogStepLoss())

    def all_epochs(_):  # one dataset per epoch, each with its own shuffle seed, chained
        chained = None
        for epoch in range(loop.first_epoch, epochs + 1):
            ds = adapter.epoch_dataset(epoch)
            chained = ds if chained is None else chained.concatenate(ds)
        return chained

    distributed = adapter.strategy.distribute_datasets_from_function(all_epochs)
    adapter.model.fit(distributed, epochs=epochs, initial_epoch=loop.first_epoch - 1,
                      steps_per_epoch=adapter.steps, callbacks=callbacks, verbose=0)


def build_adapter(cfg: DictConfig, model_inputs: dict, rank: int, world_size: int,
                  data: tuple[tfc.ShardArrays, tfc.ShardArrays]) -> tuple[Any, MirroredAdapter]:
    """(keras, adapter): the strategy first (before any other TF op), then the model inside it."""
    import tensorflow as tf

    strategy = make_strategy(tf, cfg.trainer)
    import tf_keras as keras

    from trainers.models.keras_models import build_keras_model

    # Same initial weights everywhere and for every device layout: they are drawn outside the strategy, whose
    # variable creation uses up random ops differently (default vs Mirrored strategy), then copied in.
    keras.utils.set_random_seed(cfg.run.seed)
    initial = build_keras_model(cfg.model, keras, model_inputs).get_weights()
    with strategy.scope():
        model = tfc.build_compiled_model(keras, cfg, model_inputs, cfg.trainer.tf_steps_per_execution)
        model.set_weights(initial)
    local_replicas = strategy.num_replicas_in_sync // world_size  # tf_devices under MirroredStrategy, else 1
    train, evaluation = data
    adapter = MirroredAdapter(keras, world_size, tf, strategy, model, train, evaluation, cfg.trainer.batch_size,
                              rank, cfg.run.seed + 1000 * rank, cfg.trainer.max_steps_per_epoch, local_replicas)
    return keras, adapter


def run_worker(cfg: DictConfig, ctx: WorkerContext, model_inputs: dict,
               data: tuple[tfc.ShardArrays, tfc.ShardArrays] | None = None) -> bool:
    """Either loop, then `run.dump_params_dir`. `data`: Ray Data shards unless given (tests). False: stopped."""
    tfc.require_legacy_keras()
    keras, adapter = build_adapter(cfg, model_inputs, ctx.rank, ctx.world_size,
                                   data or tfc.worker_arrays(cfg.data.name))
    loop = TrainLoop(adapter, ctx)
    if cfg.trainer.tf_loop == "fit":
        if loop.first_epoch <= ctx.epochs and not loop.early_stopped():
            fit_epochs(keras, loop, adapter, ctx.epochs)
    elif not loop.run():
        return False
    adapter.dump(cfg.run.dump_params_dir)
    return True


def train_loop_per_worker(config: dict[str, Any]) -> None:
    from trainers.worker import ray_context, worker_config

    cfg = worker_config(config)
    run_worker(cfg, ray_context(config, cfg), config["model_inputs"])


def worker_resources(trainer: DictConfig) -> dict[str, float]:
    resources = {"CPU": float(trainer.threads_per_worker)}
    if trainer.use_gpu:
        resources["GPU"] = float(trainer.tf_devices)  # one GPU per replica
    return resources


def build_trainer(cfg: DictConfig, datasets: dict, run_id: str, tracking_uri: str, model_inputs: dict,
                  callbacks: list | None = None):
    from ray.train.tensorflow import TensorflowTrainer

    from trainers.shard_data import OrderedShards
    from trainers.worker import loop_config, run_config, scaling_config

    return TensorflowTrainer(
        train_loop_per_worker,
        train_loop_config=loop_config(cfg, run_id, tracking_uri, model_inputs),
        scaling_config=scaling_config(cfg, resources=worker_resources(cfg.trainer)),
        # tf-keras must own `tf.keras` from process start (trainers/tf_common.py); Ray starts the worker
        # processes with these env vars (merged with the job's).
        run_config=run_config(cfg, run_id, callbacks, {**tfc.LEGACY_KERAS_ENV, "TF_CPP_MIN_LOG_LEVEL": "2"}),
        datasets=datasets,
        dataset_config=OrderedShards(dp=cfg.trainer.num_workers),  # ShardArrays always caches its shard
    )
