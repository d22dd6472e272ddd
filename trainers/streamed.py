"""A worker's rows of a split streamed from its Parquet files (`data.cache_in_worker=false`), in the epoch's order of
contract/stream_order.py: Ray Data reads the files (its read tasks, anywhere in the cluster, a few blocks ahead),
the worker keeps one window of rows (`data.shuffle_buffer`), permutes it, and hands out its part of each global
batch. Its memory is a window and Ray Data's prefetched blocks, whatever the dataset's size. Each rank reads every
file of the split and keeps its rows: reading grows with the data-parallel ranks, memory does not.

Framework-free: batches are {column: numpy array}; trainers/torch/data.py and trainers/tf/data.py make them
tensors."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from contract.stream_order import StreamOrder, Window, epoch_steps, rank_rows

Columns = dict[str, np.ndarray]
PREFETCH_BLOCKS = 4  # Ray Data blocks read ahead of the window being filled
READ_TASKS = 2       # a rank's Ray Data read tasks at once
READ_AHEAD_BYTES = 512 << 20  # the object store a rank's reads may fill ahead of it


@dataclass(frozen=True)
class SplitFiles:
    """A split's Parquet files and the rows each holds (its manifest's)."""
    paths: list[str]
    rows: list[int]

    @classmethod
    def from_manifest(cls, data_dir: str, manifest: dict[str, Any], split: str) -> "SplitFiles":
        shards = manifest["splits"][split]["shards"]
        return cls([f"{data_dir}/{shard['file']}" for shard in shards], [int(shard["rows"]) for shard in shards])

    @classmethod
    def of_split(cls, data_dir: str, split: str) -> "SplitFiles":
        """The split's files of the dataset prepared in `data_dir`, from its manifest."""
        return cls.from_manifest(data_dir, json.loads((Path(data_dir) / "manifest.json").read_text()), split)


def ray_data_parallel(group: int = 1) -> tuple[int, int]:
    """This Ray Train worker's (data-parallel ranks, its data-parallel rank) when each `group` of consecutive ranks
    (a TP group or a pipeline) reads the same batches."""
    import ray.train

    context = ray.train.get_context()
    return context.get_world_size() // group, context.get_world_rank() // group


def ray_read(paths: list[str], columns: list[str]) -> Iterator[Columns]:
    """The files' `columns`, in file order, a block per file, read by Ray Data's tasks with PREFETCH_BLOCKS blocks
    read ahead; no progress bars. The tasks reserve no CPU: the training workers hold the ones they asked for, and a
    read that waited for a free one could wait forever; READ_TASKS at once per rank bounds what they take, and
    READ_AHEAD_BYTES what their blocks may hold of the object store (Ray Data's default, a share of the whole
    store, lets a rank's reads run ahead by gigabytes). A map of the paths rather than `read_parquet`, whose
    datasource first samples files with tasks of a CPU each."""
    import ray.data

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    files = ray.data.from_items([{"path": path} for path in paths], override_num_blocks=len(paths))
    dataset = files.map_batches(_read_parquet_files, fn_kwargs={"columns": columns}, batch_size=None,
                                batch_format="pyarrow", num_cpus=0,
                                compute=ray.data.TaskPoolStrategy(size=min(READ_TASKS, len(paths))))
    dataset.context.execution_options.preserve_order = True
    limits = ray.data.ExecutionResources(object_store_memory=READ_AHEAD_BYTES)
    dataset.context.execution_options.resource_limits = limits
    yield from dataset.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=PREFETCH_BLOCKS)


