"""PyTorch batches of a worker's part of the data, as (model inputs, labels, tokens): its Ray Data shard pulled into
memory once and shuffled by a fixed seed per epoch (`ShardBatches`), or its part of every global batch streamed from
the files (`StreamedBatches`). Shared by every PyTorch backend."""
from __future__ import annotations

import itertools
import time
from typing import Any, Iterator

import numpy as np
import torch

from contract.augment import Augment, sample_keys
from contract.data import DataSchema, bucketed_order, shuffled_order
from trainers.models import training_augment
from trainers.streamed import Augmenting, StreamedRows, ray_data_parallel
from trainers.worker import dataset_shards

LOAD_BATCH = 8192  # rows per Ray Data batch when pulling a shard into memory
EVAL_BATCH = 256

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor, int]  # (model inputs, labels, tokens in batch)


class BatchInputs:
    """How a batch of a prepared dataset's stored columns becomes (model inputs, labels, tokens), from its schema
    (contract/data.py): image and numeric features scaled to float32 [B, width], token ids with a mask of the real
    ones; class ids as int64, regression targets as float32."""

    def __init__(self, schema: DataSchema):
        features, target = schema.features, schema.target
        self.schema, self.features, self.label = schema, features.column, target.column
        self.columns = tuple(c for c in (features.column, target.column, features.length_column, features.id_column)
                             if c)
        self.tokens = features.kind == "tokens"
        self.scale, mean, std = features.scaling()
        self.mean, self.std = (x if isinstance(x, float) else torch.from_numpy(x) for x in (mean, std))
        self.regression = target.task == "regression"

    def __call__(self, columns: dict[str, torch.Tensor]) -> Batch:
        labels = columns[self.label]
        labels = labels.float() if self.regression else labels.long()
        if self.tokens:
            ids, lengths = columns[self.features].long(), columns[self.schema.features.length_column]
            mask = torch.arange(ids.shape[1], device=ids.device) < lengths[:, None]  # (B, T), True = real token
            return (ids, mask), labels, int(lengths.sum())
        values = columns[self.features].float().flatten(1)
        mean, std = (x.to(values.device) if torch.is_tensor(x) else x for x in (self.mean, self.std))
        if self.scale != 1.0:
            values = values / self.scale
        return ((values - mean) / std,), labels, 0


