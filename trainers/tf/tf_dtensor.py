"""TensorFlow DTensor (`trainer=tf_dtensor`) on Ray Train: data, model and 2D parallelism on a `batch x model`
device mesh spanning the Ray workers, one DTensor client per worker (trainers/tf/dtensor/clients.py connects them),
each with `trainer.devices_per_worker` devices (GPUs, or logical CPU devices).

An adapter on the shared loop (trainers/loop.py), so the metrics, checkpoints, stop/resume and MLflow logging are
every backend's. The model is a plain `tf.Module`, its spec's `dtensor` builder's (trainers/models/tf_modules.py:
the MLP, or the TF-IDF classifier for token data) whose `layers()` `parallelize_dtensor` lays out on the mesh
(trainers/tf/dtensor/): weights
sharded on `model` (Megatron's column/row pairs), batches on `batch`. Each step packs this worker's rows of the
batch onto its devices (`dtensor.pack`) and runs one `tf.function`; DTensor adds the collectives. The optimizer
is the recipe's, over the DTensor variables (trainers/tf/recipe.py `VariableOptimizer`).

Checkpoints hold whole values (`dtensor_model.npz`, `dtensor_optimizer.npz`: every sharded variable gathered,
rank 0 writes), so a run resumes on any mesh. The logged model is a Keras twin with these weights that loads
without a mesh. Token data is given to the model as TF-IDF vectors (the document frequencies are summed over the
workers' train shards before the first step); image and numeric features scaled, as every backend feeds them.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from omegaconf import DictConfig

from contract.metrics import PendingReduce, reduce_at_once
from contract.recipe import lr_factor, schedule_steps
from trainers.tf.adapter import TFProfiler, set_threads
from trainers.tf.backend import TFBackend, device_scaling
from trainers.tf.specs import mesh_dims
from trainers.tf.data import ShardArrays
from trainers.adapter import Adapter, WorkerData
from trainers.context import WorkerContext

MODEL_FILE, OPTIMIZER_FILE = "dtensor_model.npz", "dtensor_optimizer.npz"
EVAL_BATCH = 256  # rows per batch coordinate


class DTensorAdapter(Adapter):
    """The loop's adapter on the mesh. `trainer.batch_size` rows per batch coordinate: a global batch of
    batch_size x mesh.batch rows, of which this worker packs the rows of its own coordinates."""

    # The step's loss is a mean over the global batch sharded on the mesh, replicated on every device of every
    # client: the loop logs it as it is (an all-reduce per logged step would cost: benchmarks/README.md, tracking).
    loss_is_global = True

    def __init__(self, cfg: DictConfig, mesh: Any, model: Any, train: ShardArrays, evaluation: ShardArrays,
                 idf: np.ndarray | None):
        import tensorflow as tf

        from trainers.tf.recipe import VariableOptimizer

        trainer, dims = cfg.trainer, mesh.dims
        self.tf, self.mesh, self.model, self.train, self.evaluation, self.idf = tf, mesh, model, train, evaluation, idf
        self.bigram_buckets = cfg.model.get("bigram_buckets", 0)
        self.rank = mesh.client
        self.ranks_per_sample = dims.clients_per_group  # a model group's workers see the same rows
        self.batch_size = trainer.batch_size
        self.rows_per_step = trainer.batch_size * dims.coords_per_client
        if cfg.data.bucket_by_length:
            train.bucket_rows = self.rows_per_step
        self.steps = train.steps(self.rows_per_step, trainer.max_steps_per_epoch)
        self.seed = cfg.run.seed + 1000 * (self.rank // dims.clients_per_group)  # one shuffle per data shard
        self.load_s = train.load_s + evaluation.load_s
        self.lr, self.schedule = trainer.lr, trainer.lr_schedule
        self.warmup, self.total_updates = schedule_steps(trainer, self.steps)
        self.params = [v for v in model.weights() if v.trainable]
        self.optimizer = VariableOptimizer(tf, trainer, self.params, mesh.zeros_like)
        self.train_fn = tf.function(self._train_step)
        self.predict_fn = tf.function(lambda x: tf.argmax(model(x, training=False), axis=1))
        self.features = train.schema.features

    def _train_step(self, x: Any, y: Any, lr: Any, update: Any, seed: Any) -> Any:
        tf = self.tf
        with tf.GradientTape() as tape:
            logits = self.model(x, training=True, seed=seed)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        self.optimizer.apply(tape.gradient(loss, self.params), lr, update)
        return loss  # the global batch's mean

    def inputs(self, features: np.ndarray) -> np.ndarray:
        """Model inputs from stored rows: scaled features, or TF-IDF vectors of token ids."""
        if self.idf is None:
            return self.features.model_input(features)
        from trainers.models.tf_modules import tfidf_features

        return tfidf_features(features, self.idf, self.bigram_buckets).numpy()  # on this worker's CPU

    def steps_per_epoch(self) -> int:
        return self.steps

    def batches(self, epoch: int, skip: int) -> Iterator[Any]:
        order, rows = self.train.order(self.seed + epoch), self.rows_per_step
        for step in range(skip, self.steps):
            index = order[step * rows:(step + 1) * rows]
            yield (self.mesh.pack_batch(self.inputs(self.train.features[index]), self.batch_size),
                   self.mesh.pack_batch(self.train.labels[index], self.batch_size),
                   int(self.train.lengths[index].sum()))

    def train_step(self, batch: Any) -> tuple[float, int, int]:
        from tensorflow.experimental import dtensor

        x, y, tokens = batch
        updates, mesh = self.optimizer.updates, self.mesh
        lr = self.lr * lr_factor(updates, self.schedule, self.warmup, self.total_updates)
        seed = mesh.put(np.array([self.seed, updates], np.int32))  # dropout masks: one per step
        loss = self.train_fn(x, y, mesh.scalar(lr), mesh.scalar(float(updates + 1)), seed)
        self.optimizer.updates += 1
        return float(dtensor.unpack(loss)[0].numpy()), self.rows_per_step, tokens

    def evaluate(self, epoch: int) -> tuple[float, int]:
        """Every worker runs the same number of full batches (the mesh needs them): the last one padded."""
        rows, features, labels = EVAL_BATCH * self.mesh.dims.coords_per_client, self.evaluation.features, \
            self.evaluation.labels
        correct = 0
        for start in range(0, len(labels), rows):
            chunk = self.inputs(features[start:start + rows])
            padded = np.concatenate([chunk, np.zeros((rows - len(chunk), *chunk.shape[1:]), chunk.dtype)])
            predicted = self.mesh.local_rows(self.predict_fn(self.mesh.pack_batch(padded, EVAL_BATCH)))
            correct += int(np.sum(predicted[:len(chunk)] == labels[start:start + rows]))
        return correct, len(labels)

    def reduce(self, values: list[float], op: str) -> list[float]:
        return self.mesh.over_clients(values, op)

    def reduce_later(self, values: list[float], op: str) -> PendingReduce:
        return reduce_at_once(self.reduce, values, op)

    def epoch_extras(self) -> dict[str, float]:
        """The model sharding as it stands: bytes of weights on one device (1/model of the sharded ones)."""
        from trainers.tf.dtensor.mesh import device_bytes

        return {"device_weight_bytes": float(device_bytes(self.model.weights()))}

    def profiler(self, folder: str, steps: int) -> TFProfiler:
        return TFProfiler(self.tf, folder, steps)

    def whole_state(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(weights in `Classifier.weights` order, optimizer slots), gathered (collective)."""
        return ([self.mesh.whole(v) for v in self.model.weights()],
                [self.mesh.whole(s) for s in self.optimizer.slots()])

    def save(self, directory: str) -> None:
        weights, slots = self.whole_state()
        if self.rank == 0:
            extra = {} if self.idf is None else {"idf": self.idf}
            np.savez(os.path.join(directory, MODEL_FILE), *weights, **extra)
            np.savez(os.path.join(directory, OPTIMIZER_FILE), *slots, updates=self.optimizer.updates)

    def load(self, directory: str) -> None:
        with np.load(os.path.join(directory, MODEL_FILE)) as weights:
            for i, variable in enumerate(self.model.weights()):
                self.mesh.assign_whole(variable, weights[f"arr_{i}"])
        with np.load(os.path.join(directory, OPTIMIZER_FILE)) as state:
            for i, slot in enumerate(self.optimizer.slots()):
                self.mesh.assign_whole(slot, state[f"arr_{i}"])
            self.optimizer.updates = int(state["updates"])

    def dump(self, directory: str | None) -> None:
        """`run.dump_params_dir`: this rank's whole final weights as `rank<r>.npz` (collective)."""
        if directory:
            weights, _ = self.whole_state()
            Path(directory).mkdir(parents=True, exist_ok=True)
            np.savez(Path(directory) / f"rank{self.rank}.npz", *weights)


