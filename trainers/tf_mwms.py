"""TensorFlow `MultiWorkerMirroredStrategy` on Ray Train (`TensorflowTrainer`, which sets `TF_CONFIG`).

Two loops, same metrics (`trainer.tf_loop`): Keras `model.fit` with a callback that reports each epoch, or a
custom loop (`strategy.run` of a `tf.function` step with `GradientTape`). `trainer.tf_devices > 1` gives a
worker several replicas: its GPUs, or logical CPU devices (one worker: `MirroredStrategy`, one machine).

Which Keras: tf-keras (Keras 2), for both loops. Keras 3 `model.fit` under MWMS with 2 workers crashes
(`Attempt to convert a value (PerReplica:...)`, keras-team/keras#20585, tensorflow#72388, open upstream);
tf-keras is the maintained Keras 2 package released with every TF version, and its `fit` works under MWMS
unpatched, which beats monkeypatching Keras 3 internals. One Keras for both loops keeps one checkpoint
format and one logged-model flavour. tf-keras only
takes over `tf.keras` (and TF's distribute code paths) when `TF_USE_LEGACY_KERAS=1` is in the environment
before the process imports TensorFlow, so the trainer passes it through `RunConfig(worker_runtime_env=...)`:
Ray starts the worker processes with it. Setting it inside the loop is too late.
"""
from __future__ import annotations

import json
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from pipelines.data.mnist import MEAN, STD
from trainers.torch_common import maybe_inject_failure, rank0_logger  # framework-free

LEGACY_KERAS_ENV = {"TF_USE_LEGACY_KERAS": "1"}
LOAD_BATCH = 8192
EVAL_BATCH = 256
WEIGHTS, OPTIMIZER, STATE = "model.weights.h5", "optimizer.npz", "state.json"


def make_strategy(tf: Any, trainer: DictConfig) -> Any:
    """Threads, then the strategy: it must exist before any other TF op ("Collective ops must be configured
    at program startup"). Inter-op threads >= 2: a precaution (not measured) so that an op blocked in a
    collective cannot starve the others."""
    tf.config.threading.set_intra_op_parallelism_threads(trainer.threads_per_worker)
    tf.config.threading.set_inter_op_parallelism_threads(trainer.threads_per_worker + 1)
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


class ShardArrays:
    """This worker's Ray Data shard, pulled once into memory as numpy (same reason as
    `torch_common.ShardBatches`: re-streaming Parquet every epoch is slower than the model trains).
    Features: MNIST uint8 images [N, 784] (normalised per batch in `dataset`), IMDb int32 token ids [N, T]."""

    def __init__(self, shard: Any, dataset: str):
        start = time.perf_counter()
        self.column = "image" if dataset == "mnist" else "input_ids"
        features, labels = [], []
        for batch in shard.iter_batches(batch_size=LOAD_BATCH, batch_format="numpy"):
            column = batch[self.column]  # fixed-size lists: [B, D], or B arrays of D
            features.append(np.stack(column) if column.dtype == object else column)
            labels.append(np.asarray(batch["label"], dtype=np.int64))
        self.features, self.labels = np.concatenate(features), np.concatenate(labels)
        self.load_s = time.perf_counter() - start

    def steps(self, batch_size: int, max_steps: int | None) -> int:
        # Every worker must run the same number of steps (each is a collective): Ray's DataConfig splits
        # with equal=True (same rows per worker), and only full batches are used.
        steps = len(self.labels) // batch_size
        return min(steps, max_steps) if max_steps else steps

    def dataset(self, tf: Any, batch_size: int, seed: int | None = None, steps: int | None = None) -> Any:
        """One epoch as a `tf.data.Dataset` of (features, labels [B]); shuffled with `seed` (per epoch) when
        given. TF's auto-sharding is off: Ray already gave each worker its shard."""
        order = np.arange(len(self.labels)) if seed is None else np.random.default_rng(seed).permutation(
            len(self.labels))
        ds = tf.data.Dataset.from_tensor_slices((self.features[order], self.labels[order]))
        ds = ds.batch(batch_size, drop_remainder=steps is not None)
        if steps is not None:
            ds = ds.take(steps)
        if self.column == "image":
            ds = ds.map(lambda x, y: ((tf.cast(x, tf.float32) / 255.0 - MEAN) / STD, y))
        else:
            ds = ds.map(lambda x, y: (tf.cast(x, tf.int32), y))
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        return ds.with_options(options).prefetch(2)