class ShardBatches:
    """Batches from this worker's Ray Data shard held in memory, as (model inputs, labels, tokens).

    The shard is pulled through Ray Data once and kept in its stored dtypes (MNIST's 60k rows are 47 MB as uint8,
    IMDb's 22.5k x 256 tokens 23 MB as int32): streaming `read_parquet` is slower than a small MLP trains
    (benchmarks/README.md, ddp_vs_bare), so re-streaming every epoch would make ingest the bottleneck; data too
    large for that streams (`StreamedBatches`). `shard`: anything with Ray's `iter_torch_batches` (a Ray Data
    shard, or a Dataset in tests). In a GPU worker Ray Data hands the batches over on the worker's GPU
    (`iter_torch_batches`' device "auto"), so the cache is in GPU memory and each batch is indexed there.
    """

    def __init__(self, shard: Any, schema: DataSchema, batch_size: int, seed: int, max_steps: int | None = None,
                 drop_last: bool = False, bucket_by_length: bool = False, trim: bool = False,
                 augment: Augment | None = None):
        self.adapt = BatchInputs(schema)
        self.augment = augment  # of shuffled (training) epochs, keyed by the seed, the epoch and the row's position
        self.schema, self.columns, self.label = schema, self.adapt.columns, schema.target.column
        self.length, self.feature_column = schema.features.length_column, schema.features.column
        self.batch_size, self.seed, self.max_steps = batch_size, seed, max_steps
        self.drop_last = drop_last  # leave out an epoch's last batch if it is short (pipelines need fixed shapes)
        self.bucket_by_length = bucket_by_length  # shuffled epochs in `bucketed_order` (text shards)
        self.trim = trim  # cut each text batch to its longest row: the same outputs, less padding to compute
        self.cached: dict[str, torch.Tensor] = {}
        self.load_s = 0.0
        if shard is not None:
            start = time.perf_counter()
            parts: dict[str, list[torch.Tensor]] = {c: [] for c in self.columns}
            for batch in shard.iter_torch_batches(batch_size=LOAD_BATCH):
                for column in self.columns:
                    parts[column].append(batch[column])
            self.cached = {c: torch.cat(p) for c, p in parts.items()}
            self.load_s = time.perf_counter() - start

    @classmethod
    def from_columns(cls, columns: dict[str, torch.Tensor], schema: DataSchema, batch_size: int, seed: int,
                     max_steps: int | None = None, drop_last: bool = False, bucket_by_length: bool = False,
                     trim: bool = False, augment: Augment | None = None) -> "ShardBatches":
        """A shard already in memory (in-process tests, benchmarks): what pulling a Ray Data shard gives."""
        batches = cls(None, schema, batch_size, seed, max_steps=max_steps, drop_last=drop_last,
                      bucket_by_length=bucket_by_length, trim=trim, augment=augment)
        batches.cached = {c: columns[c] for c in batches.columns}
        return batches

    def steps(self) -> int:
        """Batches per epoch."""
        rows = len(self.cached[self.label])
        steps = rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)  # floor or ceil
        return min(steps, self.max_steps) if self.max_steps else steps

    def epoch(self, epoch: int, shuffle: bool = True, skip: int = 0) -> Iterator[Batch]:
        """The epoch's batches (a fixed order per epoch), without the first `skip` (already trained on)."""
        return itertools.islice(self._epoch(epoch, shuffle), skip, self.max_steps)

    def _epoch(self, epoch: int, shuffle: bool) -> Iterator[Batch]:
        rows = len(self.cached[self.label])
        if shuffle:
            order = shuffled_order(rows, self.seed + epoch)  # as the TF backends shuffle
            if self.bucket_by_length:
                lengths = self.cached[self.length].cpu().numpy()  # the cache is on the GPU in a GPU worker
                order = bucketed_order(order, lengths, self.batch_size, self.seed + epoch)
            order = torch.from_numpy(order)
        else:
            order = torch.arange(rows)
        end = rows - rows % self.batch_size if self.drop_last else rows
        for start in range(0, end, self.batch_size):
            idx = order[start:start + self.batch_size]
            batch = {c: t[idx] for c, t in self.cached.items()}
            if shuffle and self.augment is not None:
                keys = sample_keys(self.seed, epoch, np.arange(start, start + len(idx)))
                batch = augmented(self.augment, batch, keys, self.schema)
            yield self.adapt(trimmed(batch, self.feature_column, self.length) if self.trim else batch)

    def row_keys(self) -> torch.Tensor | None:
        """Sorted keys of the held rows that have an id column (id x classes + label: IMDb numbers the reviews
        of each label from 0), which rows a rank holds."""
        id_column = self.schema.features.id_column
        if not id_column:
            return None
        classes = max(len(self.schema.target.classes), 1)
        return (self.cached[id_column].long() * classes + self.cached[self.label].long()).sort().values.cpu()


def augmented(augment: Augment, batch: dict[str, torch.Tensor], keys: np.ndarray,
              schema: DataSchema) -> dict[str, torch.Tensor]:
    """The batch through `augment` (numpy, on the host), back on its device."""
    device = next(iter(batch.values())).device
    columns = augment({c: t.cpu().numpy() for c, t in batch.items()}, keys, schema)
    return {c: torch.from_numpy(np.ascontiguousarray(v)).to(device) for c, v in columns.items()}


def trimmed(batch: dict[str, torch.Tensor], feature_column: str, length_column: str | None) -> dict[str, torch.Tensor]:
    """The batch with its token ids cut after its longest row's tokens (`trim`, text only). Padding is masked out of
    attention and pooling, so the model's outputs do not change."""
    if not length_column:
        return batch
    return {**batch, feature_column: batch[feature_column][:, :max(int(batch[length_column].max()), 1)]}


