"""TensorFlow `MultiWorkerMirroredStrategy` on Ray Train (`DataParallelTrainer` with `MirroredConfig`, which sets
each worker's `TF_CONFIG` as `TensorflowTrainer` does: trainers/tf/tf_config.py).

Two loops, one contract (`trainer.tf_loop`): the shared loop (trainers/loop.py) driving a custom step
(`strategy.run` of a `tf.function` with `GradientTape`; stops mid-epoch on STOP), or tf-keras `model.fit` with a
callback that hands each epoch to the same loop's `end_epoch` (metrics, checkpoint, report, MLflow).
`trainer.devices_per_worker > 1` gives a worker several replicas: its GPUs, or logical CPU devices (one worker:
`MirroredStrategy`, one machine). Keras: tf-keras, see trainers/tf/adapter.py. The training recipe (optimizer, LR
schedule, clipping, precision): trainers/tf/recipe.py; gradient accumulation: `MirroredAdapter` (custom loop) and
`accumulating_train_step` (fit), the same arithmetic.
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np
from omegaconf import DictConfig

from contract.recipe import updates_per_epoch
from trainers.tf.adapter import (KerasAdapter, build_compiled_model, compiled_steps, keras_loss, local_devices,
                                 seed_dropout, set_threads)
from trainers.tf.backend import KerasFit, device_scaling
from trainers.tf.data import EpochStream, chained_epochs
from trainers.tf import recipe as tfr
from trainers.adapter import WorkerData
from trainers.context import WorkerContext

def make_strategy(tf: Any, trainer: DictConfig) -> Any:
    """Threads, then the strategy: it must exist before any other TF op ("Collective ops must be configured
    at program startup")."""
    set_threads(tf, trainer.threads_per_worker)
    if trainer.num_workers == 1:
        if trainer.tf_strategy == "central_storage":  # variables on one device (the CPU), computed on the others
            devices = local_devices(tf, trainer.devices_per_worker, trainer.use_gpu)
            return tf.distribute.experimental.CentralStorageStrategy(compute_devices=devices)
        if trainer.devices_per_worker > 1:
            devices = local_devices(tf, trainer.devices_per_worker, trainer.use_gpu)
            return tf.distribute.MirroredStrategy(devices=devices,
                                                  cross_device_ops=cross_device_ops(tf, trainer.tf_cross_device_ops))
        # One replica: nothing to mirror or all-reduce; TF's default strategy has the same API without the
        # per-step collective machinery of MWMS (benchmarks/README.md, tf_vs_bare).
        return tf.distribute.get_strategy()
    impl = {"auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
            "ring": tf.distribute.experimental.CommunicationImplementation.RING,
            "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL}[trainer.tf_communication]
    options = tf.distribute.experimental.CommunicationOptions(implementation=impl)
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)


def cross_device_ops(tf: Any, name: str) -> Any:
    """How MirroredStrategy sums the replicas' gradients in one worker (`trainer.tf_cross_device_ops`): auto is
    TensorFlow's choice (NCCL between GPUs where it can)."""
    return {"auto": None, "nccl": tf.distribute.NcclAllReduce(),
            "hierarchical_copy": tf.distribute.HierarchicalCopyAllReduce(),
            "reduce_to_one": tf.distribute.ReductionToOneDevice()}[name]


class MirroredAdapter(KerasAdapter):
    """The loop's adapter under a strategy. The per-example loss is averaged over the GLOBAL batch (per-replica
    batch x replicas): the all-reduce sums gradients, so this gives the mean. Every worker writes the
    checkpoint files: saving under a strategy must not be rank-dependent.

    Gradient accumulation (`passes` batches per optimizer step): each replica adds its batches' shares to its own
    sums (SyncOnRead variables: no all-reduce until the update, like DDP's no_sync); every `passes`-th batch the
    optimizer all-reduces the sums, clips and steps. Whole groups of `passes` batches run in one compiled call
    (`_grouped_steps`), the steps of a call that begins or ends inside a group one per call, Python picking which
    of two compiled steps runs: a `tf.cond` around `apply_gradients` fails under MirroredStrategy (a RuntimeError
    from its merge_call in the branch)."""

    # The step returns the sum over replicas of their losses over the global batch: the loop logs it as it is (an
    # eager all-gather per logged step cost a fifth of a small model's training: benchmarks/README.md, tracking).
    loss_is_global = True

    def __init__(self, keras: Any, world_size: int, last_epoch: int, *args: Any, steps_per_call: int = 1,
                 **kwargs: Any):
        super().__init__(*args, save_on_every_rank=True, **kwargs)
        self.keras, self.world_size = keras, world_size
        # From a function: its batches are per replica (not re-batched by the strategy).
        self.stream = EpochStream(self.epoch_dataset, last_epoch, lambda make: iter(
            self.strategy.distribute_datasets_from_function(lambda _: make())))
        self.pending = 0  # batches accumulated since the last optimizer step
        self.sums = self._accumulators()
        if self.sums:  # whole groups per call; a group's remaining batches one per call (see above)
            self.update_step = self._make_step(keras, apply=True)
            self.accumulate_step = self._make_step(keras, apply=False)
            self.group_steps = self._grouped_steps(keras)
        else:
            self.several_steps = compiled_steps(self.tf, self._global_step(keras, apply=True))
        # `trainer.tf_steps_per_execution` optimizer steps per call, as `fit` runs them
        self.steps_per_call = steps_per_call * self.passes
        self.finish_step = self.tf.function(lambda: self.strategy.run(self._apply_sums))
        # Compiled once per length of what it gathers: called eagerly, the strategy's all-gather traces a function
        # of its own at every call (TF's retracing warning, every epoch's end)
        self.gather_rows = self.tf.function(
            lambda rows: self.strategy.gather(self.strategy.run(lambda: rows), axis=0))

    def _accumulators(self) -> list:
        tf = self.tf
        if self.passes == 1:
            return []
        with self.strategy.scope():
            return [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                synchronization=tf.VariableSynchronization.ON_READ,
                                aggregation=tf.VariableAggregation.SUM) for v in self.model.trainable_variables]

    def _apply_sums(self) -> None:
        """In a replica context: one optimizer step on the accumulated sums (all-reduced by the optimizer)."""
        self.model.optimizer.apply_gradients(zip([s.read_value() for s in self.sums], self.model.trainable_variables))
        for total in self.sums:
            total.assign(self.tf.zeros_like(total))

    def _global_step(self, keras: Any, apply: bool) -> Any:
        """`step(images, labels) -> loss` (to be traced): every replica's step on its batch (`_replica_step`), the
        global batch's mean loss."""
        tf, strategy, replica_step = self.tf, self.strategy, self._replica_step(keras, apply)
        return lambda images, labels: strategy.reduce(
            tf.distribute.ReduceOp.SUM, strategy.run(replica_step, args=(images, labels)), axis=None)

    def _replica_step(self, keras: Any, apply: bool) -> Any:
        """One replica's step on its batch: its share of the global batch's mean loss, backward, and the optimizer
        step (with accumulation: the batch's share added to the sums, the step only when `apply`)."""
        tf, strategy, model, optimizer = self.tf, self.strategy, self.model, self.model.optimizer
        variables = model.trainable_variables
        global_batch = self.batch_size * strategy.num_replicas_in_sync
        loss_fn = keras_loss(keras, self.evaluation.schema.target.task, reduction=keras.losses.Reduction.NONE)

        def replica_step(images, labels):
            with tf.GradientTape() as tape:
                per_example = loss_fn(labels, model(images, training=True))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
                scaled = tfr.scaled_loss(optimizer, loss)
            grads = tfr.unscaled(optimizer, tape.gradient(scaled, variables))
            if not self.sums:
                optimizer.apply_gradients(zip(grads, variables))
                return loss
            for total, share in zip(self.sums, tfr.accumulation_share(tf, grads, self.passes)):
                total.assign_add(share)
            if apply:
                self._apply_sums()
            return loss
        return replica_step

    def _make_step(self, keras: Any, apply: bool) -> Any:
        """One accumulating step per call, its batch taken from the iterator inside the graph."""
        step = self._global_step(keras, apply)

        @self.tf.function
        def one_step(iterator):
            images, labels = next(iterator)
            return step(images, labels)
        return one_step

    def _grouped_steps(self, keras: Any) -> Any:
        """`groups(iterator, count) -> losses`: `count` whole accumulation groups in one compiled call, each
        `passes - 1` accumulating steps then the updating one, every step on the iterator's next batch; the
        losses in order. Two step loops rather than one step under a `tf.cond` on its position (see above)."""
        tf, passes = self.tf, self.passes
        accumulate, update = self._global_step(keras, apply=False), self._global_step(keras, apply=True)

        @tf.function
        def groups(iterator, count):
            losses = tf.TensorArray(tf.float32, size=count * passes)
            for group in tf.range(count):
                first = group * passes
                for i in tf.range(passes - 1):
                    images, labels = next(iterator)
                    losses = losses.write(first + i, tf.cast(accumulate(images, labels), tf.float32))
                images, labels = next(iterator)
                losses = losses.write(first + passes - 1, tf.cast(update(images, labels), tf.float32))
            return losses.stack()
        return groups

    def batches(self, epoch: int, skip: int) -> Iterator[Any]:
        """The epoch's turns (`streamed_turns`): the step takes its batch from the stream's iterator inside its
        graph (a batch handed in from Python is Python work on every step: benchmarks/README.md, scaling.py)."""
        return self.streamed_turns(epoch, skip)

    def train_steps(self, batches: list[Any]) -> list[tuple[float, int, int]]:
        """Consecutive turns in as few calls as accumulation allows: the steps that complete a group begun
        before, the whole groups in one call of `group_steps`, the steps of a group left open one by one."""
        if not self.sums:
            return super().train_steps(batches)
        lead = min(len(batches), -self.pending % self.passes)
        whole = (len(batches) - lead) // self.passes * self.passes
        results = [self.train_step(batch) for batch in batches[:lead]]
        if whole:
            iterator = batches[0][0]  # each turn names the same iterator
            losses = self.group_steps(iterator, self.tf.constant(whole // self.passes)).numpy()
            results += [(float(loss), self.rows_per_step, tokens) for loss, (_, tokens) in zip(losses, batches[lead:])]
        return results + [self.train_step(batch) for batch in batches[lead + whole:]]

    def train_step(self, batch: Any) -> tuple[float, int, int]:
        """One step: without accumulation, a call of one step of `several_steps`; with it, the accumulating or
        the updating compiled step, by the batch's place in its group."""
        if not self.sums:
            return super().train_step(batch)
        iterator, tokens = batch
        self.pending += 1
        if self.pending == self.passes:
            loss, self.pending = self.update_step(iterator), 0
        else:
            loss = self.accumulate_step(iterator)
        return float(loss), self.rows_per_step, tokens

    def at_update_boundary(self) -> bool:
        return self.pending == 0

    def finish_epoch(self) -> None:
        if self.pending:  # an epoch that is not a multiple of `passes`: step on what has accumulated
            self.finish_step()
            self.pending = 0

    def fit_steps(self) -> int:
        """Keras `fit` steps per epoch: one per optimizer step (with accumulation, a group of batches)."""
        return updates_per_epoch(self.steps, self.passes)

    def fit_dataset(self, epoch: int) -> Any:
        """The epoch for `fit`: per-replica batches, or with accumulation per-replica groups [g, batch, ...] of
        g <= passes consecutive batches (an epoch's last group may be short)."""
        ds = self.epoch_dataset(epoch)
        if self.passes == 1:
            return ds
        tf = self.tf
        # Batches go to the replicas in turn (step s of replica r is element s * replicas + r): stack each step's,
        # group `passes` steps, then hand each replica its own [g, batch, ...] in the same turns.
        swap = lambda t: tf.transpose(t, [1, 0, *range(2, t.shape.rank)])  # noqa: E731
        ds = ds.batch(self.local_replicas, drop_remainder=True).batch(self.passes)
        return ds.flat_map(lambda x, y: tf.data.Dataset.from_tensor_slices((swap(x), swap(y))))

    def fit(self, first_epoch: int, epochs: int, callbacks: list) -> None:
        """tf-keras `model.fit` over epochs `first_epoch`..`epochs` (1-based) of this worker's data."""
        if self.passes > 1:
            self.model.train_step = accumulating_train_step(self.tf, self.model, self.passes)
        # The loss metric is synchronized across the workers already; tf-keras' default ("auto": "sum" off TPUs)
        # adds it up once more over the workers in each batch's logs (step_loss twice the loss with 2 workers).
        self.model.distribute_reduction_method = "first"

        distributed = self.strategy.distribute_datasets_from_function(
            lambda _: chained_epochs(self.fit_dataset, first_epoch, epochs))
        self.model.fit(distributed, epochs=epochs, initial_epoch=first_epoch - 1, steps_per_epoch=self.fit_steps(),
                       callbacks=callbacks, verbose=0)

    def reduce(self, values: list[float], op: str) -> list[float]:
        rows = self._gather(values)
        return (rows.sum(axis=0) if op == "sum" else rows.max(axis=0)).tolist()

    def _gather(self, values: list[float]) -> np.ndarray:
        """[world_size, len(values)]: every worker's values (an all-gather across workers)."""
        if self.world_size == 1 and self.local_replicas == 1:
            return np.array([values])
        rows = self.gather_rows(self.tf.constant([values], dtype=self.tf.float32)).numpy()
        return rows[::self.local_replicas]  # one row per replica, replicas grouped by worker


def accumulating_train_step(tf: Any, model: Any, passes: int) -> Any:
    """Keras `fit`'s step for a group [g, batch, ...] of g <= passes batches (`fit_dataset`): g forward and
    backward passes summing the batches' shares, then one optimizer step (it all-reduces, clips and steps). The
    same arithmetic as the custom loop's accumulation; `compute_loss` gives each batch to fit's loss metric, so
    fit still reports the mean loss per batch."""
    def train_step(data):
        images, labels = data
        variables, optimizer = model.trainable_variables, model.optimizer

        def one_batch(i, sums):
            with tf.GradientTape() as tape:
                # the replica's mean loss / replicas (Keras scales it for the strategy's gradient sum)
                loss = model.compute_loss(y=labels[i], y_pred=model(images[i], training=True))
                scaled = tfr.scaled_loss(optimizer, loss)
            grads = tfr.unscaled(optimizer, tape.gradient(scaled, variables))
            return i + 1, [total + share for total, share in zip(sums, tfr.accumulation_share(tf, grads, passes))]

        # An explicit while_loop: with steps_per_execution > 1, fit traces a `for i in tf.range(...)` here
        # unconverted by AutoGraph ("Iterating over a symbolic tf.Tensor is not allowed").
        zeros = [tf.zeros(v.shape, v.dtype) for v in variables]
        _, sums = tf.while_loop(lambda i, _: i < tf.shape(labels)[0], one_batch, (tf.constant(0), zeros))
        optimizer.apply_gradients(zip(sums, variables))
        return model.get_metrics_result()
    return train_step


class MWMS(KerasFit):
    """trainer=tf_mwms: MultiWorkerMirroredStrategy over the workers (each worker's TF_CONFIG:
    trainers/tf/tf_config.py), a replica per device."""

    streams_files = True

    def build_adapter(self, cfg: DictConfig, ctx: WorkerContext, data: WorkerData,
                      strategy: Any = None) -> MirroredAdapter:
        """The strategy first (before any other TF op; `strategy`: one made already, for a second model in the same
        process), the precision policy, then the model inside the strategy."""
        import tensorflow as tf

        if strategy is None:
            strategy = make_strategy(tf, cfg.trainer)
        import tf_keras as keras

        from trainers.models import build_keras_model

        trainer, rank, world_size = cfg.trainer, ctx.rank, ctx.world_size
        tfr.set_precision(keras, trainer.precision)
        # Same initial weights everywhere and for every device layout: they are drawn outside the strategy, whose
        # variable creation uses up random ops differently (default vs Mirrored strategy), then copied in.
        keras.utils.set_random_seed(cfg.run.seed)
        initial = build_keras_model(cfg.model, keras, data.inputs, seed=cfg.run.seed).get_weights()
        # devices_per_worker under MirroredStrategy, else 1
        local_replicas = strategy.num_replicas_in_sync // world_size
        train, evaluation = data.shards(cfg.run.seed + 1000 * rank)
        steps = train.steps(trainer.batch_size * local_replicas, trainer.max_steps_per_epoch)  # for the LR schedule
        with strategy.scope():
            model = build_compiled_model(keras, cfg, data.inputs, trainer.tf_steps_per_execution, steps)
            model.set_weights(initial)
        seed_dropout(tf, cfg.run.seed, rank)  # before the training step is traced
        return MirroredAdapter(keras, world_size, trainer.epochs, tf, strategy, model, train, evaluation,
                               trainer.batch_size, rank, cfg.run.seed + 1000 * rank, trainer.max_steps_per_epoch,
                               local_replicas, grad_accum=trainer.grad_accum,
                               bucket_by_length=cfg.data.bucket_by_length,
                               steps_per_call=trainer.tf_steps_per_execution)

    def ray_setup(self, cfg: DictConfig, run_id: str) -> Any:
        """TensorflowConfig's TF_CONFIG, without TensorFlow in Ray Train's controller (or in the driver)."""
        from trainers.preflight import preflight_config
        from trainers.tf.tf_config import MirroredConfig

        return MirroredConfig(preflight=preflight_config(cfg, run_id))

    def scaling_config(self, cfg: DictConfig) -> Any:
        return device_scaling(cfg)  # a GPU per replica