def input_example(cfg: DictConfig, model_inputs: dict) -> np.ndarray:
    """Two all-zero inputs of the model's shape (for MLflow's signature)."""
    if cfg.data.name == "mnist":
        return np.zeros((2, 784), dtype=np.float32)
    return np.zeros((2, model_inputs["max_len"]), dtype=np.int32)


def build_compiled_model(keras: Any, cfg: DictConfig, model_inputs: dict) -> Any:
    from trainers.models.keras_models import build_keras_model

    model = build_keras_model(cfg.model, keras, model_inputs)
    optimizer = (keras.optimizers.SGD(cfg.trainer.lr, momentum=0.9) if cfg.trainer.optimizer == "sgd"
                 else keras.optimizers.Adam(cfg.trainer.lr))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  # Several steps per tf.function call: cuts the per-step host overhead of the strategy.
                  steps_per_execution=cfg.trainer.tf_steps_per_execution)
    return model


def save_checkpoint(directory: str, model: Any, epoch: int, metrics: dict | None, partial: dict | None = None) -> None:
    """Native Keras weights file + the optimizer's variables (Keras' own `save_own_variables` store).
    `epoch`: the last finished epoch; `partial`: where the next one stopped (`Epochs.report_stop`)."""
    model.save_weights(os.path.join(directory, WEIGHTS))
    store: dict[str, np.ndarray] = {}
    model.optimizer.save_own_variables(store)
    np.savez(os.path.join(directory, OPTIMIZER), **store)
    Path(directory, STATE).write_text(json.dumps({"epoch": epoch, "metrics": metrics, "partial": partial}))


def restore_checkpoint(checkpoint: Any, model: Any, strategy: Any) -> dict | None:
    """Weights, optimizer state and epoch from a checkpoint written by `save_checkpoint` (or None)."""
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        model.load_weights(os.path.join(directory, WEIGHTS))
        with np.load(os.path.join(directory, OPTIMIZER)) as store, strategy.scope():
            model.optimizer.build(model.trainable_variables)  # creates the slots, mirrored
            model.optimizer.set_weights([store[str(i)] for i in range(len(store.files))])
        return json.loads(Path(directory, STATE).read_text())


