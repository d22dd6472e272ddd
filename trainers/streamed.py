"""A worker's rows of a split streamed from its Parquet files (`data.cache_in_worker=false`), in the epoch's order of
contract/stream_order.py: Ray Data's tasks (anywhere in the cluster, a few blocks ahead) take each file, work out
the rows this rank trains of it (`RankPart`: every task computes them from the epoch's order, as the worker does),
read the file only when there are some, make them the dtypes workers hold and augment training rows (`RowPrep`);
the worker puts one window's rows in their order and hands out its part of each global batch. Its memory is its
part of a window and Ray Data's prefetched blocks, whatever the dataset's size; what a rank reads, receives, holds
and augments shrinks with the data-parallel ranks (a rank's part of a batch comes from its slice of the window's
files). Length bucketing orders a window by its rows' lengths, known only once read: a bucketed rank reads and
receives the whole window and augments its rows itself.

Framework-free: batches are {column: numpy array}; trainers/torch/data.py and trainers/tf/data.py make them
tensors."""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from contract.augment import sample_keys
from contract.data import DataSchema, manifest_json
from contract.registry import Ref, load_plugins, plugin_roots, ref_name, resolve
from contract.stream_order import StreamOrder, Window, epoch_steps, rank_rows
from trainers.models import augment_ref

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
        return cls.from_manifest(data_dir, manifest_json(data_dir), split)


def ray_data_parallel(group: int = 1) -> tuple[int, int]:
    """This Ray Train worker's (data-parallel ranks, its data-parallel rank) when each `group` of consecutive ranks
    (a TP group or a pipeline) reads the same batches."""
    import ray.train

    context = ray.train.get_context()
    return context.get_world_size() // group, context.get_world_rank() // group


@dataclass(frozen=True)
class FileRead:
    """One file of a window, as a read task takes it: its place in the epoch's window `index` (the window's first
    global row `start`, its `rows`), and where its rows begin among the window's as read (`offset`)."""
    path: str
    index: int
    start: int
    rows: int
    offset: int
    file_rows: int


