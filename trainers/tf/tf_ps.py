"""TensorFlow `ParameterServerStrategy` on Ray Train (`trainer=tf_ps`): asynchronous data parallelism. Every role
is a Ray Train worker (trainers/tf/ps/cluster.py: their TF_CONFIG, the board where the chief talks to the others,
the servers' processes): rank 0 the chief, then `trainer.num_ps`
parameter servers, then `trainer.num_workers` workers. The variables live on the parameter servers (split into
shards of at least `trainer.ps_min_shard_bytes`); each worker computes gradients on its own batches and applies
them there without waiting for the others.

- The chief runs the shared loop (trainers/loop.py) with a `ClusterCoordinator`: it schedules functions of
  `trainer.tf_steps_per_execution` steps (each one worker batch of `trainer.batch_size` rows) on whichever worker is
  free, two per worker ahead so the workers never wait for the chief, and hands the loop each step's loss in order.
  Or tf-keras `fit`, which drives the same coordinator (`trainer.tf_loop=fit`). The chief evaluates, checkpoints and
  reports.
- An epoch has no natural end when workers go at their own pace: here it is as many steps as the train split has
  batches (rows // batch_size), after which the chief waits for the scheduled steps and evaluates. Which worker
  takes a step is the coordinator's choice; each worker walks its own Ray Data shard pass after pass, pass k in
  the seeded order of epoch k (`shuffled_order`, as every backend), through one iterator for the attempt: a
  worker that took less than its share in an epoch goes on with its pass in the next, one that took more has
  begun its next pass. The step tells the chief which worker ran it, so a stopped epoch resumes every worker
  where it stopped.
- Parameter servers and workers run their TensorFlow server in a child process (trainers/tf/ps/server.py) that
  their Ray worker starts and watches: a worker server that dies is started again, and the coordinator gives its
  steps to the other workers meanwhile (the run goes on; back, the worker's dataset is rebuilt from its position
  at the attempt's start); a parameter server that dies, or the chief, ends the attempt and Ray
  Train restarts the run from its last checkpoint (`fault.max_failures`).
- Each worker writes its shard to a local folder; the dataset function (traced by the chief, run on the workers)
  reads the folder of the worker it runs on.
- Checkpoints are tf_mwms' (trainers/tf/adapter.py: `model.weights.h5`, `optimizer.npz`) with whole, unsharded
  values (written through an unpartitioned twin of the model), plus each worker's position in a stopped epoch.
"""
from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from omegaconf import DictConfig

from contract.data import FEATURE_DTYPES, LABEL_DTYPES, DataSchema, shuffled_order
from contract.console import say
from trainers.tf.adapter import (KerasAdapter, build_compiled_model, keras_loss, load_keras_state, save_keras_state,
                                 set_threads)
from trainers.tf.backend import KerasFit
from trainers.tf.data import ShardArrays, model_input_fn
from trainers.adapter import WorkerData
from trainers.context import WorkerContext
from trainers.tf.ps.cluster import CHIEF, FEATURES, LABELS, Chief, PublishedShards, board, serve, task_of_this_worker

POSITIONS = "ps_positions.json"  # a stopped epoch: where each worker is (beside tf_mwms' state files)

def whole_values(variables: list) -> list[np.ndarray]:
    """Variables as whole arrays, in order: the shards a partitioner made of one variable (named `<name>/part_<i>`,
    split along axis 0) joined again. What an unpartitioned model's `get_weights` gives."""
    groups: dict[str, list[np.ndarray]] = {}
    for variable in variables:
        groups.setdefault(variable.name.split("/part_")[0], []).append(variable.numpy())
    return [np.concatenate(parts) if len(parts) > 1 else parts[0] for parts in groups.values()]


def assign_whole(variables: list, values: list[np.ndarray]) -> None:
    """`whole_values` backwards: each whole array split along axis 0 over its variable's shards."""
    groups: dict[str, list] = {}
    for variable in variables:
        groups.setdefault(variable.name.split("/part_")[0], []).append(variable)
    for shards, value in zip(groups.values(), values, strict=True):
        ends = np.cumsum([shard.shape[0] for shard in shards])[:-1] if len(shards) > 1 else []
        for shard, part in zip(shards, np.split(value, ends) if len(shards) > 1 else [value]):
            shard.assign(part)