class Epochs:
    """Per-epoch bookkeeping shared by both loops: evaluation, cross-worker metrics, checkpoint, MLflow."""

    def __init__(self, tf: Any, strategy: Any, model: Any, cfg: DictConfig, config: dict, state: dict | None,
                 train: ShardArrays, test: ShardArrays):
        import ray.train

        from pipelines.resume import stop_file

        self.tf, self.strategy, self.model, self.cfg = tf, strategy, model, cfg
        self.stop_path = stop_file(cfg.run.resume_dir)
        self.partial = None if state is None else state.get("partial")
        self.last_metrics = None if state is None else state["metrics"]
        context = ray.train.get_context()
        self.rank, self.world_size = context.get_world_rank(), context.get_world_size()
        self.start_epoch = 1 if state is None else state["epoch"] + 1
        self.train, self.test = train, test
        self.logger = rank0_logger(config, self.rank, state)
        # Replicas in this worker (tf_devices under MirroredStrategy, else 1): each takes a batch per step.
        self.local_replicas = strategy.num_replicas_in_sync // self.world_size
        self.batch = cfg.trainer.batch_size
        self.steps = train.steps(self.batch * self.local_replicas, cfg.trainer.max_steps_per_epoch)

    def dataset(self, epoch: int, seed: int, skip: int = 0) -> Any:
        """The epoch's per-replica batches for this worker: `steps` for each of its replicas, without those of
        the first `skip` steps (already trained on before a stop)."""
        ds = self.train.dataset(self.tf, self.batch, seed=seed + epoch, steps=self.steps * self.local_replicas)
        return ds.skip(skip * self.local_replicas) if skip else ds

    def resume_totals(self, epoch: int) -> tuple[int, float, float]:
        """(steps done, their loss sum, their train seconds) of `epoch` before a stop; zeros for a new epoch."""
        if self.partial is None or self.partial["epoch"] != epoch:
            return 0, 0.0, 0.0
        return self.partial["done"], self.partial["loss_sum"], self.partial["train_s"]

    def should_stop(self, done: int) -> bool:
        """True on every worker at the same step once STOP exists in `run.resume_dir` (see torch_common.StopCheck);
        the workers agree through one all-gather of a flag every STOP_CHECK_EVERY steps."""
        from pipelines.resume import STOP_CHECK_EVERY

        if self.stop_path is None or done % STOP_CHECK_EVERY:
            return False
        return bool(self._gather([float(self.stop_path.exists())])[:, 0].max() > 0)

    def report_stop(self, epoch: int, done: int, loss_sum: float, train_s: float) -> None:
        """Checkpoint the half-done epoch; the driver sees `stopped_at_epoch` and marks the run as stopped."""
        import ray.train

        metrics = {"stopped_at_epoch": float(epoch), "stopped_at_step": float(done)}
        partial = {"epoch": epoch, "done": done, "loss_sum": loss_sum, "train_s": train_s}
        with tempfile.TemporaryDirectory() as directory:
            save_checkpoint(directory, self.model, epoch - 1, self.last_metrics, partial)
            checkpoint = ray.train.Checkpoint.from_directory(directory) if self.rank == 0 else None
            ray.train.report(metrics, checkpoint=checkpoint)

    def step_loss(self, epoch: int, step_in_epoch: int, loss: float, since_step: int | None = None) -> None:
        """Rank 0 logs `step_loss` when the global step crosses a multiple of `log_every_n_steps` (the loss
        given is that of the steps since `since_step`, for loops that see the loss only every few steps)."""
        every = self.cfg.trainer.log_every_n_steps
        if self.logger is None or every <= 0:
            return
        step = (epoch - 1) * self.steps + step_in_epoch
        previous = step - 1 if since_step is None else (epoch - 1) * self.steps + since_step
        if step // every > previous // every:
            self.logger.log_step_loss(step, loss)

    def begin(self, epoch: int) -> None:
        maybe_inject_failure(self.cfg.fault, epoch, self.rank, self.world_size)

    def _gather(self, values: list[float]) -> np.ndarray:
        """[world_size, len(values)]: every worker's values (an all-gather across workers)."""
        local = self.tf.constant([values], dtype=self.tf.float32)
        rows = self.strategy.gather(self.strategy.run(lambda: local), axis=0).numpy()
        return rows[::self.local_replicas]  # one row per replica, replicas grouped by worker

    def count_correct(self) -> tuple[int, int]:
        correct = 0
        for features, labels in self.test.dataset(self.tf, EVAL_BATCH):
            logits = self.model(features, training=False)  # local replica's (synchronised) weights
            correct += int(np.sum(np.argmax(logits.numpy(), axis=1) == labels.numpy()))
        return correct, len(self.test.labels)

    def end(self, epoch: int, train_loss: float, samples: int, steps: int, wait_s: float, train_s: float) -> None:
        correct, total = self.count_correct()
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        rows = self._gather([samples, steps, wait_s, train_s, correct, total, peak_rss])
        samples_all, steps_all, wait_all, train_all, correct_all, total_all = rows[:, :6].sum(axis=0)
        slowest_s = float(rows[:, 3].max())
        metrics = {"train_loss": float(train_loss), "test_accuracy": correct_all / max(total_all, 1),
                   "samples_per_s": samples_all / max(slowest_s, 1e-9),
                   "step_time_ms": 1000.0 * train_all / max(steps_all, 1),
                   "data_wait_fraction": wait_all / max(train_all, 1e-9), "epoch_time_s": slowest_s,
                   "peak_memory_bytes": float(rows[:, 6].max())}  # the largest worker's peak RSS so far
        if epoch == self.start_epoch:
            metrics["data_load_s"] = self.train.load_s + self.test.load_s
        self.report(epoch, {k: float(v) for k, v in metrics.items()})  # numpy scalars -> JSON-able floats

    def report(self, epoch: int, metrics: dict) -> None:
        """Every worker writes its checkpoint (saving must not be rank-dependent under a strategy); rank 0's
        is the one reported."""
        import ray.train

        with tempfile.TemporaryDirectory() as directory:
            save_checkpoint(directory, self.model, epoch, metrics)
            checkpoint = ray.train.Checkpoint.from_directory(directory) if self.rank == 0 else None
            ray.train.report(metrics, checkpoint=checkpoint)
        self.last_metrics = metrics
        if self.logger is not None:
            self.logger.log(epoch, metrics)