class StreamedBatches:
    """Batches of a split streamed from its Parquet files (trainers/streamed.py `StreamedRows`: this rank's part
    of each global batch, in the epoch's order of contract/stream_order.py), as (model inputs, labels, tokens):
    what `ShardBatches` gives, with one window of rows in memory instead of the shard."""

    def __init__(self, rows: StreamedRows, schema: DataSchema, trim: bool = False):
        self.rows, self.schema, self.adapt, self.trim = rows, schema, BatchInputs(schema), trim
        self.feature_column, self.length = schema.features.column, schema.features.length_column
        self.load_s = 0.0  # nothing is read before the first epoch: waiting for blocks is each epoch's data wait

    def steps(self) -> int:
        return self.rows.steps()

    def epoch(self, epoch: int, shuffle: bool = True, skip: int = 0) -> Iterator[Batch]:
        """The epoch's batches after the first `skip` (the order is the rows' own: shuffled or not when made)."""
        for columns in self.rows.epoch(epoch, skip):  # augmented where read (`data.augment`)
            batch = {c: torch.from_numpy(np.ascontiguousarray(v)) for c, v in columns.items()}
            yield self.adapt(trimmed(batch, self.feature_column, self.length) if self.trim else batch)

    def row_keys(self) -> None:
        return None  # no shard is held: a streamed epoch's rows are the order's (tests/unit/test_stream_order.py)


def streamed_batches(cfg: Any, schema: DataSchema, group: int) -> tuple[StreamedBatches, StreamedBatches]:
    """This worker's train and eval batches streamed from the prepared files: every data-parallel rank takes its
    part of each global batch (the ranks of one `group`, a TP group or a pipeline, the same part), the training
    order a function of `run.seed` and the epoch alone, the evaluation in stored order."""
    dp, dp_rank = ray_data_parallel(group)
    pipeline = cfg.trainer.get("pp", 1) > 1
    columns = list(BatchInputs(schema).columns)
    bucket = schema.features.length_column if cfg.data.bucket_by_length else None

    def split(name: str, batch_size: int, shuffle: bool, **kwargs: Any) -> StreamedRows:
        return StreamedRows.of_split(cfg.data.path, name, cfg.run.seed, cfg.data.shuffle_buffer, shuffle,
                                     columns=columns, batch_size=batch_size, dp=dp, dp_rank=dp_rank,
                                     drop_last=pipeline, stored=schema.stored_columns, **kwargs)

    train = split("train", cfg.trainer.batch_size, True, max_steps=cfg.trainer.max_steps_per_epoch,
                  bucket_column=bucket, augment=Augmenting.of_run(cfg, schema))
    evaluation = split(cfg.data.eval_split, cfg.trainer.batch_size if pipeline else EVAL_BATCH, False)
    return (StreamedBatches(train, schema, trim=not pipeline),
            StreamedBatches(evaluation, schema, trim=not pipeline))


Batches = ShardBatches | StreamedBatches  # what a PyTorch adapter reads its data from


def ray_batches(cfg: Any, schema: DataSchema, seed: int, group: int = 1) -> tuple[Batches, Batches]:
    """This worker's train and eval batches: its Ray Train dataset shards ("train" and "eval") held in memory
    (`data.cache_in_worker`), else streamed from the files (`streamed_batches`). A pipeline (`trainer.pp` > 1) has
    fixed shapes: training drops a short last batch, evaluation runs in training batches."""
    if not cfg.data.cache_in_worker:
        return streamed_batches(cfg, schema, group)
    pipeline = cfg.trainer.get("pp", 1) > 1
    (train_shard, eval_shard), waited_s = dataset_shards("train", "eval")
    train = ShardBatches(train_shard, schema, cfg.trainer.batch_size, seed, cfg.trainer.max_steps_per_epoch,
                         drop_last=pipeline, bucket_by_length=cfg.data.bucket_by_length, trim=not pipeline,
                         augment=training_augment(cfg))
    evaluation = ShardBatches(eval_shard, schema, cfg.trainer.batch_size if pipeline else EVAL_BATCH, seed,
                              trim=not pipeline)
    train.load_s += waited_s
    return train, evaluation
