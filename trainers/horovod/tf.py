"""TensorFlow side of `trainer=horovod` (`trainer.framework=tf`): a custom step on `hvd.DistributedGradientTape`,
as an adapter on the shared loop (trainers/loop.py).

Keras: tf-keras, with the checkpoint format and logged-model flavour of tf_mwms (trainers/tf/adapter.py;
`TF_USE_LEGACY_KERAS=1` is put in the workers' environment by the backend's `worker_env`). Horovod's
Keras wrapper (`horovod.tensorflow.keras`) is not used: a custom loop needs none. No `tf.distribute` strategy: every
worker is a plain single-device TF process and Horovod does the all-reduce, so rank 0 alone writes checkpoints.
"""
from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

from omegaconf import DictConfig

from contract.metrics import AsyncReducer, PendingReduce
from trainers.adapter import WorkerData
from trainers.horovod.common import import_horovod, init_horovod, record_init
from trainers.context import WorkerContext
from trainers.tf.adapter import (KerasAdapter, build_compiled_model, compiled_steps, keras_loss, seed_dropout,
                                 set_threads)
from trainers.tf.backend import TFBackend, require_legacy_keras
from trainers.tf import recipe as tfr
from trainers.tf.data import EpochStream

METRICS_THREAD = "hvd-metrics"  # the thread that issues the metrics' all-reduces (benchmarks/tracking_overhead.py)


def tf_reduce_later(hvd: Any, tf: Any) -> AsyncReducer:
    """`AsyncReducer` over Horovod's TF allreduce (step losses, epoch metrics, the stop agreement). In eager TF
    `hvd.allreduce` blocks its caller until every rank has joined (there is no handle, unlike `allreduce_async` on
    the PyTorch side), so one thread of the adapter's own issues them, in the order they were asked for, while
    the training thread goes on; TF releases the GIL while the op waits."""
    ops = {"sum": hvd.Sum, "max": hvd.Max}
    calls = itertools.count()
    issuer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=METRICS_THREAD)

    def allreduce(values: list[float], op: str, name: str) -> list[float]:
        return hvd.allreduce(tf.constant(values, dtype=tf.float64), op=ops[op], name=name).numpy().tolist()

    def reduce_later(values: list[float], op: str) -> PendingReduce:
        # Named ops: every rank asks in the same order, so the same counter value names the same op.
        return issuer.submit(allreduce, list(values), op, f"metrics.{next(calls)}").result
    return reduce_later