def fit_loop(keras: Any, epochs: Epochs, seed: int) -> None:
    """tf-keras `model.fit` over all remaining epochs; a callback times, reports and checkpoints each."""
    cfg, steps = epochs.cfg, epochs.steps

    class ReportEachEpoch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):  # Keras counts epochs from 0
            epochs.begin(epoch + 1)
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            # tf.data prefetches inside fit's step function: data waits are not separable here (reported 0).
            epochs.end(epoch + 1, logs["loss"], steps * epochs.batch * epochs.local_replicas, steps, 0.0,
                       time.perf_counter() - self.start)

    class LogStepLoss(keras.callbacks.Callback):
        """Only added when step_loss is wanted: any batch hook makes Keras fetch the loss to the host."""

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch, self.seen, self.mean = epoch + 1, 0, 0.0

        def on_train_batch_end(self, batch, logs=None):
            # Called every tf_steps_per_execution steps with the epoch's running mean loss: the steps since
            # the last call had mean (mean_k * k - mean_j * j) / (k - j).
            done, mean = batch + 1, float(logs["loss"])
            window = (mean * done - self.mean * self.seen) / (done - self.seen)
            epochs.step_loss(self.epoch, done, window, since_step=self.seen)
            self.seen, self.mean = done, mean

    callbacks = [ReportEachEpoch()]
    if epochs.logger is not None and cfg.trainer.log_every_n_steps > 0:
        callbacks.append(LogStepLoss())

    def all_epochs(_):  # one dataset per epoch, each with its own shuffle seed, chained
        chained = None
        for epoch in range(epochs.start_epoch, cfg.trainer.epochs + 1):
            ds = epochs.dataset(epoch, seed)
            chained = ds if chained is None else chained.concatenate(ds)
        return chained

    # From a function: its batches are per replica (not re-batched by the strategy).
    distributed = epochs.strategy.distribute_datasets_from_function(all_epochs)
    epochs.model.fit(distributed, epochs=cfg.trainer.epochs, initial_epoch=epochs.start_epoch - 1,
                     steps_per_epoch=steps, callbacks=callbacks, verbose=0)


def custom_loop(keras: Any, epochs: Epochs, seed: int) -> bool:
    """`strategy.run` of a `tf.function` step with `GradientTape`; the per-example loss is averaged over the
    GLOBAL batch (per-replica batch x replicas): the all-reduce sums gradients, so this gives the mean.
    Stops mid-epoch on a STOP request (returns False) and continues from there on resume."""
    tf, strategy, model, steps = epochs.tf, epochs.strategy, epochs.model, epochs.steps
    global_batch = epochs.batch * strategy.num_replicas_in_sync
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=keras.losses.Reduction.NONE)

    @tf.function
    def step(iterator):
        def replica_step(images, labels):
            with tf.GradientTape() as tape:
                per_example = loss_fn(labels, model(images, training=True))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica_step, args=next(iterator)),
                               axis=None)  # the global batch's mean loss

    for epoch in range(epochs.start_epoch, epochs.cfg.trainer.epochs + 1):
        epochs.begin(epoch)
        done_before, loss_sum, train_before_s = epochs.resume_totals(epoch)
        iterator = iter(strategy.distribute_datasets_from_function(
            lambda _, e=epoch, skip=done_before: epochs.dataset(e, seed, skip)))
        start = time.perf_counter()
        for done in range(done_before + 1, steps + 1):
            loss = float(step(iterator))
            loss_sum += loss
            epochs.step_loss(epoch, done, loss)
            if epochs.should_stop(done):
                epochs.report_stop(epoch, done, loss_sum, train_before_s + time.perf_counter() - start)
                return False
        train_s = train_before_s + time.perf_counter() - start
        # `next(iterator)` runs inside the compiled step (prefetched): data waits are not separable (0).
        epochs.end(epoch, loss_sum / max(steps, 1), steps * epochs.batch * epochs.local_replicas, steps, 0.0,
                   train_s)
    return True


def train_loop_per_worker(config: dict[str, Any]) -> None:
    if os.environ.get("TF_USE_LEGACY_KERAS") != "1":
        raise RuntimeError("TF_USE_LEGACY_KERAS=1 must be in the worker's environment from process start "
                           "(build the trainer with trainers.tf_mwms.build_trainer)")
    import ray.train
    import tensorflow as tf

    cfg = OmegaConf.create(config["cfg"])
    strategy = make_strategy(tf, cfg.trainer)  # first: before any other TF op
    import tf_keras as keras

    rank = ray.train.get_context().get_world_rank()
    from trainers.models.keras_models import build_keras_model

    # Same initial weights everywhere and for every device layout: they are drawn outside the strategy, whose
    # variable creation uses up random ops differently (default vs Mirrored strategy), then copied in.
    keras.utils.set_random_seed(cfg.run.seed)
    initial = build_keras_model(cfg.model, keras, config["model_inputs"]).get_weights()
    with strategy.scope():
        model = build_compiled_model(keras, cfg, config["model_inputs"])
        model.set_weights(initial)
    state = restore_checkpoint(ray.train.get_checkpoint(), model, strategy)
    train = ShardArrays(ray.train.get_dataset_shard("train"), cfg.data.name)
    test = ShardArrays(ray.train.get_dataset_shard("eval"), cfg.data.name)
    epochs = Epochs(tf, strategy, model, cfg, config, state, train, test)
    seed = cfg.run.seed + 1000 * rank
    if epochs.start_epoch <= cfg.trainer.epochs:
        if cfg.trainer.tf_loop == "fit":
            fit_loop(keras, epochs, seed)
        elif not custom_loop(keras, epochs, seed):
            return  # stopped on request, with a checkpoint
    dump_weights(cfg.run.dump_params_dir, model, rank)


