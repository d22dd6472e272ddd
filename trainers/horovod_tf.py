"""TensorFlow side of `trainer=horovod` (`trainer.framework=tf`): a custom loop on `hvd.DistributedGradientTape`.

Keras: tf-keras, for the same reasons and with the same checkpoint format and logged-model flavour as tf_mwms
(`TF_USE_LEGACY_KERAS=1` is put in the workers' environment by `trainers.horovod.build_trainer`). Horovod's
Keras wrapper (`horovod.tensorflow.keras`) is not used: its optimizer wrapper is untested with Keras 3 and a
custom loop needs none. No `tf.distribute` strategy: every worker is a plain single-device TF process and Horovod
does the all-reduce, so checkpoints are written by rank 0 only.
"""
from __future__ import annotations

import itertools
import os
import tempfile
import time
from typing import Any

import numpy as np
from omegaconf import DictConfig

from trainers import torch_common as tc
from trainers.horovod import import_horovod, init_horovod, record_init
from trainers.tf_mwms import EVAL_BATCH, ShardArrays, build_compiled_model, dump_weights, restore_checkpoint, \
    save_checkpoint


def tf_reducer(hvd: Any, tf: Any) -> tc.Reducer:
    """`torch_common.Reducer` over Horovod's TF allreduce, so both frameworks share the epoch metrics code."""
    ops = {"sum": hvd.Sum, "max": hvd.Max}
    calls = itertools.count()

    def reduce(values: list[float], op: str) -> list[float]:
        reduced = hvd.allreduce(tf.constant(values, dtype=tf.float64), op=ops[op], name=f"metrics.{next(calls)}")
        return reduced.numpy().tolist()
    return reduce