def make_accumulating_step(hvd: Any, tf: Any, keras: Any, model: Any, cfg: DictConfig,
                           task: str) -> tuple[Any, Any]:
    """(`step(images, labels) -> loss`, `finish()`), both collective, for passes = k > 1 (`trainer.grad_accum`):
    gradients are accumulated locally (as the mean over k batches) and averaged over ranks with Horovod's grouped
    allreduce every k-th step, when the optimizer steps; `finish()` applies what is left at the end of an epoch
    (as the PyTorch side does). `DistributedGradientTape` has no `backward_passes_per_step`; Horovod's wrappers
    that do are for TF1 graph mode or Keras. The optimizer gets averaged gradients: its `global_clipnorm` clips the
    averaged norm. Without accumulation: `synced_step_of`."""
    loss_fn = keras_loss(keras, task)
    compression = hvd.Compression.fp16 if cfg.trainer.compression == "fp16" else hvd.Compression.none
    variables, optimizer = model.trainable_variables, model.optimizer
    passes = cfg.trainer.grad_accum
    sums = [tf.Variable(tf.zeros_like(v), trainable=False) for v in variables]
    pending = tf.Variable(0, dtype=tf.int64, trainable=False)  # batches accumulated since the last step

    def apply_sums():
        grads = hvd.grouped_allreduce([s.read_value() for s in sums], op=hvd.Average, compression=compression)
        optimizer.apply_gradients(zip(grads, variables))
        for total in sums:
            total.assign(tf.zeros_like(total))
        pending.assign(0)

    @tf.function
    def accumulating_step(images, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
            scaled = tfr.scaled_loss(optimizer, loss)
        grads = tfr.unscaled(optimizer, tape.gradient(scaled, variables))
        for total, share in zip(sums, tfr.accumulation_share(tf, grads, passes)):
            total.assign_add(share)
        pending.assign_add(1)
        if pending == passes:
            apply_sums()
        return loss

    @tf.function
    def finish():
        if pending > 0:
            apply_sums()

    return accumulating_step, finish


def synced_step_of(hvd: Any, tf: Any, keras: Any, model: Any, cfg: DictConfig, task: str) -> Any:
    """`step(images, labels) -> loss` (to be traced) without accumulation: forward, backward, gradients averaged
    over the ranks every step by `DistributedGradientTape`, the optimizer step."""
    loss_fn = keras_loss(keras, task)
    compression = hvd.Compression.fp16 if cfg.trainer.compression == "fp16" else hvd.Compression.none
    variables, optimizer = model.trainable_variables, model.optimizer

    def synced_step(images, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
            scaled = tfr.scaled_loss(optimizer, loss)  # fp16: loss scaling
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        optimizer.apply_gradients(zip(tfr.unscaled(optimizer, tape.gradient(scaled, variables)), variables))
        return loss
    return synced_step


class HorovodTFAdapter(KerasAdapter):
    """Rank 0's weights and optimizer variables become everyone's at the start (ranks draw different initial
    weights on purpose, so the broadcast is what aligns them) and again after a restore."""

    def __init__(self, hvd: Any, keras: Any, cfg: DictConfig, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.hvd = hvd
        self.stream = EpochStream(self.epoch_dataset, cfg.trainer.epochs, lambda make: iter(make()))
        task = self.train.schema.target.task
        if self.passes == 1:
            step, self.finish = synced_step_of(hvd, self.tf, keras, self.model, cfg, task), lambda: None
        else:
            step, self.finish = make_accumulating_step(hvd, self.tf, keras, self.model, cfg, task)
        # `trainer.tf_steps_per_execution` optimizer steps per call, in one graph loop: each step's allreduce ends
        # before the next step reads the weights, so the ranks issue Horovod's named ops in the same order
        self.several_steps = compiled_steps(self.tf, step)
        self.steps_per_call = cfg.trainer.tf_steps_per_execution * self.passes
        self._reduce_later = tf_reduce_later(hvd, self.tf)
        self.calls = 0  # steps since the epoch's (re)start: a stop lands on a multiple of `passes`
        self.model.optimizer.build(self.model.trainable_variables)
        self._broadcast()

    def _broadcast(self) -> None:
        self.hvd.broadcast_variables(self.model.variables, root_rank=0)
        self.hvd.broadcast_variables(self.model.optimizer.variables, root_rank=0)

    def load(self, directory: str) -> None:
        super().load(directory)
        self._broadcast()  # identical already when every rank restored the same file

    def batches(self, epoch: int, skip: int) -> Iterator[Any]:
        """The epoch's turns (`streamed_turns`): a step takes its batch from the stream's iterator inside the graph
        loop of `several_steps`."""
        self.calls = 0
        return self.streamed_turns(epoch, skip)

    def train_steps(self, batches: list[Any]) -> list[tuple[float, int, int]]:
        self.calls += len(batches)
        return super().train_steps(batches)

    def at_update_boundary(self) -> bool:
        return self.calls % self.passes == 0

    def finish_epoch(self) -> None:
        self.finish()

    def reduce_later(self, values: list[float], op: str) -> PendingReduce:
        return self._reduce_later(values, op)


class HorovodTF(TFBackend):
    """trainer=horovod, trainer.framework=tf: plain single-device TensorFlow workers joined by Horovod's Gloo
    rendezvous; the shared loop drives a custom step."""

    streams_files = True

    def ray_setup(self, cfg: DictConfig, run_id: str) -> Any:
        from trainers.horovod.rendezvous import RendezvousConfig
        from trainers.preflight import preflight_config

        return RendezvousConfig(preflight=preflight_config(cfg, run_id))

    def scaling_config(self, cfg: DictConfig) -> Any:
        from trainers.worker import scaling_config

        return scaling_config(cfg, use_gpu=False)  # Gloo CPU operations only

    def run_worker(self, cfg: DictConfig, ctx: WorkerContext, data: WorkerData) -> bool:
        """Threads, `hvd.init()`, then this worker's adapter on the shared loop. False: stopped on request."""
        require_legacy_keras()
        import tensorflow as tf

        set_threads(tf, cfg.trainer.threads_per_worker)  # first: TF fixes them at its first op
        hvd = import_horovod("tf")
        init_horovod(hvd, ctx.rank, ctx.world_size)
        record_init(cfg.run.dump_params_dir, ctx.rank)
        return super().run_worker(cfg, ctx, data)

    def build_adapter(self, cfg: DictConfig, ctx: WorkerContext, data: WorkerData) -> HorovodTFAdapter:
        """The model (its initial weights differ per rank on purpose: the broadcast must align them) and this rank's
        shard. TensorFlow's threads are set and Horovod is initialised (`run_worker`)."""
        import tensorflow as tf
        import tf_keras as keras

        hvd = import_horovod("tf")
        tfr.set_precision(keras, cfg.trainer.precision)
        keras.utils.set_random_seed(cfg.run.seed + ctx.rank)
        train, evaluation = data.shards(cfg.run.seed + 1000 * ctx.rank)
        steps = train.steps(cfg.trainer.batch_size, cfg.trainer.max_steps_per_epoch)  # for the LR schedule
        model = build_compiled_model(keras, cfg, data.inputs, steps_per_epoch=steps, seed=cfg.run.seed + ctx.rank)
        seed_dropout(tf, cfg.run.seed, ctx.rank)
        return HorovodTFAdapter(hvd, keras, cfg, tf, tf.distribute.get_strategy(), model, train, evaluation,
                                cfg.trainer.batch_size, ctx.rank, cfg.run.seed + 1000 * ctx.rank,
                                cfg.trainer.max_steps_per_epoch, grad_accum=cfg.trainer.grad_accum,
                                bucket_by_length=cfg.data.bucket_by_length)
