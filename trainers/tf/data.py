"""TensorFlow input from a worker's part of the data: its Ray Data shard pulled into memory once as numpy
(`ShardArrays`), each epoch a `tf.data` pipeline over it in a fixed shuffled order; or its part of every global
batch streamed from the files (`StreamedArrays`); and an attempt's epochs read through one iterator
(`EpochStream`). Shared by every TensorFlow backend; imports no TensorFlow itself (the adapters hand it in, once
tf-keras owns `tf.keras`)."""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import numpy as np

from contract.augment import Augment, sample_keys
from contract.data import FEATURE_DTYPES, LABEL_DTYPES, DataSchema, bucketed_order, shuffled_order
from contract.stream_order import StreamOrder
from trainers.streamed import Augmenting, Reader, SplitFiles, StreamedRows, ray_data_parallel, ray_read
from trainers.worker import dataset_shards

LOAD_BATCH = 8192  # rows per Ray Data batch when pulling a shard into memory
EVAL_BATCH = 256  # rows per evaluation batch


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
        self.augment: Augment | None = None  # of shuffled epochs (`data.augment`, set by the backend)
        self._tensors: tuple[Any, Any] | None = None  # features and labels in TensorFlow, once asked for

    @property
    def rows(self) -> int:
        return len(self.labels)

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

    def step_tokens(self, rows_per_step: int, seed: int, steps: int, epoch: int = 0) -> np.ndarray:
        """Real tokens in each of an epoch's `steps` steps of `rows_per_step` rows (in `order(seed + epoch)`)."""
        return self.lengths[self.order(seed + epoch)][:steps * rows_per_step].reshape(steps, rows_per_step).sum(axis=1)

    def tensors(self, tf: Any) -> tuple[Any, Any]:
        """The shard's features and labels as TensorFlow tensors, made once: every epoch's dataset gathers its
        batches from them, so an attempt's chained epochs (`chained_epochs`) hold one copy of the shard, not one
        per epoch."""
        if self._tensors is None:
            with tf.device("/CPU:0"):  # host memory, as tf.data's own copies were (not a GPU's, where one is seen)
                self._tensors = (tf.constant(self.features), tf.constant(self.labels))
        return self._tensors

    def dataset(self, tf: Any, batch_size: int, seed: int | None = None, steps: int | None = None, epoch: int = 0,
                skip: int = 0) -> Any:
        """One epoch as a `tf.data.Dataset` of (features, labels [B]), its first `steps` batches (all when None)
        but the first `skip`; shuffled with `seed` + `epoch` when a seed is given. TF's auto-sharding is off: Ray
        already gave each worker its shard."""
        ds = tf.data.Dataset.from_tensor_slices(self.order(None if seed is None else seed + epoch))
        ds = ds.batch(batch_size, drop_remainder=steps is not None)
        if steps is not None:
            ds = ds.take(steps)
        features, labels = self.tensors(tf)

        def gathered(rows: Any) -> tuple[Any, Any]:
            return tf.gather(features, rows), tf.gather(labels, rows)

        if seed is None or self.augment is None:
            ds = (ds.skip(skip) if skip else ds).map(gathered)
        else:  # each batch with its index in the epoch: its rows' positions, which key their augmentation
            augmented = augment_fn(tf, self.augment, self.schema, seed, epoch, batch_size)
            ds = ds.enumerate().skip(skip).map(lambda index, rows: augmented(index, *gathered(rows)))
        return model_dataset(tf, ds, self.schema)