def _read_parquet_files(batch: Any, columns: list[str]) -> Any:
    """A Ray Data task's block: the `columns` of the files a block of paths names, in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pa.concat_tables([pq.read_table(path, columns=columns) for path in batch.column("path").to_pylist()])


class StreamedRows:
    """Data-parallel rank `dp_rank` of `dp`'s batches of `batch_size` rows (its part of a global batch of
    batch_size x dp) of the split `files`, each epoch in `order`'s sequence. `bucket_column`: the lengths by which a
    shuffled window's rows are grouped per global batch (`data.bucket_by_length`). `read(paths, columns)`: the
    files' rows in file order (Ray Data in a run; anything in tests), each block made `stored` (the dtypes a worker
    holds: `DataSchema.stored_columns`)."""

    def __init__(self, files: SplitFiles, columns: list[str], order: StreamOrder, batch_size: int, dp: int,
                 dp_rank: int, max_steps: int | None = None, drop_last: bool = False,
                 bucket_column: str | None = None,
                 read: Callable[[list[str], list[str]], Iterable[Columns]] = ray_read,
                 stored: Callable[[Columns], Columns] = dict):
        self.files, self.columns, self.order, self.read, self.stored = files, columns, order, read, stored
        self.global_batch, self.dp, self.dp_rank = batch_size * dp, dp, dp_rank
        self.max_steps, self.drop_last, self.bucket_column = max_steps, drop_last, bucket_column

    @classmethod
    def of_split(cls, data_dir: str, split: str, seed: int, window_rows: int, shuffle: bool,
                 **kwargs: Any) -> "StreamedRows":
        """The split `split` of the dataset prepared in `data_dir` (its manifest's files and rows), each epoch in
        the order of `seed` (files and windows of `window_rows` rows shuffled, or as stored); `kwargs`: the rest of
        the constructor's arguments."""
        files = SplitFiles.of_split(data_dir, split)
        return cls(files, order=StreamOrder(files.rows, window_rows, seed, shuffle=shuffle), **kwargs)

    def only(self, columns: list[str]) -> "StreamedRows":
        """The same batches of `columns` alone, as read (a pass over a small column, e.g. the lengths)."""
        rows = copy.copy(self)
        rows.columns, rows.stored = columns, dict
        return rows

    def positions(self, step: int) -> np.ndarray:
        """The epoch's global indices of this rank's rows at `step` (in the order `epoch` gives them)."""
        return np.arange(*rank_rows(step, self.global_batch, self.order.total_rows, self.dp, self.dp_rank))

    def rank_rows(self) -> int:
        """This rank's rows in an epoch."""
        return sum(stop - start for start, stop in (rank_rows(step, self.global_batch, self.order.total_rows,
                                                              self.dp, self.dp_rank) for step in range(self.steps())))

    def steps(self) -> int:
        """Batches per epoch, from the files' row counts (the same on every rank)."""
        steps = epoch_steps(self.order.total_rows, self.global_batch, self.dp, self.drop_last)
        return min(steps, self.max_steps) if self.max_steps else steps

    def epoch(self, epoch: int, skip: int = 0) -> Iterator[Columns]:
        """This rank's batches of `epoch` after its first `skip`: only the windows from the first one it needs are
        read."""
        steps = self.steps()
        if skip >= steps:
            return
        windows = self.order.windows(epoch)
        first, _ = rank_rows(skip, self.global_batch, self.order.total_rows, self.dp, self.dp_rank)
        start = next(i for i, window in enumerate(windows) if first < window.start + window.rows)
        paths = [self.files.paths[f] for window in windows[start:] for f in window.files]
        filled = WindowFill((self.stored(block) for block in self.read(paths, self.columns)))
        index, window, rows = start - 1, None, None
        for step in range(skip, steps):
            begin, stop = rank_rows(step, self.global_batch, self.order.total_rows, self.dp, self.dp_rank)
            parts = []
            while begin < stop:
                if window is None or begin >= window.start + window.rows:
                    index += 1
                    window = windows[index]
                    rows = self._ordered(epoch, index, window, filled.take(window.rows))
                end = min(stop, window.start + window.rows)
                parts.append({c: values[begin - window.start:end - window.start] for c, values in rows.items()})
                begin = end
            yield parts[0] if len(parts) == 1 else {c: np.concatenate([p[c] for p in parts]) for c in self.columns}

    def _ordered(self, epoch: int, index: int, window: Window, rows: Columns) -> Columns:
        lengths = rows[self.bucket_column] if self.bucket_column else None
        order = self.order.window_order(epoch, window, index, lengths, self.global_batch)
        return {c: values[order] for c, values in rows.items()}


class WindowFill:
    """Rows taken from a stream of blocks in windows of a given size; a block that spans two windows is split."""

    def __init__(self, blocks: Iterator[Columns]):
        self.blocks = blocks
        self.left: Columns | None = None

    def take(self, count: int) -> Columns:
        parts, held = [], 0
        while held < count:
            block = self.left if self.left is not None else self._next()
            size = len(next(iter(block.values())))
            need = count - held
            parts.append({c: v[:need] for c, v in block.items()} if size > need else block)
            self.left = {c: v[need:] for c, v in block.items()} if size > need else None
            held += min(size, need)
        return {c: np.concatenate([p[c] for p in parts]) for c in parts[0]}

    def _next(self) -> Columns:
        try:
            return next(self.blocks)
        except StopIteration:
            raise RuntimeError("the split's files hold fewer rows than its manifest says") from None