@dataclass(frozen=True)
class RankPart:
    """The rows data-parallel rank `dp_rank` of `dp` trains of an epoch in `order`: its part of each global batch of
    `global_batch` rows, from the epoch's global row `first` (a resumed epoch) to `stop` (the end of its last step).
    Worker and read tasks compute it alike."""
    order: StreamOrder
    global_batch: int
    dp: int
    dp_rank: int
    first: int
    stop: int

    def of_window(self, epoch: int, index: int, window: Window) -> tuple[np.ndarray, np.ndarray]:
        """(Window `index`'s rows it takes, as indices into the window as read, ascending; each one's global
        position.)"""
        batch = self.global_batch
        low, high = max(window.start, self.first), min(window.start + window.rows, self.stop)
        spans = [rank_rows(step, batch, self.order.total_rows, self.dp, self.dp_rank)
                 for step in range(low // batch, (high - 1) // batch + 1)] if low < high else []
        positions = np.concatenate([np.arange(max(a, low), min(b, high)) for a, b in spans] or [np.zeros(0, int)])
        read_at = self.order.window_order(epoch, window, index, batch)[positions - window.start]
        by_read = np.argsort(read_at, kind="stable")
        return read_at[by_read], positions[by_read]

    def of_file(self, epoch: int, read: FileRead) -> tuple[np.ndarray, np.ndarray]:
        """(The file's rows it takes, ascending; each one's global position.)"""
        read_at, positions = self.of_window(epoch, read.index, Window((), read.start, read.rows))
        mine = (read_at >= read.offset) & (read_at < read.offset + read.file_rows)
        return read_at[mine] - read.offset, positions[mine]


@dataclass(frozen=True)
class Augmenting:
    """A model spec's augmentation of training rows (contract/augment.py) as a read task runs it: named
    ("module:function"), imported there, from the folders of the run's plugins too (`roots`)."""
    ref: str
    schema: DataSchema
    roots: tuple[str, ...] = ()

    @classmethod
    def of(cls, ref: Ref, schema: DataSchema, roots: Iterable[str] = ()) -> "Augmenting":
        return cls(ref_name(ref), schema, tuple(roots))

    @classmethod
    def of_run(cls, cfg: Any, schema: DataSchema) -> "Augmenting | None":
        """The model spec's augmentation with `data.augment`, else None."""
        ref = augment_ref(cfg)
        return None if ref is None else cls.of(ref, schema, plugin_roots(cfg.plugins))

    def __call__(self, columns: Columns, keys: np.ndarray) -> Columns:
        load_plugins((), self.roots)
        return resolve(self.ref)(columns, keys, self.schema)


@dataclass(frozen=True)
class RowPrep:
    """What becomes of a file's rows where they are read: the dtypes workers hold (`stored`), then the training
    augmentation of rows whose positions are known, keyed by the seed, the epoch and each row's position."""
    stored: Callable[[Columns], Columns] = dict
    augment: Augmenting | None = None
    seed: int = 0
    epoch: int = 0

    def __call__(self, columns: Columns, positions: np.ndarray | None) -> Columns:
        columns = self.stored(columns)
        return columns if positions is None else self.augmented(columns, positions)

    def augmented(self, columns: Columns, positions: np.ndarray) -> Columns:
        if self.augment is None:
            return columns
        return self.augment(columns, sample_keys(self.seed, self.epoch, positions))


def file_rows(take: Callable[[np.ndarray | None], Columns], read: FileRead, part: RankPart | None,
              prep: RowPrep) -> Columns:
    """A file's rows as a rank receives them: its own (`part`; every row when None), taken from the file by
    `take(rows)` (those rows as numpy columns; None: all of them), made by `prep`; {} when it takes none."""
    if part is None:
        return prep(take(None), None)
    rows, positions = part.of_file(prep.epoch, read)
    return prep(take(rows), positions) if len(rows) else {}


Reader = Callable[[list[FileRead], list[str], "RankPart | None", RowPrep], Iterable[Columns]]


def ray_read(reads: list[FileRead], columns: list[str], part: RankPart | None, prep: RowPrep) -> Iterator[Columns]:
    """The files' `columns` as `file_rows` makes them, in file order, read by Ray Data's tasks with PREFETCH_BLOCKS
    blocks read ahead; no progress bars. The tasks reserve no CPU: the training workers hold the ones they asked
    for, and a read that waited for a free one could wait forever; READ_TASKS at once per rank bounds what they
    take, and READ_AHEAD_BYTES what their blocks may hold of the object store (Ray Data's default, a share of the
    whole store, lets a rank's reads run ahead by gigabytes). A map of the files rather than `read_parquet`, whose
    datasource first samples files with tasks of a CPU each."""
    import ray.data

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    files = ray.data.from_items([vars(read) for read in reads], override_num_blocks=len(reads))
    dataset = files.map_batches(_read_files, fn_kwargs={"columns": columns, "part": part, "prep": prep},
                                batch_size=None, batch_format="pyarrow", num_cpus=0,
                                compute=ray.data.TaskPoolStrategy(size=min(READ_TASKS, len(reads))))
    dataset.context.execution_options.preserve_order = True
    limits = ray.data.ExecutionResources(object_store_memory=READ_AHEAD_BYTES)
    dataset.context.execution_options.resource_limits = limits
    yield from dataset.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=PREFETCH_BLOCKS)


def _read_files(batch: Any, columns: list[str], part: RankPart | None, prep: RowPrep) -> Columns:
    """A Ray Data task's block: the rows of the files a block of `FileRead`s names, in order, as `file_rows`
    makes them."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from ray.data.block import BlockAccessor

    def numpy_rows(path: str, rows: np.ndarray | None) -> Columns:  # selected before Arrow's conversion
        table = pq.read_table(path, columns=columns) if rows is None else read_rows(path, rows, columns)
        return BlockAccessor.for_block(table).to_numpy()

    blocks = []
    for item in batch.to_pylist():  # a file this rank takes no row of is not read
        block = file_rows(functools.partial(numpy_rows, item["path"]), FileRead(**item), part, prep)
        blocks += [block] if block else []
    if not blocks:
        return pa.table({})  # an empty block, which the worker passes over
    return {c: np.concatenate([block[c] for block in blocks]) for c in blocks[0]}


def read_rows(path: str, rows: np.ndarray, columns: list[str]) -> Any:
    """The Parquet file's `rows` (ascending indices) of `columns`, as a pyarrow Table: only the row groups that hold
    them are read (a rank's rows of a file lie in one slice of it: contract/stream_order.py)."""
    import pyarrow.parquet as pq

    file = pq.ParquetFile(path)
    sizes = [file.metadata.row_group(g).num_rows for g in range(file.num_row_groups)]
    groups, at = row_groups_of(sizes, rows)
    return file.read_row_groups(groups, columns=columns).take(at)


def row_groups_of(sizes: list[int], rows: np.ndarray) -> tuple[list[int], np.ndarray]:
    """(The row groups of `sizes` rows each that hold `rows`, ascending; each row's index among those groups' rows.)"""
    starts = np.cumsum([0, *sizes])
    group = np.searchsorted(starts, rows, side="right") - 1
    groups = np.unique(group)
    read_starts = np.cumsum([0, *(sizes[g] for g in groups)])[:-1]  # each read group's first row among those read
    return groups.tolist(), rows - starts[group] + read_starts[np.searchsorted(groups, group)]


class StreamedRows:
    """Data-parallel rank `dp_rank` of `dp`'s batches of `batch_size` rows (its part of a global batch of
    batch_size x dp) of the split `files`, each epoch in `order`'s sequence. `bucket_column`: the lengths by which a
    shuffled window's rows are grouped per global batch (`data.bucket_by_length`). `read`: the files' rows as
    `file_rows` makes them (Ray Data's tasks in a run; anything in tests): made `stored` (the dtypes a worker holds:
    `DataSchema.stored_columns`) and, with `augment`, augmented."""

    def __init__(self, files: SplitFiles, columns: list[str], order: StreamOrder, batch_size: int, dp: int,
                 dp_rank: int, max_steps: int | None = None, drop_last: bool = False,
                 bucket_column: str | None = None, read: Reader = ray_read,
                 stored: Callable[[Columns], Columns] = dict, augment: Augmenting | None = None):
        self.files, self.columns, self.order, self.read, self.stored = files, columns, order, read, stored
        self.global_batch, self.dp, self.dp_rank = batch_size * dp, dp, dp_rank
        self.max_steps, self.drop_last, self.bucket_column = max_steps, drop_last, bucket_column
        self.augment = augment

    @classmethod
    def of_split(cls, data_dir: str, split: str, seed: int, window_rows: int, shuffle: bool,
                 **kwargs: Any) -> "StreamedRows":
        """The split `split` of the dataset prepared in `data_dir` (its manifest's files and rows), each epoch in
        the order of `seed` (files and windows of `window_rows` rows shuffled, or as stored); `kwargs`: the rest of
        the constructor's arguments."""
        files = SplitFiles.of_split(data_dir, split)
        return cls(files, order=StreamOrder(files.rows, window_rows, seed, shuffle=shuffle), **kwargs)

    def only(self, columns: list[str]) -> "StreamedRows":
        """The same batches of `columns` alone, as read, not augmented (a pass over a small column, e.g. the
        lengths)."""
        rows = copy.copy(self)
        rows.columns, rows.stored, rows.augment = columns, dict, None
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
        read, and of those only its rows from that step on (all of a window's with length bucketing)."""
        steps = self.steps()
        if skip >= steps:
            return
        windows = self.order.windows(epoch)
        first, _ = rank_rows(skip, self.global_batch, self.order.total_rows, self.dp, self.dp_rank)
        start = next(i for i, window in enumerate(windows) if first < window.start + window.rows)
        part = None if self.bucket_column else RankPart(self.order, self.global_batch, self.dp, self.dp_rank, first,
                                                        min(steps * self.global_batch, self.order.total_rows))
        prep = RowPrep(self.stored, self.augment, self.order.seed, epoch)
        filled = WindowFill(iter(self.read(self._reads(windows, start), self.columns, part, prep)))
        index, held = start - 1, None
        for step in range(skip, steps):
            begin, stop = rank_rows(step, self.global_batch, self.order.total_rows, self.dp, self.dp_rank)
            parts = []
            while begin < stop:
                while index < start or begin >= windows[index].start + windows[index].rows:
                    index += 1  # a window this rank takes nothing of is still read past
                    held = self._window(epoch, index, windows[index], filled, part)
                end = min(stop, windows[index].start + windows[index].rows)
                positions, rows = held
                a, b = np.searchsorted(positions, [begin, end])
                parts.append({c: values[a:b] for c, values in rows.items()})
                begin = end
            batch = parts[0] if len(parts) == 1 else {c: np.concatenate([p[c] for p in parts]) for c in parts[0]}
            yield prep.augmented(batch, self.positions(step)) if part is None else batch

    def _reads(self, windows: list[Window], start: int) -> list[FileRead]:
        reads = []
        for index, window in enumerate(windows[start:], start):
            offsets = np.cumsum([0, *(self.files.rows[f] for f in window.files)])
            reads += [FileRead(self.files.paths[f], index, window.start, window.rows, int(offset), self.files.rows[f])
                      for f, offset in zip(window.files, offsets)]
        return reads

    def _window(self, epoch: int, index: int, window: Window, filled: "WindowFill",
                part: RankPart | None) -> tuple[np.ndarray, Columns]:
        """(The global positions this rank holds of window `index`, ascending; their rows, in that order.) With
        `part`, its own rows; else (length bucketing) the whole window, ordered here by its rows' lengths."""
        if part is None:
            rows = filled.take(window.rows)
            order = self.order.window_order(epoch, window, index, self.global_batch, rows[self.bucket_column])
            return np.arange(window.start, window.start + window.rows), {c: v[order] for c, v in rows.items()}
        _, positions = part.of_window(epoch, index, window)
        if not len(positions):
            return positions, {}
        rows, by_position = filled.take(len(positions)), np.argsort(positions)
        return positions[by_position], {c: values[by_position] for c, values in rows.items()}


class WindowFill:
    """Rows taken from a stream of blocks in windows of a given size; a block that spans two windows is split."""

    def __init__(self, blocks: Iterator[Columns]):
        self.blocks = blocks
        self.left: Columns | None = None

    def take(self, count: int) -> Columns:
        parts, held = [], 0
        while held < count:
            block = self.left if self.left is not None else self._next()
            size = len(next(iter(block.values()))) if block else 0
            if not size:  # a file none of whose rows this rank takes
                self.left = None
                continue
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
