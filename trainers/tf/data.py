"""TensorFlow input from a worker's data shard: the Ray Data shard pulled into memory once as numpy
(`ShardArrays`), each epoch a `tf.data` pipeline over it in a fixed shuffled order, and an attempt's epochs read
through one iterator (`EpochStream`). Shared by every TensorFlow backend; imports no TensorFlow itself (the
adapters hand it in, once tf-keras owns `tf.keras`)."""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import numpy as np

from contract.data import LABEL_DTYPES, DataSchema, bucketed_order, shuffled_order
from trainers.worker import dataset_shards

LOAD_BATCH = 8192  # rows per Ray Data batch when pulling a shard into memory


class ShardArrays:
    """This worker's Ray Data shard, pulled once into memory as numpy (same reason as
    `trainers.torch.data.ShardBatches`: re-streaming Parquet every epoch is slower than the model trains).
    Features [N, width] as workers hold them (contract/data.py FEATURE_DTYPES: uint8 images and float32 values,
    scaled per batch in `dataset`; int32 token ids, with their `lengths`: real tokens per row), labels int64 class
    ids or float32 targets. `shard`: anything with Ray's `iter_batches`."""

    def __init__(self, shard: Any, schema: DataSchema):
        start = time.perf_counter()
        self.schema = schema
        self._concat(shard.iter_batches(batch_size=LOAD_BATCH, batch_format="numpy"))
        self.load_s = time.perf_counter() - start

    @classmethod
    def from_columns(cls, columns: dict[str, np.ndarray], schema: DataSchema) -> "ShardArrays":
        """A shard already in memory (in-process tests): what pulling a Ray Data shard gives."""
        arrays = cls.__new__(cls)
        arrays.schema, arrays.load_s = schema, 0.0
        arrays._concat([columns])
        return arrays

    def _concat(self, batches: Any) -> None:
        features, labels, lengths = [], [], []
        stored, target = self.schema.features, self.schema.target
        for batch in batches:
            features.append(stored.stored(batch[stored.column]))
            labels.append(np.asarray(batch[target.column], dtype=LABEL_DTYPES[target.task]))
            lengths.append(np.asarray(batch[stored.length_column], dtype=np.int64) if stored.length_column
                           else np.zeros(len(features[-1]), dtype=np.int64))
        self.features, self.labels = np.concatenate(features), np.concatenate(labels)
        self.lengths = np.concatenate(lengths)  # zeros for images: no tokens to count
        # Rows per step when shuffled epochs are grouped by length (`data.bucket_by_length`, set by the adapter;
        # the batches keep their stored width, so only the order changes: the same one as PyTorch's); 0: off.
        self.bucket_rows = 0
        self._tensors: tuple[Any, Any] | None = None  # features and labels in TensorFlow, once asked for

    def steps(self, batch_size: int, max_steps: int | None) -> int:
        # Every worker must run the same number of steps (each is a collective): Ray's DataConfig splits
        # with equal=True (same rows per worker), and only full batches are used.
        steps = len(self.labels) // batch_size
        return min(steps, max_steps) if max_steps else steps

    def order(self, seed: int | None) -> np.ndarray:
        """Row order of an epoch: shuffled by `seed` (in `bucketed_order` when `bucket_rows` is set), or as stored
        when None."""
        rows = len(self.labels)
        if seed is None:
            return np.arange(rows)
        order = shuffled_order(rows, seed)
        return bucketed_order(order, self.lengths, self.bucket_rows, seed) if self.bucket_rows else order

    def step_tokens(self, rows_per_step: int, seed: int, steps: int) -> np.ndarray:
        """Real tokens in each of an epoch's `steps` steps of `rows_per_step` rows (in `order(seed)`)."""
        return self.lengths[self.order(seed)][:steps * rows_per_step].reshape(steps, rows_per_step).sum(axis=1)

    def tensors(self, tf: Any) -> tuple[Any, Any]:
        """The shard's features and labels as TensorFlow tensors, made once: every epoch's dataset gathers its
        batches from them, so an attempt's chained epochs (`chained_epochs`) hold one copy of the shard, not one
        per epoch."""
        if self._tensors is None:
            with tf.device("/CPU:0"):  # host memory, as tf.data's own copies were (not a GPU's, where one is seen)
                self._tensors = (tf.constant(self.features), tf.constant(self.labels))
        return self._tensors

    def dataset(self, tf: Any, batch_size: int, seed: int | None = None, steps: int | None = None) -> Any:
        """One epoch as a `tf.data.Dataset` of (features, labels [B]); shuffled with `seed` (per epoch) when
        given. TF's auto-sharding is off: Ray already gave each worker its shard."""
        ds = tf.data.Dataset.from_tensor_slices(self.order(seed))
        ds = ds.batch(batch_size, drop_remainder=steps is not None)
        if steps is not None:
            ds = ds.take(steps)
        features, labels = self.tensors(tf)
        ds = ds.map(lambda rows: (tf.gather(features, rows), tf.gather(labels, rows)))
        scale = model_input_fn(tf, self.schema)
        ds = ds.map(lambda x, y: (scale(x), y))
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        # tf.data's default graph rewrites, made when an iterator opens, copy the shard into every epoch's part of
        # a chained dataset (tests/unit/test_tf_recipe.py counts the memory); a pipeline this small gains nothing
        # from them, and reads faster without (benchmarks/README.md).
        options.experimental_optimization.apply_default_optimizations = False
        return ds.with_options(options).prefetch(2)


