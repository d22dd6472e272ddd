"""The order of a streamed epoch (`data.cache_in_worker=false`): a function of the seed and the epoch alone, the same
whatever the number of workers, so a run resumed at another `trainer.num_workers` with the same global batch
continues the same sequence of batches.

An epoch's global sequence of a split's rows:

1. the split's Parquet files in a seeded permutation of the epoch (stored order when not shuffled);
2. cut, in that order, into windows of whole files of at least `window_rows` rows (`data.shuffle_buffer`);
3. each window's rows in a seeded order of its own: each global batch's part of it a stratified draw, one row from
   each of equal slices of the window as read, in the order they are read (`stratified_order`); with
   `data.bucket_by_length`, a permutation whose global batches hold rows of similar length.

Global batch k is rows k*G .. k*G+G-1 of that sequence (G: the global batch, `trainer.batch_size` x data-parallel
ranks); data-parallel rank r trains on its r-th equal part of each (`rank_rows`), which comes from the r-th slice of
the window as read: a rank reads about 1/dp of each window's rows (the Parquet row groups holding them), not all
of them. A reader holds one window at a time, whatever the dataset's size, and a position in the epoch is one
number, the global step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from contract.data import bucketed_order


@dataclass(frozen=True)
class Window:
    files: tuple[int, ...]  # indices into the split's files, in reading order
    start: int              # the epoch's global index of the window's first row
    rows: int


class StreamOrder:
    """An epoch's windows and row orders for a split of files holding `file_rows` rows each."""

    def __init__(self, file_rows: Sequence[int], window_rows: int, seed: int, shuffle: bool = True):
        self.file_rows, self.window_rows = [int(rows) for rows in file_rows], max(1, window_rows)
        self.seed, self.shuffle = seed, shuffle
        self.total_rows = sum(self.file_rows)

    def windows(self, epoch: int) -> list[Window]:
        """The epoch's windows in reading order: whole files, each window at least `window_rows` rows (the last
        one may hold fewer)."""
        files = np.random.default_rng([self.seed, epoch, 0]).permutation(len(self.file_rows)) if self.shuffle \
            else np.arange(len(self.file_rows))
        windows, current, start, rows = [], [], 0, 0
        for index in files.tolist():
            current.append(index)
            rows += self.file_rows[index]
            if rows >= self.window_rows:
                windows.append(Window(tuple(current), start, rows))
                current, start, rows = [], start + rows, 0
        if current:
            windows.append(Window(tuple(current), start, rows))
        return windows

    def window_order(self, epoch: int, window: Window, index: int, global_batch: int,
                     lengths: np.ndarray | None = None) -> np.ndarray:
        """The order of window `index`'s rows (indices into the window as read), a function of the epoch and the
        window: each global batch's part of it (batches of `global_batch` rows from the epoch's start) a stratified
        draw (`stratified_order`); with `lengths`, a permutation in which each global batch's rows are of similar
        length (`bucketed_order`); as read when not shuffled."""
        if not self.shuffle:
            return np.arange(window.rows)
        rng = np.random.default_rng([self.seed, epoch, 1, index])
        if lengths is None:
            return stratified_order(window, global_batch, rng)
        order = rng.permutation(window.rows)
        lead = min((-window.start) % global_batch, window.rows)  # the rest of a global batch the last window began
        head = order[:lead][np.argsort(lengths[order[:lead]], kind="stable")]
        if lead == window.rows:
            return head
        seed = int(np.random.SeedSequence([self.seed, epoch, 2, index]).generate_state(1)[0])
        return np.concatenate([head, bucketed_order(order[lead:], lengths, global_batch, seed)])


def stratified_order(window: Window, global_batch: int, rng: np.random.Generator) -> np.ndarray:
    """Each global batch's part of `window` (c rows) drawn one row from each of c equal slices of the window as read,
    at random within its slice, in the order they are read: row j of a part aims at (j + u) / c of the window (u
    uniform in [0, 1)), and the window's rows, as read, go to the aims in ascending order. Every row is drawn once;
    a data-parallel rank's share of a batch (a run of it) comes from its own slice of the window."""
    first = (-window.start) % global_batch  # the rows of a global batch the window before began
    bounds = np.unique(np.concatenate([[0, window.rows], np.arange(first, window.rows, global_batch)]))
    sizes = np.diff(bounds)
    part = np.repeat(np.arange(len(sizes)), sizes)  # each position's batch part
    aims = (np.arange(window.rows) - bounds[:-1][part] + rng.random(window.rows)) / sizes[part]
    order = np.empty(window.rows, dtype=np.int64)
    order[np.argsort(aims, kind="stable")] = np.arange(window.rows)
    return order


def epoch_steps(total_rows: int, global_batch: int, dp: int, drop_last: bool = False) -> int:
    """Steps of an epoch: one per global batch; a short last one only when every rank gets a row of it (and not
    `drop_last`). Up to dp-1 rows of an epoch may go untrained, other ones each epoch."""
    full, tail = divmod(total_rows, global_batch)
    return full + (1 if tail >= dp and not drop_last else 0)


def rank_rows(step: int, global_batch: int, total_rows: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """The epoch's global indices [start, stop) that rank `dp_rank` of `dp` trains at `step` (from 0): its part of
    the step's global batch, parts as equal as the rows allow (the first ones a row longer)."""
    begin = step * global_batch
    rows = min(global_batch, total_rows - begin)
    base, extra = divmod(rows, dp)
    start = begin + dp_rank * base + min(dp_rank, extra)
    return start, start + base + (1 if dp_rank < extra else 0)