def shared_idf(mesh: Any, train: ShardArrays, vocab_size: int, bigram_buckets: int, replicas: int) -> np.ndarray:
    """The IDF of the whole train split: document frequencies summed over the workers' shards (a model group's
    workers hold the same shard: counted once)."""
    from trainers.models.tf_modules import document_frequencies, inverse_document_frequency

    df = document_frequencies(train.features, vocab_size, bigram_buckets)
    totals = np.array(mesh.over_clients([*df.tolist(), float(len(train.labels))], "sum")) / replicas
    return inverse_document_frequency(totals[:-1], totals[-1])


class DTensor(TFBackend):
    """trainer=tf_dtensor: one DTensor client per worker (trainers/tf/dtensor/clients.py connects them), the mesh
    over all their devices."""

    def run_worker(self, cfg: DictConfig, ctx: WorkerContext, data: WorkerData) -> bool:
        import tensorflow as tf

        set_threads(tf, cfg.trainer.threads_per_worker)  # before any other TF op
        return super().run_worker(cfg, ctx, data)

    def build_adapter(self, cfg: DictConfig, ctx: WorkerContext, data: WorkerData) -> DTensorAdapter:
        """The mesh, this worker's data, the model laid out on the mesh. TensorFlow's threads are set (`run_worker`)."""
        from trainers.models import build_module
        from trainers.tf.dtensor.mesh import DTensorMesh, parallelize_dtensor

        mesh = DTensorMesh(mesh_dims(cfg.trainer), ctx.rank, "GPU" if cfg.trainer.use_gpu else "CPU")
        train, evaluation = data.shards(cfg.run.seed)  # the adapter shuffles: one order per data shard
        tokens = data.inputs.features.kind == "tokens"
        idf = shared_idf(mesh, train, data.inputs.vocab_size, cfg.model.get("bigram_buckets", 0),
                         mesh.dims.clients_per_group) if tokens else None
        model = parallelize_dtensor(build_module(cfg.model, data.inputs, cfg.run.seed), mesh)
        return DTensorAdapter(cfg, mesh, model, train, evaluation, idf)

    def ray_setup(self, cfg: DictConfig, run_id: str) -> Any:
        from trainers.preflight import preflight_config
        from trainers.tf.dtensor.clients import DTensorClientsConfig

        return DTensorClientsConfig(preflight=preflight_config(cfg, run_id))

    def scaling_config(self, cfg: DictConfig) -> Any:
        return device_scaling(cfg)  # a GPU per mesh device

    def batch_group(self, cfg: DictConfig) -> int:
        """A model group spanning workers reads one data shard."""
        return mesh_dims(cfg.trainer).clients_per_group

    def model_from(self, keras: Any, cfg: Any, inputs: Any, directory: str) -> Any:
        """The Keras twin of the checkpoint's model (its spec's `keras_twin`), no mesh needed to load it."""
        from trainers.models import build_keras_twin
        from trainers.models.tf_modules import keras_weights

        model = build_keras_twin(cfg.model, keras, inputs)
        with np.load(os.path.join(directory, MODEL_FILE)) as saved:
            weights = [saved[f"arr_{i}"] for i in range(sum(name.startswith("arr_") for name in saved.files))]
            model.set_weights(keras_weights(weights, saved["idf"] if "idf" in saved.files else None))
        return model