class PSAdapter(KerasAdapter):
    """The chief's adapter on the shared loop. `reduce` is the identity: the chief is the loop's only rank."""

    batch_hooks = False  # tf-keras refuses batch-level callbacks under ParameterServerStrategy

    def __init__(self, keras: Any, cfg: DictConfig, strategy: Any, coordinator: Any, model: Any, twin: Any,
                 shards: PublishedShards, evaluation: ShardArrays, inputs: DataSchema, ctx: WorkerContext):
        import tensorflow as tf

        trainer = cfg.trainer
        super().__init__(tf, strategy, model, shards, evaluation, trainer.batch_size, 0, cfg.run.seed,
                         trainer.max_steps_per_epoch)
        self.keras, self.coordinator, self.twin, self.shards = keras, coordinator, twin, shards
        self.inputs = inputs
        self.text = inputs.features.kind == "tokens"
        self.steps_per_call = trainer.tf_steps_per_execution  # steps a scheduled function runs on its worker
        self.in_flight = 2 * len(shards.rows)  # scheduled functions: enough that no worker waits for the chief
        self.stop_file, self.stop_every = ctx.stop_file, ctx.stop_check_every
        self.positions = [0] * len(shards.rows)  # batches each worker took in the current epoch
        self.cursors = [0] * len(shards.rows)  # rows each worker's stream has handed out, from its first pass on
        self.stream: Any = None  # the attempt's per-worker iterator, over all its epochs (`batches`)
        self.last_epoch = trainer.epochs
        self.pending: deque = deque()  # (scheduled function, its steps): their results to come
        self.rows: deque = deque()  # fetched results of steps the loop has not taken yet
        self.fitting = False  # Keras fit runs the epochs (no positions kept)
        self.steps_fn = tf.function(self._steps)

    def _steps(self, iterator: Any, count: Any) -> Any:
        """`count` steps on a worker, one after the other: float64 [count, 3], for each step its batch's mean loss,
        the real tokens in the batch and the worker's index. Several steps per scheduled function and one tensor
        back: the chief's cost is per function and per fetched tensor (benchmarks/README.md, ps_vs_mwms)."""
        tf, strategy, model = self.tf, self.strategy, self.model
        optimizer = model.optimizer
        loss_fn = keras_loss(self.keras, self.inputs.target.task, reduction=self.keras.losses.Reduction.NONE)

        def replica(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(loss_fn(y, model(x, training=True)))
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            return loss

        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        results = tf.TensorArray(tf.float64, size=count)
        for i in tf.range(count):
            x, y = next(iterator)
            loss = strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica, args=(x, y)), axis=None)
            tokens = tf.math.count_nonzero(x) if self.text else tf.constant(0, tf.int64)  # [PAD] is id 0
            results = results.write(i, tf.stack([tf.cast(value, tf.float64) for value in (loss, tokens, worker)]))
        return results.stack()

    def worker_dataset(self, orders: Any, skip: Any) -> Any:
        """Runs on a worker (traced by the chief): its shard in each order of `orders` [passes, rows] in turn
        (repeated: a worker may take more than its share), without its first `skip` rows, batched. Each batch cuts
        its row indices from the orders laid end to end and gathers its rows at once: tf.data's cost is per element,
        and single rows batched afterwards cost tf_ps a quarter of its throughput (benchmarks/README.md)."""
        tf = self.tf
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        folder = tf.gather(tf.constant(self.shards.folders), worker)
        features, target = self.inputs.features, self.inputs.target
        x = tf.reshape(tf.io.decode_raw(tf.io.read_file(folder + "/" + FEATURES), FEATURE_DTYPES[features.kind]),
                       [-1, features.width])
        y = tf.io.decode_raw(tf.io.read_file(folder + "/" + LABELS), LABEL_DTYPES[target.task])
        stream = tf.reshape(orders, [-1])
        length, batch, scale = tf.size(stream, tf.int64), self.batch_size, model_input_fn(tf, self.inputs)

        def rows(i: Any) -> Any:  # batch i: rows skip + i * batch onwards of the stream, repeated
            order = tf.gather(stream, tf.math.floormod(skip + i * batch + tf.range(batch, dtype=tf.int64), length))
            return scale(tf.gather(x, order)), tf.gather(y, order)
        return tf.data.Dataset.counter().map(rows).prefetch(2)

    def stream_iterator(self) -> Any:
        """The workers' iterators for the rest of the attempt. Worker i reads its shard in pass after pass, pass k in
        `shuffled_order(rows, seed + 1000 i + k)` (every backend's shard order, pass k for epoch k), from its
        `cursors[i]` (rows since the start of pass 1) on; batches run across passes. One iterator for every epoch,
        as the other custom TF loops read theirs (trainers/tf/data.EpochStream): dropping a tf.data iterator at an
        epoch's end may wait seconds for tf.data's autotuning thread (benchmarks/README.md, ps_vs_mwms and scaling).
        A worker's server started again reads its stream from the attempt's start."""
        tf, strategy = self.tf, self.strategy
        first = [cursor // rows + 1 for cursor, rows in zip(self.cursors, self.shards.rows)]
        passes = range(min(first), self.last_epoch + 2)  # a worker may run into the pass after the last epoch's
        orders = tf.constant(np.stack([np.stack([shuffled_order(rows, self.seed + 1000 * i + k) for k in passes])
                                       for i, rows in enumerate(self.shards.rows)]).astype(np.int32))
        starts = tf.constant([k - passes.start for k in first], tf.int64)
        skips = tf.constant([cursor % rows for cursor, rows in zip(self.cursors, self.shards.rows)], tf.int64)

        def dataset_fn(_: Any) -> Any:
            worker = tf.distribute.coordinator.experimental_get_current_worker_index()
            return self.worker_dataset(tf.gather(orders, worker)[tf.gather(starts, worker):],
                                       tf.gather(skips, worker))

        per_worker = tf.function(lambda: strategy.distribute_datasets_from_function(dataset_fn))
        return iter(self.coordinator.create_per_worker_dataset(per_worker))

    def batches(self, epoch: int, skip: int) -> Iterator[Any]:
        """Each step's result (loss, tokens, worker), in order, from functions of `steps_per_call` steps scheduled
        up to `in_flight` ahead. Once STOP exists, nothing is scheduled past the next step at which the loop checks
        it, so a stop leaves no step done beyond the ones it counts (`at_update_boundary`)."""
        if self.stream is None:
            if skip == 0:  # the attempt starts at this epoch: every worker at the start of its pass
                self.cursors = [(epoch - 1) * rows for rows in self.shards.rows]
            elif self.cursors is None:  # an older checkpoint's stopped epoch: each worker from its pass' start
                self.cursors = [(epoch - 1) * rows + steps * self.batch_size
                                for rows, steps in zip(self.shards.rows, self.positions)]
            self.stream = self.stream_iterator()
        if skip == 0:
            self.positions = [0] * len(self.positions)
        iterator, scheduled, pending, rows = self.stream, skip, self.pending, self.rows
        for step in range(skip, self.steps):
            if not rows:
                while scheduled < self.steps and len(pending) < self.in_flight \
                        and not (pending and self.stopping() and scheduled % self.stop_every == 0):
                    count = self.call_steps(scheduled)
                    pending.append((self.schedule(iterator, count), count))
                    scheduled += count
                rows.extend(self.fetch(iterator, *pending.popleft()))
            yield rows.popleft()

    def schedule(self, iterator: Any, count: int) -> Any:
        return self.coordinator.schedule(self.steps_fn, args=(iterator, self.tf.constant(count)))

    def fetch(self, iterator: Any, result: Any, count: int) -> list:
        """The rows of a scheduled function. The coordinator runs a function again when its worker dies while
        running it, but a finished function's result stays on its worker until fetched: when that worker dies
        first, the function is scheduled again (on a live worker) and its new result taken. The lost run's updates
        stay applied, as with any step run twice by this strategy (at least once). A fourth loss in a row ends the
        attempt."""
        for attempt in range(4):
            try:
                return result.fetch().tolist()
            except self.tf.errors.OpError as err:
                if not lost_with_its_worker(err) or attempt == 3:
                    raise  # a parameter server's failure, or no worker that stays: the attempt ends
                say(f"tf_ps: the result of {count} finished step(s) was lost with its worker; running them again")
                result = self.schedule(iterator, count)

    def call_steps(self, scheduled: int) -> int:
        """Steps of the next scheduled function: `steps_per_call`, fewer at the epoch's end and, once STOP exists,
        before the next step at which the loop checks it."""
        count = min(self.steps_per_call, self.steps - scheduled)
        if self.stopping():
            count = min(count, self.stop_every - scheduled % self.stop_every)
        return count

    def stopping(self) -> bool:
        return self.stop_file is not None and self.stop_file.exists()

    def train_step(self, batch: Any) -> tuple[float, int, int]:
        loss, tokens, worker = batch
        self.positions[int(worker)] += 1
        self.cursors[int(worker)] += self.batch_size
        return float(loss), self.batch_size, int(tokens)

    def at_update_boundary(self) -> bool:
        return not self.pending and not self.rows

    def reduce(self, values: list[float], op: str) -> list[float]:
        return list(values)

    def epoch_extras(self) -> dict[str, float]:
        """How the coordinator spread the epoch's steps over the workers (`ps_worker<i>_steps`; the custom loop)."""
        if self.fitting:
            return {}
        return {f"ps_worker{i}_steps": float(steps) for i, steps in enumerate(self.positions)}

    def epoch_tokens(self, epoch: int) -> np.ndarray:
        return np.zeros(self.steps, dtype=np.int64)  # fit: no token data (trainers/tf/specs.py check_tf_ps)

    def fit(self, first_epoch: int, epochs: int, callbacks: list) -> None:
        """tf-keras `fit` with the coordinator, `steps` per epoch: each worker repeats its shard in one seeded order
        (fit resumes at epoch ends only, so positions are not kept)."""
        tf, self.fitting = self.tf, True

        def dataset_fn(_: Any) -> Any:
            worker = tf.distribute.coordinator.experimental_get_current_worker_index()
            rows = tf.gather(tf.constant(self.shards.rows, tf.int64), worker)
            order = tf.random.experimental.stateless_shuffle(tf.range(rows), seed=[self.seed, worker])
            return self.worker_dataset(order[tf.newaxis], tf.constant(0, tf.int64))

        self.model.fit(self.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=epochs,
                       initial_epoch=first_epoch - 1, steps_per_epoch=self.steps, callbacks=callbacks, verbose=0)

    def evaluate(self, epoch: int) -> tuple[float, int]:
        """On the unpartitioned twin, given the parameter servers' values once: the model itself reads each of its
        variables from a parameter server again at every batch."""
        self.twin.set_weights(whole_values(self.model.weights))
        return self.evaluate_model(self.twin)

    def save(self, directory: str) -> None:
        """tf_mwms' state files with whole values, through the unpartitioned twin; where a stopped epoch left the
        workers (their steps in it, and where their streams are)."""
        self.twin.set_weights(whole_values(self.model.weights))
        self.twin.optimizer.set_weights([self.tf.convert_to_tensor(v).numpy() for v in self.model.optimizer.variables])
        save_keras_state(directory, self.twin)
        Path(directory, POSITIONS).write_text(json.dumps({"positions": self.positions, "cursors": self.cursors}))

    def load(self, directory: str) -> None:
        load_keras_state(directory, self.twin, self.tf.distribute.get_strategy())
        assign_whole(self.model.weights, self.twin.get_weights())
        self.build_optimizer()
        for variable, value in zip(self.model.optimizer.variables, self.twin.optimizer.variables, strict=True):
            variable.assign(value)
        positions = Path(directory, POSITIONS)  # absent from a tf_mwms checkpoint: a worker starts its epoch afresh
        if positions.exists():
            saved = json.loads(positions.read_text())
            if isinstance(saved, list):  # before streams (2026-11-27): the steps of the stopped epoch only
                self.positions, self.cursors = saved, None
            else:
                self.positions, self.cursors = saved["positions"], saved["cursors"]

    def build_optimizer(self) -> None:
        """The optimizer's slots on the parameter servers (sharded like their variables) and the twin's."""
        with self.strategy.scope():
            self.model.optimizer.build(self.model.trainable_variables)
        self.twin.optimizer.build(self.twin.trainable_variables)

    def dump(self, directory: str | None) -> None:
        """`run.dump_params_dir`: the final weights, whole, as `rank0.npz`."""
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            np.savez(Path(directory) / "rank0.npz", *whole_values(self.model.weights))


def lost_with_its_worker(error: Exception) -> bool:
    """Whether a fetch failed because the worker holding the result is gone or was replaced: the coordinator's own
    test for a worker failure (private in TF 2.21, which is pinned), by which it runs a closure again: the error
    names a worker and no parameter server, and is one a dead or restarted server gives."""
    from tensorflow.python.distribute.coordinator.cluster_coordinator import _is_worker_failure

    return _is_worker_failure(error)


def make_strategy(tf: Any, trainer: DictConfig) -> tuple[Any, Any]:
    """(ParameterServerStrategy over TF_CONFIG's cluster, its ClusterCoordinator): variables split by
    `MinSizePartitioner` into at most `num_ps` shards of at least `ps_min_shard_bytes`. Connecting waits for
    every server of the cluster to answer."""
    set_threads(tf, trainer.threads_per_worker)
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=trainer.ps_min_shard_bytes, max_shards=trainer.num_ps)
    strategy = tf.distribute.ParameterServerStrategy(tf.distribute.cluster_resolver.TFConfigClusterResolver(),
                                                     variable_partitioner=partitioner)
    return strategy, tf.distribute.coordinator.ClusterCoordinator(strategy)


