"""What the Keras backends' adapters share (tf_mwms, tf_ps, horovod tf): the tf-keras model, its recipe and state
files, and `KerasAdapter`, the base of their adapters on the shared loop (trainers/loop.py).

Which Keras: tf-keras (Keras 2). Keras 3 `model.fit` under MultiWorkerMirroredStrategy with 2 workers crashes
(`Attempt to convert a value (PerReplica:...)`, keras-team/keras#20585, tensorflow#72388, open upstream);
tf-keras is the maintained Keras 2 package released with every TF version, and its `fit` works under MWMS
unpatched. One Keras for every TF loop keeps one checkpoint format and one logged-model flavour. tf-keras only
takes over `tf.keras` (and TF's distribute code paths) when `TF_USE_LEGACY_KERAS=1` is in the environment
before the process imports TensorFlow, so trainers pass LEGACY_KERAS_ENV through
`RunConfig(worker_runtime_env=...)`: Ray starts the worker processes with it. Setting it later is too late.
TensorFlow is imported inside functions for that reason, and nothing here imports torch.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from contract.data import DataSchema
from contract.metrics import PendingReduce, reduce_at_once
from trainers.adapter import Adapter
from trainers.tf.data import EVAL_BATCH, TrainArrays

LEGACY_KERAS_ENV = {"TF_USE_LEGACY_KERAS": "1"}
WEIGHTS, OPTIMIZER = "model.weights.h5", "optimizer.npz"


def set_threads(tf: Any, threads: int) -> None:
    """Before any other TF op (TF fixes them at its first)."""
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)


def seed_dropout(tf: Any, seed: int, stream: int) -> None:
    """Seed TF's random ops of training (dropout), once the model is built, as trainers/torch/adapter.seed_dropout
    does for torch: each worker (`stream`: its rank) draws its own masks. Every worker sets the same global seed
    for the initial weights, and the ops of a function traced afterwards take their seeds from the global one."""
    tf.random.set_seed(seed + 1000 * stream)


def local_devices(tf: Any, count: int, use_gpu: bool) -> list[str]:
    """`count` local device names: GPUs, or the CPU split into logical devices (tests, GPU-less machines)."""
    if use_gpu:
        gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
        if len(gpus) < count:
            raise RuntimeError(f"trainer.devices_per_worker={count} but this worker sees {len(gpus)} GPUs")
        return gpus[:count]
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    return [d.name for d in tf.config.list_logical_devices("CPU")][:count]


def input_example(inputs: DataSchema) -> np.ndarray:
    """Two all-zero inputs of the model's shape (for MLflow's signature): token ids, or scaled features."""
    if inputs.features.kind == "tokens":
        return np.zeros((2, inputs.max_len), dtype=np.int32)
    return np.zeros((2, inputs.features.width), dtype=np.float32)


def keras_loss(keras: Any, task: str, **kwargs: Any) -> Any:
    """The training loss of a task (PyTorch's: trainers/torch/recipe.py `task_loss`): cross-entropy of the logits
    and class ids, or the mean squared error of the predictions [B, 1] and the targets."""
    if task == "regression":
        return keras.losses.MeanSquaredError(**kwargs)
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, **kwargs)


def batch_score(outputs: np.ndarray, labels: np.ndarray, regression: bool) -> float:
    """A batch's evaluation score: its correct predictions, or its summed squared errors."""
    if regression:
        return float(np.sum((outputs.reshape(labels.shape) - labels) ** 2))
    return float(np.sum(np.argmax(outputs, axis=1) == labels))


def build_compiled_model(keras: Any, cfg: Any, inputs: DataSchema, steps_per_execution: int = 1,
                         steps_per_epoch: int = 1, seed: int | None = None) -> Any:
    """The Keras model of `cfg.model` compiled with the trainer's recipe optimizer (trainers/tf/recipe.py; its
    LR schedule spans `trainer.epochs` epochs of `steps_per_epoch` batches). `steps_per_execution` > 1 only
    matters to `fit` (tf_mwms' and tf_ps' `trainer.tf_steps_per_execution`). The dtype policy (`set_precision`) is
    the caller's: the logged model is built in float32."""
    from trainers.models import build_keras_model

    model = build_keras_model(cfg.model, keras, inputs, seed)
    compile_model(keras, cfg, inputs, model, steps_per_execution, steps_per_epoch)
    return model


def compile_model(keras: Any, cfg: Any, inputs: DataSchema, model: Any, steps_per_execution: int = 1,
                  steps_per_epoch: int = 1) -> None:
    """`model` compiled with the trainer's recipe optimizer and the task's loss (see `build_compiled_model`)."""
    from trainers.tf.recipe import make_optimizer

    optimizer = make_optimizer(keras, cfg.trainer, model.trainable_variables, steps_per_epoch)
    model.compile(optimizer=optimizer, loss=keras_loss(keras, inputs.target.task),
                  # Several steps per tf.function call (fit): cuts the per-step host overhead of the strategy.
                  steps_per_execution=steps_per_execution)


def optimizer_state(optimizer: Any) -> tuple[Any, list]:
    """(the optimizer whose `variables` a checkpoint keeps, further variables it keeps). Those variables start
    with `iterations`, the LR schedule's position. fp16's LossScaleOptimizer keeps its dynamic loss scale and
    growth counter apart from its inner optimizer's variables (as PyTorch's GradScaler state is kept beside the
    optimizer's), and cannot `set_weights` itself (tf-keras 2.21 never marks the wrapper built)."""
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is None:
        return optimizer, []
    return inner, [optimizer._loss_scale.current_loss_scale, optimizer.dynamic_counter]


def save_keras_state(directory: str, model: Any) -> None:
    """Native Keras weights file + the optimizer's variables (Keras' own `save_own_variables` store)."""
    model.save_weights(os.path.join(directory, WEIGHTS))
    optimizer, extra = optimizer_state(model.optimizer)
    store: dict[str, np.ndarray] = {}
    optimizer.save_own_variables(store)  # keys "0", "1", ...
    store.update({f"loss_scale_{i}": variable.numpy() for i, variable in enumerate(extra)})
    np.savez(os.path.join(directory, OPTIMIZER), **store)


def load_keras_state(directory: str, model: Any, strategy: Any) -> None:
    """Weights and optimizer state written by `save_keras_state`; the optimizer's slots are created under
    `strategy` (mirrored where it mirrors). Built before `load_weights`, which also reads the optimizer
    variables the weights file holds: for an unbuilt fp16 LossScaleOptimizer, its variable-count warning
    raises instead (tf-keras 2.21 formats `self.name`, which that wrapper lacks)."""
    optimizer, extra = optimizer_state(model.optimizer)
    with strategy.scope():
        optimizer.build(model.trainable_variables)
    model.load_weights(os.path.join(directory, WEIGHTS))
    with np.load(os.path.join(directory, OPTIMIZER)) as store, strategy.scope():
        optimizer.set_weights([store[str(i)] for i in range(sum(key.isdigit() for key in store.files))])
        for i, variable in enumerate(extra):
            variable.assign(store[f"loss_scale_{i}"])


def compiled_steps(tf: Any, step: Callable[[Any, Any], Any]) -> Any:
    """`steps(iterator, count) -> losses`: `count` calls of `step(images, labels) -> loss` (traced) in one compiled
    call, each on the iterator's next batch (a graph loop, as Keras `fit` runs its `steps_per_execution`), their
    losses in order: the custom loops' steps (horovod tf; tf_mwms without accumulation)."""
    @tf.function
    def steps(iterator, count):
        losses = tf.TensorArray(tf.float32, size=count)
        for i in tf.range(count):
            images, labels = next(iterator)
            losses = losses.write(i, tf.cast(step(images, labels), tf.float32))
        return losses.stack()
    return steps


class TFProfiler:
    """TensorFlow's profiler over `steps` training steps after one warmup step (the first pays tracing and
    compilation): an XPlane trace in `<folder>/plugins/profile/<time>/<host>.xplane.pb`, for TensorBoard's Profile
    tab (`pip install tensorboard tensorboard-plugin-profile`, then `tensorboard --logdir <folder>`)."""

    def __init__(self, tf: Any, folder: str, steps: int):
        self.tf, self.folder, self.steps, self.taken, self.recording = tf, folder, steps, 0, False

    def start(self) -> None:
        pass  # at the end of the warmup step

    def step(self) -> bool:
        self.taken += 1
        if self.taken == 1:
            self.tf.profiler.experimental.start(self.folder)
            self.recording = True
        return self.taken > self.steps  # the warmup step and `steps` recorded ones

    def stop(self) -> None:
        if self.recording:
            self.tf.profiler.experimental.stop()
            self.recording = False


class KerasAdapter(Adapter):
    """What the TF adapters share: evaluation, state files, tokens per step, memory. Subclasses give `batches`,
    `reduce`, and `several_steps` or `train_step`, and with `grad_accum` > 1 the update boundaries (one optimizer
    step per `passes` batches, the rest of an epoch applied by `finish_epoch`)."""

    batch_hooks = True  # Keras fit may call batch-level callbacks (trainers/tf/keras_fit.py)
    several_steps: Any = None  # a custom loop's `compiled_steps` (up to `steps_per_call` a call), where it has them

    def __init__(self, tf: Any, strategy: Any, model: Any, train: TrainArrays, evaluation: TrainArrays,
                 batch_size: int, rank: int, seed: int, max_steps: int | None, local_replicas: int = 1,
                 save_on_every_rank: bool = False, grad_accum: int = 1, bucket_by_length: bool = False):
        self.tf, self.strategy, self.model, self.train, self.evaluation = tf, strategy, model, train, evaluation
        self.batch_size, self.rank, self.seed, self.local_replicas = batch_size, rank, seed, local_replicas
        self.passes = grad_accum
        self.rows_per_step = batch_size * local_replicas  # this worker's rows per step, over its replicas
        if bucket_by_length:
            train.bucket_rows = self.rows_per_step
        self.steps = train.steps(self.rows_per_step, max_steps)
        self.save_on_every_rank = save_on_every_rank
        self.load_s = train.load_s + evaluation.load_s
        self.eval_batches: Iterator[Any] | None = None

    def steps_per_epoch(self) -> int:
        return self.steps

    def epoch_dataset(self, epoch: int, skip: int = 0) -> Any:
        """The epoch's per-replica batches for this worker (`steps` for each of its replicas), without those of
        the first `skip` steps."""
        return self.train.dataset(self.tf, self.batch_size, seed=self.seed, epoch=epoch,
                                  steps=self.steps * self.local_replicas, skip=skip * self.local_replicas)

    def epoch_tokens(self, epoch: int) -> np.ndarray:
        return self.train.step_tokens(self.rows_per_step, self.seed, self.steps, epoch)

    def streamed_turns(self, epoch: int, skip: int) -> Iterator[tuple[Iterator[Any], int]]:
        """The custom loops' (tf_mwms custom, horovod tf): the epoch's steps after its first `skip`, each the
        iterator of their `EpochStream` (`self.stream`) to take that step's batch from, and the batch's real
        tokens."""
        tokens = self.epoch_tokens(epoch)[skip:]
        for iterator, count in zip(self.stream.turns(epoch, skip, len(tokens)), tokens):
            yield iterator, int(count)

    def train_step(self, batch: Any) -> tuple[float, int, int]:
        """One step: a call of one step of `several_steps` (an adapter without them gives its own)."""
        if self.several_steps is None:
            raise NotImplementedError
        return self.train_steps([batch])[0]

    def train_steps(self, batches: list[Any]) -> list[tuple[float, int, int]]:
        """Consecutive turns of the epoch's stream (`streamed_turns`) in one call of `several_steps`, where the
        adapter has them; else `train_step` of each."""
        if self.several_steps is None:
            return super().train_steps(batches)
        iterator = batches[0][0]  # each turn names the same iterator
        losses = self.several_steps(iterator, self.tf.constant(len(batches))).numpy()
        return [(float(loss), self.rows_per_step, tokens) for loss, (_, tokens) in zip(losses, batches)]

    def evaluate(self, epoch: int) -> tuple[float, int]:
        return self.evaluate_model(self.model)  # the local replica's (synchronised) weights

    def evaluate_model(self, model: Any) -> tuple[float, int]:
        """One pass of `model` over the evaluation set, from one iterator over it repeated, kept for the attempt:
        an iterator made and dropped at every evaluation would lengthen each epoch's end, its destructor waiting for
        tf.data's autotuning thread (as `EpochStream`'s; benchmarks/README.md, scaling.py)."""
        if self.eval_batches is None:
            self.eval_batches = iter(self.evaluation.dataset(self.tf, EVAL_BATCH).repeat())
        score, regression = 0.0, self.evaluation.schema.target.task == "regression"
        rows = self.evaluation.rows
        for _ in range(-(-rows // EVAL_BATCH)):  # the batches of one pass
            features, labels = next(self.eval_batches)
            outputs = model(features, training=False)
            score += batch_score(outputs.numpy(), labels.numpy(), regression)
        return score, rows

    def reduce_later(self, values: list[float], op: str) -> PendingReduce:
        return reduce_at_once(self.reduce, values, op)  # TF's collectives are called synchronously here

    def profiler(self, folder: str, steps: int) -> TFProfiler:
        return TFProfiler(self.tf, folder, steps)

    def save(self, directory: str) -> None:
        if self.rank == 0 or self.save_on_every_rank:
            save_keras_state(directory, self.model)

    def load(self, directory: str) -> None:
        load_keras_state(directory, self.model, self.strategy)

    def dump(self, directory: str | None) -> None:
        """`run.dump_params_dir`: this rank's final weights as `rank<r>.npz` (in `model.get_weights()` order)."""
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            np.savez(Path(directory) / f"rank{self.rank}.npz", *self.model.get_weights())


def compiled_model_from(keras: Any, cfg: Any, inputs: DataSchema, directory: str) -> Any:
    """The Keras model a tf_mwms, tf_ps or horovod tf checkpoint in `directory` holds, for inference: its weights
    are loaded before it is compiled, so the optimizer variables the weights file also holds are not read (into a
    fresh, unbuilt optimizer they would only be skipped, with a warning)."""
    from trainers.models import build_keras_model

    model = build_keras_model(cfg.model, keras, inputs)
    model.load_weights(os.path.join(directory, WEIGHTS))
    compile_model(keras, cfg, inputs, model)
    return model
