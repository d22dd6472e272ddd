"""PyTorch batches from a worker's data shard: the Ray Data shard pulled into memory once (or streamed), shuffled
by a fixed seed per epoch, as (model inputs, labels, tokens). Shared by every PyTorch backend."""
from __future__ import annotations

import itertools
import time
from typing import Any, Iterator

import torch

from contract.data import DataSchema, bucketed_order, shuffled_order
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
    """Batches from this worker's Ray Data shard, as (model inputs, labels, tokens).

    cache=True pulls the shard through Ray Data once and keeps it in memory in its stored dtypes
    (MNIST's 60k rows are 47 MB as uint8, IMDb's 22.5k x 256 tokens 23 MB as int32): streaming
    `read_parquet` is slower than a small MLP trains (benchmarks/README.md, ddp_vs_bare), so
    re-streaming every epoch would make ingest the bottleneck. cache=False streams from Ray Data every
    epoch (for data that does not fit in memory), in shard order. `shard`: anything with Ray's
    `iter_torch_batches` (a Ray Data shard, or a Dataset in tests). In a GPU worker Ray Data hands the
    batches over on the worker's GPU (`iter_torch_batches`' device "auto"), so the cache is in GPU memory
    and each batch is indexed there.
    """

    def __init__(self, shard: Any, schema: DataSchema, batch_size: int, cache: bool, seed: int,
                 max_steps: int | None = None, drop_last: bool = False, bucket_by_length: bool = False,
                 trim: bool = False):
        self.adapt = BatchInputs(schema)
        self.schema, self.columns, self.label = schema, self.adapt.columns, schema.target.column
        self.length, self.feature_column = schema.features.length_column, schema.features.column
        self.shard, self.batch_size, self.seed, self.max_steps = shard, batch_size, seed, max_steps
        self.drop_last = drop_last  # leave out an epoch's last batch if it is short (pipelines need fixed shapes)
        self.bucket_by_length = bucket_by_length  # shuffled epochs in `bucketed_order` (cached text shards)
        self.trim = trim  # cut each text batch to its longest row: the same outputs, less padding to compute
        self.cached: dict[str, torch.Tensor] | None = None
        self.load_s = 0.0
        if cache:
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
                     trim: bool = False) -> "ShardBatches":
        """A shard already in memory (in-process tests, benchmarks): what caching a Ray Data shard gives."""
        batches = cls(None, schema, batch_size, cache=False, seed=seed, max_steps=max_steps, drop_last=drop_last,
                      bucket_by_length=bucket_by_length, trim=trim)
        batches.cached = {c: columns[c] for c in batches.columns}
        return batches

    def steps(self) -> int:
        """Batches per epoch (known once cached; 0 when streaming)."""
        rows = 0 if self.cached is None else len(self.cached[self.label])
        steps = rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)  # floor or ceil
        return min(steps, self.max_steps) if self.max_steps else steps

    def epoch(self, epoch: int, shuffle: bool = True, skip: int = 0) -> Iterator[Batch]:
        """The epoch's batches (a fixed order per epoch), without the first `skip` (already trained on)."""
        return itertools.islice(self._epoch(epoch, shuffle), skip, self.max_steps)

    def _epoch(self, epoch: int, shuffle: bool) -> Iterator[Batch]:
        if self.cached is None:
            for batch in self.shard.iter_torch_batches(batch_size=self.batch_size, drop_last=self.drop_last):
                yield self.adapt(self._trimmed(batch))
            return
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
            yield self.adapt(self._trimmed({c: t[idx] for c, t in self.cached.items()}))

    def _trimmed(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch with its token ids cut after its longest row's tokens, when `trim` is set. Padding is masked
        out of attention and pooling, so the model's outputs do not change."""
        if not self.trim or not self.length:
            return batch
        return {**batch, self.feature_column: batch[self.feature_column][:, :max(int(batch[self.length].max()), 1)]}

    def row_keys(self) -> torch.Tensor | None:
        """Sorted keys of the cached rows that have an id column (id x classes + label: IMDb numbers the reviews
        of each label from 0), which rows a rank holds."""
        id_column = self.schema.features.id_column
        if self.cached is None or not id_column:
            return None
        classes = max(len(self.schema.target.classes), 1)
        return (self.cached[id_column].long() * classes + self.cached[self.label].long()).sort().values.cpu()


def ray_batches(cfg: Any, schema: DataSchema, seed: int) -> tuple[ShardBatches, ShardBatches]:
    """This worker's train and eval batches (Ray Train dataset shards "train" and "eval"). A pipeline
    (`trainer.pp` > 1) has fixed shapes: training drops a short last batch, evaluation runs in training batches."""
    pipeline = cfg.trainer.get("pp", 1) > 1
    (train_shard, eval_shard), waited_s = dataset_shards("train", "eval")
    train = ShardBatches(train_shard, schema, cfg.trainer.batch_size, cfg.data.cache_in_worker, seed,
                         cfg.trainer.max_steps_per_epoch, drop_last=pipeline,
                         bucket_by_length=cfg.data.bucket_by_length, trim=not pipeline)
    evaluation = ShardBatches(eval_shard, schema, cfg.trainer.batch_size if pipeline else EVAL_BATCH,
                              cfg.data.cache_in_worker, seed, trim=not pipeline)
    train.load_s += waited_s
    return train, evaluation