def make_train_step(hvd: Any, tf: Any, keras: Any, model: Any, cfg: DictConfig) -> tuple[Any, Any]:
    """(`step(images, labels) -> loss`, `finish()`), both collective. passes == 1: `DistributedGradientTape`
    averages the gradients over ranks every step. passes = k > 1: gradients are accumulated locally (as the mean
    over k batches) and averaged over ranks with Horovod's grouped allreduce every k-th step, when the optimizer
    steps; `finish()` applies what is left at the end of an epoch (as the PyTorch side does).
    `DistributedGradientTape` has no `backward_passes_per_step`; Horovod's wrappers that do are for TF1 graph
    mode or Keras."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    compression = hvd.Compression.fp16 if cfg.trainer.compression == "fp16" else hvd.Compression.none
    variables, optimizer = model.trainable_variables, model.optimizer
    passes = cfg.trainer.backward_passes_per_step

    @tf.function
    def synced_step(images, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    if passes == 1:
        return synced_step, lambda: None
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
        for total, grad in zip(sums, tape.gradient(loss, variables)):
            total.assign_add(grad / passes)
        pending.assign_add(1)
        if pending == passes:
            apply_sums()
        return loss

    @tf.function
    def finish():
        if pending > 0:
            apply_sums()

    return accumulating_step, finish


def run_epoch(step: Any, finish: Any, dataset: Any, passes: int, stats: tc.EpochStats,
              on_step: Any = None, should_stop: Any = None) -> tc.EpochStats:
    """One pass (continuing `stats` of a half-done epoch); the batch wait (tf.data iterator) is timed separately
    from the whole step. Like `torch_common.train_epoch`: `on_step(loss)` per batch, and `should_stop(batches)`
    asked only between optimizer steps (a checkpoint must not drop half-accumulated gradients)."""
    iterator = iter(dataset)
    start = time.perf_counter()
    while True:
        wait_start = time.perf_counter()
        batch = next(iterator, None)
        stats.data_wait_s += time.perf_counter() - wait_start
        if batch is None:
            break
        images, labels = batch
        loss = float(step(images, labels))
        if on_step is not None:
            on_step(loss)
        stats.loss_sum += loss * int(labels.shape[0])
        stats.samples += int(labels.shape[0])
        stats.steps += 1
        if stats.steps % passes == 0 and should_stop is not None and should_stop(stats.steps):
            stats.stopped = True
            break
    if not stats.stopped:
        finish()
    stats.train_s += time.perf_counter() - start
    return stats


def count_correct(tf: Any, model: Any, test: ShardArrays) -> tuple[int, int]:
    correct = 0
    for images, labels in test.dataset(tf, EVAL_BATCH):
        logits = model(images, training=False)
        correct += int(np.sum(np.argmax(logits.numpy(), axis=1) == labels.numpy()))
    return correct, len(test.labels)


def report(model: Any, epoch: int, metrics: dict, rank: int, checkpoint_state: dict | None = None) -> None:
    """Rank 0 writes the checkpoint (tf_mwms' format); the others report metrics only. `checkpoint_state`:
    what the checkpoint records when it is not `metrics` of `epoch` (`report_stop`)."""
    import ray.train

    if rank != 0:
        ray.train.report(metrics, checkpoint=None)
        return
    saved = checkpoint_state or {"epoch": epoch, "metrics": metrics, "partial": None}
    with tempfile.TemporaryDirectory() as directory:
        save_checkpoint(directory, model, saved["epoch"], saved["metrics"], saved["partial"])
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))


def report_stop(model: Any, epoch: int, stats: tc.EpochStats, last_metrics: dict | None, rank: int) -> None:
    """Checkpoint a half-done epoch after a stop request (torch_common's `partial` layout); the driver sees
    `stopped_at_epoch` and marks the run as stopped."""
    from dataclasses import asdict

    stopped = {"stopped_at_epoch": float(epoch), "stopped_at_step": float(stats.steps)}
    report(model, epoch, stopped, rank, checkpoint_state={
        "epoch": epoch - 1, "metrics": last_metrics, "partial": {"epoch": epoch, "stats": asdict(stats)}})


def restore_and_broadcast(hvd: Any, tf: Any, model: Any) -> dict | None:
    """Restore the checkpoint (if any) on every rank, create the optimizer's slots, then make rank 0's weights
    and optimizer variables everyone's (they are identical already when all ranks restored the same file; on a
    fresh start this is what makes the initial weights identical)."""
    import ray.train

    state = restore_checkpoint(ray.train.get_checkpoint(), model, tf.distribute.get_strategy())
    model.optimizer.build(model.trainable_variables)  # no-op when the restore built it
    hvd.broadcast_variables(model.variables, root_rank=0)
    hvd.broadcast_variables(model.optimizer.variables, root_rank=0)
    return state


def tf_loop(config: dict[str, Any], cfg: DictConfig) -> None:
    if os.environ.get("TF_USE_LEGACY_KERAS") != "1":
        raise RuntimeError("TF_USE_LEGACY_KERAS=1 must be in the worker's environment from process start "
                           "(build the trainer with trainers.horovod.build_trainer)")
    import ray.train
    import tensorflow as tf

    # Threads first: TF fixes them at its first op. Inter-op >= 2 so an op blocked in an allreduce cannot starve
    # the others (same precaution as tf_mwms).
    tf.config.threading.set_intra_op_parallelism_threads(cfg.trainer.threads_per_worker)
    tf.config.threading.set_inter_op_parallelism_threads(cfg.trainer.threads_per_worker + 1)
    hvd = import_horovod("tf")
    rank, world_size = init_horovod(hvd)
    record_init(cfg.run.dump_params_dir, rank)
    import tf_keras as keras

    keras.utils.set_random_seed(cfg.run.seed + rank)  # different on purpose: the broadcast must align them
    model = build_compiled_model(keras, cfg, config["model_inputs"])
    state = restore_and_broadcast(hvd, tf, model)
    start_epoch, partial = tc.resume_point(state)
    last_metrics = None if state is None else state["metrics"]
    train = ShardArrays(ray.train.get_dataset_shard("train"), cfg.data.name)
    test = ShardArrays(ray.train.get_dataset_shard("eval"), cfg.data.name)
    batch, seed = cfg.trainer.batch_size, cfg.run.seed + 1000 * rank
    steps = train.steps(batch, cfg.trainer.max_steps_per_epoch)
    logger = tc.rank0_logger(config, rank, state)
    tc.tag_worker_node(config, rank)
    (step, finish), reduce = make_train_step(hvd, tf, keras, model, cfg), tf_reducer(hvd, tf)
    should_stop = tc.StopCheck(cfg.run.resume_dir, reduce=reduce)

    for epoch in range(start_epoch, cfg.trainer.epochs + 1):
        tc.maybe_inject_failure(cfg.fault, epoch, rank, world_size)
        stats = tc.epoch_start(partial, epoch)
        on_step = tc.step_loss_logger(logger, cfg.trainer.log_every_n_steps, epoch, steps, done=stats.steps)
        dataset = train.dataset(tf, batch, seed=seed + epoch, steps=steps).skip(stats.steps)
        stats = run_epoch(step, finish, dataset, cfg.trainer.backward_passes_per_step, stats, on_step, should_stop)
        if stats.stopped:
            report_stop(model, epoch, stats, last_metrics, rank)
            return
        correct, total = count_correct(tf, model, test)
        metrics = tc.epoch_metrics(stats, correct, total, reduce=reduce)
        if epoch == start_epoch:
            metrics["data_load_s"] = train.load_s + test.load_s
        report(model, epoch, metrics, rank)
        last_metrics = metrics
        if logger is not None:
            logger.log(epoch, metrics)
    dump_weights(cfg.run.dump_params_dir, model, rank)