def dump_weights(directory: str | None, model: Any, rank: int) -> None:
    """`run.dump_params_dir`: this rank's final weights as `rank<r>.npz` (arrays in `model.get_weights()` order)."""
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        np.savez(Path(directory) / f"rank{rank}.npz", *model.get_weights())


def worker_resources(trainer: DictConfig) -> dict[str, float]:
    resources = {"CPU": float(trainer.threads_per_worker)}
    if trainer.use_gpu:
        resources["GPU"] = float(trainer.tf_devices)  # one GPU per replica
    return resources


def build_trainer(cfg: DictConfig, datasets: dict, run_id: str, tracking_uri: str, model_inputs: dict,
                  callbacks: list | None = None):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    from trainers.shard_data import OrderedShards

    return TensorflowTrainer(
        train_loop_per_worker,
        train_loop_config={"cfg": OmegaConf.to_container(cfg, resolve=True), "run_id": run_id,
                           "tracking_uri": tracking_uri, "model_inputs": model_inputs},
        scaling_config=ScalingConfig(num_workers=cfg.trainer.num_workers, use_gpu=cfg.trainer.use_gpu,
                                     resources_per_worker=worker_resources(cfg.trainer),
                                     placement_strategy=cfg.trainer.placement_strategy),
        run_config=RunConfig(name=f"run-{run_id}", storage_path=cfg.run.storage_path,
                             failure_config=FailureConfig(max_failures=cfg.fault.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2),
                             callbacks=list(callbacks or []),  # e.g. Tune's TuneReportCallback in a sweep
                             # tf-keras must own `tf.keras` from process start (module docstring); Ray
                             # starts the worker processes with these env vars (merged with the job's).
                             worker_runtime_env={"env_vars": {**LEGACY_KERAS_ENV, "TF_CPP_MIN_LOG_LEVEL": "2"}}),
        datasets=datasets,
        dataset_config=OrderedShards(dp=cfg.trainer.num_workers),  # ShardArrays always caches its shard
    )


def _log_model_task(uri: str, run_id: str, cfg_dict: dict, checkpoint: Any, model_inputs: dict) -> None:
    import mlflow
    import tensorflow as tf
    import tf_keras as keras

    cfg = OmegaConf.create(cfg_dict)
    model = build_compiled_model(keras, cfg, model_inputs)
    with checkpoint.as_directory() as directory:
        model.load_weights(os.path.join(directory, WEIGHTS))
    mlflow.set_tracking_uri(uri)
    mlflow.start_run(run_id=run_id, log_system_metrics=False)
    try:
        # Explicit requirements: MLflow's inference imports and scans modules, seconds for nothing here.
        mlflow.tensorflow.log_model(model, name="model", input_example=input_example(cfg, model_inputs),
                                    keras_model_kwargs={"save_format": "keras"},
                                    pip_requirements=[f"tensorflow=={tf.__version__}",
                                                      f"tf-keras=={keras.__version__}"])
    finally:
        mlflow.end_run()


def log_final_model(uri: str, run_id: str, cfg: DictConfig, checkpoint: Any, model_inputs: dict) -> None:
    """The final checkpoint's model, MLflow tensorflow (Keras) flavour. MLflow recognises Keras models via
    `tensorflow.keras`, which is tf-keras only with TF_USE_LEGACY_KERAS=1 from process start: so the model
    is logged from a Ray task started with that env var rather than from this (driver) process."""
    import ray

    task = ray.remote(num_cpus=1, runtime_env={"env_vars": {**LEGACY_KERAS_ENV, "TF_CPP_MIN_LOG_LEVEL": "2"}})(
        _log_model_task)
    ray.get(task.remote(uri, run_id, OmegaConf.to_container(cfg, resolve=True), checkpoint, model_inputs))