def model_input_fn(tf: Any, schema: DataSchema) -> Callable[[Any], Any]:
    """Stored features [B, width] -> what the model takes: images and values scaled to float32, token ids int32."""
    if schema.features.kind == "tokens":
        return lambda x: tf.cast(x, tf.int32)
    divisor, mean, std = schema.features.scaling()
    if divisor == 1.0:
        return lambda x: (tf.cast(x, tf.float32) - mean) / std
    return lambda x: (tf.cast(x, tf.float32) / divisor - mean) / std


def ray_arrays(schema: DataSchema) -> tuple[ShardArrays, ShardArrays]:
    """This worker's train and eval arrays (Ray Train dataset shards "train" and "eval")."""
    (train_shard, eval_shard), waited_s = dataset_shards("train", "eval")
    train, evaluation = ShardArrays(train_shard, schema), ShardArrays(eval_shard, schema)
    train.load_s += waited_s
    return train, evaluation


def chained_epochs(epoch_dataset: Callable[[int], Any], first: int, last: int) -> Any:
    """`epoch_dataset(e)` for epochs `first`..`last` (`first` at least), each with its own shuffle, one after the
    other: Keras `fit` and `EpochStream` read an attempt's epochs through one iterator."""
    chained = epoch_dataset(first)
    for epoch in range(first + 1, last + 1):
        chained = chained.concatenate(epoch_dataset(epoch))
    return chained


class EpochStream:
    """A custom loop's batches, an attempt's epochs read through one iterator, each epoch in its own order. An
    iterator made and dropped every epoch cost seconds at some epochs' ends, and the other workers waited in the
    next collective: the iterator's destructor waits for tf.data's autotuning thread (benchmarks/README.md,
    scaling.py). `open_iterator(make)` opens an iterator over the dataset
    `make()` builds (the strategy's distributed one, or a plain one)."""

    def __init__(self, epoch_dataset: Callable[[int, int], Any], last_epoch: int,
                 open_iterator: Callable[[Callable[[], Any]], Iterator[Any]]):
        self.epoch_dataset, self.last_epoch, self.open_iterator = epoch_dataset, last_epoch, open_iterator
        self.iterator: Iterator[Any] | None = None
        self.next_epoch = 0  # the epoch the open iterator is at, once the previous one was read to its end

    def turns(self, epoch: int, skip: int, count: int) -> Iterator[Iterator[Any]]:
        """The epoch's `count` steps after its first `skip`, each the iterator to take that step's batch from
        (exactly one, in Python or inside a compiled step): the open iterator when it is at this epoch, else (an
        attempt's first epoch, a resumed one, or one past `last_epoch`, which only a caller with its own epoch
        count asks for) a new one over epochs `epoch`..`last_epoch`."""
        if skip or self.iterator is None or self.next_epoch != epoch or epoch > self.last_epoch:
            def remaining(e: int) -> Any:  # the first without its `skip` done steps
                return self.epoch_dataset(e, skip if e == epoch else 0)

            self.iterator = self.open_iterator(lambda: chained_epochs(remaining, epoch, self.last_epoch))
        for _ in range(count):
            yield self.iterator
        self.next_epoch = epoch + 1