def augment_fn(tf: Any, augment: Augment, schema: DataSchema, seed: int, epoch: int,
               batch_size: int) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
    """(batch index, features, labels) -> the batch through `augment` (numpy, keyed by the seed, the epoch and each
    row's position in the epoch: index x batch_size onwards)."""
    feature, label = schema.features.column, schema.target.column

    def run(index: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        keys = sample_keys(seed, epoch, int(index) * batch_size + np.arange(len(y)))
        columns = augment({feature: x, label: y}, keys, schema)
        return columns[feature], columns[label]

    def apply(index: Any, x: Any, y: Any) -> tuple[Any, Any]:
        ax, ay = tf.numpy_function(run, [index, x, y], [x.dtype, y.dtype])
        ax.set_shape(x.shape)
        ay.set_shape(y.shape)
        return ax, ay
    return apply


def model_dataset(tf: Any, ds: Any, schema: DataSchema) -> Any:
    """A dataset of stored (features, labels) batches as the model takes them (`model_input_fn`), prefetched."""
    scale = model_input_fn(tf, schema)
    ds = ds.map(lambda x, y: (scale(x), y))
    options = tf.data.Options()  # TF's auto-sharding off: each worker's dataset is its part already
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    # tf.data's default graph rewrites, made when an iterator opens, copy the shard into every epoch's part of
    # a chained dataset (tests/unit/test_tf_recipe.py counts the memory); a pipeline this small gains nothing
    # from them, and reads faster without (benchmarks/README.md).
    options.experimental_optimization.apply_default_optimizations = False
    return ds.with_options(options).prefetch(2)


class StreamedArrays:
    """A worker's part of a split streamed from its files (trainers/streamed.py `StreamedRows`: its part of each
    global batch, in the epoch's order of contract/stream_order.py), in the form the TF adapters take
    `ShardArrays`: each epoch a `tf.data` pipeline over a generator of its batches, one window of rows in memory.
    A step is this worker's part of a global batch of `rows_per_step` x workers rows, fixed by the first `steps`
    call (`dataset` cuts it into per-replica batches); the training split drops a short last global batch, as the
    held arrays do. The order is the run seed's and the epoch's, the same on every worker: the adapters' per-rank
    `seed` is not used."""

    def __init__(self, data_dir: str, split: str, schema: DataSchema, seed: int, window_rows: int, shuffle: bool,
                 workers: int, rank: int, rows_per_step: int | None = None,
                 read: Reader = ray_read):
        self.schema, self.load_s, self.shuffle, self.read = schema, 0.0, shuffle, read
        features, target = schema.features, schema.target
        self.columns = [features.column, target.column]
        self.files = SplitFiles.of_split(data_dir, split)
        self.order = StreamOrder(self.files.rows, window_rows, seed, shuffle=shuffle)
        self.workers, self.rank = workers, rank
        self.bucket_rows = 0  # grouped by length when set (by the adapter, as `ShardArrays.bucket_rows`)
        self.augment: Augmenting | None = None  # of the training split where read (`data.augment`, by the backend)
        self.rows_per_step = rows_per_step  # known from the start for evaluation, else from `steps`
        self.max_steps: int | None = None

    def streamed_rows(self, rows_per_step: int) -> StreamedRows:
        length = self.schema.features.length_column
        bucket = length if self.bucket_rows else None
        columns = self.columns + ([length] if bucket else [])
        return StreamedRows(self.files, columns, self.order, rows_per_step, self.workers, self.rank,
                            max_steps=self.max_steps, drop_last=self.shuffle, bucket_column=bucket,
                            stored=self.schema.stored_columns, read=self.read, augment=self.augment)

    @property
    def rows(self) -> int:
        """This worker's rows in a pass of `rows_per_step` rows a step (of the batches `dataset` gives without
        `steps`)."""
        if self.rows_per_step is None:
            raise ValueError("a streamed split's rows depend on its rows per step: give them first")
        return self.streamed_rows(self.rows_per_step).rank_rows()

    def steps(self, rows_per_step: int, max_steps: int | None) -> int:
        self.rows_per_step, self.max_steps = rows_per_step, max_steps
        return self.streamed_rows(rows_per_step).steps()

    def step_tokens(self, rows_per_step: int, seed: int, steps: int, epoch: int = 0) -> np.ndarray:
        """Real tokens in each of the epoch's first `steps` steps: a pass over the lengths column alone."""
        length = self.schema.features.length_column
        if not length:
            return np.zeros(steps, dtype=np.int64)
        rows = self.streamed_rows(rows_per_step).only([length])
        return np.array([int(batch[length].sum()) for batch in rows.epoch(epoch)][:steps], dtype=np.int64)

    def dataset(self, tf: Any, batch_size: int, seed: int | None = None, steps: int | None = None, epoch: int = 0,
                skip: int = 0) -> Any:
        """The epoch's batches of `batch_size` rows as `ShardArrays.dataset` gives them, its first `steps` (all when
        None) but the first `skip`; only the windows from the first batch it gives are read."""
        rows = self.streamed_rows(self.rows_per_step or batch_size)
        replicas = max(1, rows.global_batch // rows.dp // batch_size)
        features, label = self.schema.features.column, self.schema.target.column

        def batches() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            index = skip - skip % replicas  # of the epoch's batches: the first of step skip // replicas
            for step in rows.epoch(epoch, skip // replicas):
                for start in range(0, len(step[label]), batch_size):
                    if steps is not None and index >= steps:
                        return
                    if index >= skip:
                        yield step[features][start:start + batch_size], step[label][start:start + batch_size]
                    index += 1

        width, task = self.schema.features.width, self.schema.target.task
        signature = (tf.TensorSpec([None, width], tf.as_dtype(FEATURE_DTYPES[self.schema.features.kind])),
                     tf.TensorSpec([None], tf.as_dtype(LABEL_DTYPES[task])))
        return model_dataset(tf, tf.data.Dataset.from_generator(batches, output_signature=signature), self.schema)


def model_input_fn(tf: Any, schema: DataSchema) -> Callable[[Any], Any]:
    """Stored features [B, width] -> what the model takes: images and values scaled to float32, token ids int32."""
    if schema.features.kind == "tokens":
        return lambda x: tf.cast(x, tf.int32)
    divisor, mean, std = schema.features.scaling()
    if divisor == 1.0:
        return lambda x: (tf.cast(x, tf.float32) - mean) / std
    return lambda x: (tf.cast(x, tf.float32) / divisor - mean) / std


TrainArrays = ShardArrays | StreamedArrays  # what a TF adapter reads its data from


def streamed_arrays(cfg: Any, schema: DataSchema) -> tuple[StreamedArrays, StreamedArrays]:
    """This worker's train and eval arrays streamed from the prepared files: every worker takes its part of each
    global batch, the training order a function of `run.seed` and the epoch alone, the evaluation in stored order."""
    workers, rank = ray_data_parallel()
    split = (schema, cfg.run.seed, cfg.data.shuffle_buffer)
    train = StreamedArrays(cfg.data.path, "train", *split, shuffle=True, workers=workers, rank=rank)
    train.augment = Augmenting.of_run(cfg, schema)
    return train, StreamedArrays(cfg.data.path, cfg.data.eval_split, *split, shuffle=False, workers=workers,
                                 rank=rank, rows_per_step=EVAL_BATCH)


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