class ParameterServers(KerasFit):
    """trainer=tf_ps: every role a Ray Train worker (rank 0 the chief, then the parameter servers, then the
    workers); the chief alone runs the loop."""

    def train_loop_per_worker(self, config: dict[str, Any]) -> None:
        """The chief runs the loop; every other role serves (trainers/tf/ps/cluster.py)."""
        from contract.console import import_tensorflow
        from contract.tracking import run_dir
        from trainers.worker import dataset_shards, ray_context, watch_for_hangs, worker_config, worker_inputs

        import_tensorflow()  # first, with its start-up lines filtered
        cfg = worker_config(config)
        ctx = ray_context(config, cfg, every_rank_trains=False)  # the servers run no loop
        inputs = worker_inputs(config)
        kind, index = task_of_this_worker()
        if kind != CHIEF:
            serve(cfg, ctx, inputs, kind, index)
            return
        chief = Chief(board())

        def shards(seed: int) -> tuple[PublishedShards, ShardArrays]:
            # Rank 0's request makes every rank's shards of a split (Ray Train V2): the chief asks for the train
            # split too
            (_, eval_shard), waited_s = dataset_shards("train", "eval")
            evaluation = ShardArrays(eval_shard, inputs)
            evaluation.load_s += waited_s
            return chief.shards(cfg.trainer.num_workers), evaluation
        try:
            # The chief alone runs the loop: its own hang watcher, as the one rank of the run.
            progress = watch_for_hangs(cfg.fault, run_dir(cfg.run.storage_path, config["run_id"]), 0, 1)
            self.run_worker(cfg, chief.context(ctx, cfg.fault, progress), WorkerData(inputs, shards))
        finally:
            chief.post("done")

    def build_adapter(self, cfg: DictConfig, ctx: WorkerContext, data: WorkerData) -> PSAdapter:
        """The chief's adapter: the shards the workers published and its evaluation shard (`data.shards`), the strategy
        (before any other TF op), then the model on the parameter servers with the same initial weights as tf_mwms'
        (drawn outside any strategy), and its unpartitioned twin."""
        import tensorflow as tf

        shards, evaluation = data.shards(cfg.run.seed)  # the adapter shuffles each worker's pass itself
        strategy, coordinator = make_strategy(tf, cfg.trainer)
        import tf_keras as keras

        from trainers.models import build_keras_model

        inputs = data.inputs
        keras.utils.set_random_seed(cfg.run.seed)
        initial = build_keras_model(cfg.model, keras, inputs, seed=cfg.run.seed).get_weights()
        # Dropout: tf-keras' default ops take their seeds when the chief traces a step, and each worker's kernels start
        # from them: worker i's k-th step drew worker j's k-th masks (tests/unit/test_loop_backends.py). With a
        # tf.random.Generator per layer, made under the strategy, its state is on a parameter server and every step
        # draws on from it. What it costs (the masks come from the parameter server): benchmarks/README.md ps_vs_mwms.
        keras.backend.experimental.enable_tf_random_generator()
        steps = shards.steps(cfg.trainer.batch_size, cfg.trainer.max_steps_per_epoch)
        with strategy.scope():
            model = build_compiled_model(keras, cfg, inputs, cfg.trainer.tf_steps_per_execution, steps)
            assign_whole(model.weights, initial)
        twin = build_compiled_model(keras, cfg, inputs, steps_per_epoch=steps)
        adapter = PSAdapter(keras, cfg, strategy, coordinator, model, twin, shards, evaluation, inputs, ctx)
        adapter.build_optimizer()
        return adapter

    def ray_setup(self, cfg: DictConfig, run_id: str) -> Any:
        from trainers.preflight import preflight_config
        from trainers.tf.ps.cluster import PSClusterConfig

        return PSClusterConfig(num_ps=cfg.trainer.num_ps, preflight=preflight_config(cfg, run_id))

    def scaling_config(self, cfg: DictConfig) -> Any:
        """Every role. Ray gives each worker of a run the same resources: the run takes `num_workers x
        threads_per_worker` CPUs (what its workers compute with; the chief and the parameter servers mostly wait),
        split evenly over all its Ray workers."""
        from ray.train import ScalingConfig

        from contract.config import layout_of

        trainer = cfg.trainer
        world = layout_of(trainer).ray_workers
        return ScalingConfig(num_workers=world, use_gpu=False, placement_strategy=trainer.placement_strategy,
                             resources_per_worker={"CPU": trainer.num_workers * trainer.threads_per_worker / world})

    def dataset_config(self, cfg: DictConfig) -> Any:
        from trainers.data_split import RoleSplit

        return RoleSplit(workers=cfg.trainer.num_workers)
