"""The order of a streamed epoch (`data.cache_in_worker=false`): a function of the seed and the epoch alone, the same
whatever the number of workers, so a run resumed at another `trainer.num_workers` with the same global batch
continues the same sequence of batches.

An epoch's global sequence of a split's rows:

1. the split's Parquet files in a seeded permutation of the epoch (stored order when not shuffled);
2. cut, in that order, into windows of whole files of at least `window_rows` rows (`data.shuffle_buffer`);
3. each window's rows in a seeded permutation of its own (grouped by length for `data.bucket_by_length`).

Global batch k is rows k*G .. k*G+G-1 of that sequence (G: the global batch, `trainer.batch_size` x data-parallel
ranks); data-parallel rank r trains on its r-th equal part of each (`rank_rows`). A reader therefore holds one
window at a time, whatever the dataset's size, and a position in the epoch is one number, the global step.
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

    def window_order(self, epoch: int, window: Window, index: int, lengths: np.ndarray | None = None,
                     bucket_rows: int = 0) -> np.ndarray:
        """The order of window `index`'s rows (as read): a permutation of the epoch and window; with `lengths` and
        `bucket_rows` (a global batch), each global batch's rows of similar length (`bucketed_order`, its groups
        aligned with the epoch's global batches); as read when not shuffled."""
        if not self.shuffle:
            return np.arange(window.rows)
        order = np.random.default_rng([self.seed, epoch, 1, index]).permutation(window.rows)
        if lengths is None or not bucket_rows:
            return order
        lead = min((-window.start) % bucket_rows, window.rows)  # the rest of a global batch the last window began
        head = order[:lead][np.argsort(lengths[order[:lead]], kind="stable")]
        if lead == window.rows:
            return head
        seed = int(np.random.SeedSequence([self.seed, epoch, 2, index]).generate_state(1)[0])
        return np.concatenate([head, bucketed_order(order[lead:], lengths, bucket_rows, seed)])


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
