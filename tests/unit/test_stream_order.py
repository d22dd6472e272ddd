"""The streamed epoch's order (contract/stream_order.py) and a rank's batches of it (trainers/streamed.py), on
files held in memory and read in blocks that do not follow the files: every row once an epoch, the same global
batches at 1, 2 or 3 data-parallel ranks, the same again for the same seed, a resumed epoch (at another rank
count too) continuing the uninterrupted one, lengths grouped per global batch, and only the windows a resumed
epoch needs read. Ray Data reading real Parquet for the same class: tests/integration/test_streamed.py."""
from __future__ import annotations

import numpy as np
import pytest

from contract.stream_order import StreamOrder, epoch_steps, rank_rows
from tests.support.streamed import in_process
from trainers.streamed import SplitFiles, StreamedRows

FILE_ROWS = [50, 7, 120, 33, 64, 1, 90]  # 365 rows in files of uneven sizes


class Files:
    """Files of rows numbered 0..364 in file order, with a length each; read in blocks of 11 rows that run across
    file boundaries, as Ray Data's blocks may. Records which files each read asked for."""

    def __init__(self):
        self.paths = [f"f{i}.parquet" for i in range(len(FILE_ROWS))]
        starts = np.cumsum([0, *FILE_ROWS])
        self.rows = {p: np.arange(starts[i], starts[i + 1]) for i, p in enumerate(self.paths)}
        self.reads: list[list[str]] = []

    def read(self, paths: list[str], columns: list[str]):
        self.reads.append(paths)
        rows = np.concatenate([self.rows[p] for p in paths])
        for start in range(0, len(rows), 11):
            part = rows[start:start + 11]
            yield {"row": part, "length": (part * 7919) % 97 + 1}


def streamed(files: Files, dp: int, rank: int, batch: int, seed: int = 0, window: int = 100,
             bucket: bool = False) -> StreamedRows:
    order = StreamOrder(FILE_ROWS, window, seed)
    return StreamedRows(SplitFiles(files.paths, FILE_ROWS), ["row", "length"], order, batch, dp, rank,
                        bucket_column="length" if bucket else None, read=in_process(files.read))


def global_batches(dp: int, batch: int, epoch: int, skip: int = 0, **kwargs) -> list[np.ndarray]:
    """Each step's global batch: the ranks' batches side by side."""
    ranks = [list(streamed(Files(), dp, rank, batch, **kwargs).epoch(epoch, skip)) for rank in range(dp)]
    assert len({len(r) for r in ranks}) == 1  # every rank takes the same number of steps
    return [np.concatenate([r[step]["row"] for r in ranks]) for step in range(len(ranks[0]))]


def test_every_row_once_an_epoch_in_the_same_global_batches_at_any_rank_count():
    one = global_batches(1, 24, epoch=1)
    assert [len(b) for b in one] == [24] * 15 + [5]  # 365 = 15 x 24 + 5
    assert sorted(np.concatenate(one).tolist()) == list(range(365))
    for dp in (2, 3):
        batches = global_batches(dp, 24 // dp, epoch=1)
        assert len(batches) == 16
        for mine, theirs in zip(batches, one):
            np.testing.assert_array_equal(mine, theirs)
    assert not np.array_equal(np.concatenate(one), np.arange(365))  # shuffled across files and windows
    again, other_epoch = global_batches(1, 24, epoch=1), global_batches(1, 24, epoch=2)
    assert all(np.array_equal(a, b) for a, b in zip(again, one))
    assert not np.array_equal(np.concatenate(other_epoch), np.concatenate(one))
    assert not np.array_equal(np.concatenate(global_batches(1, 24, epoch=1, seed=1)), np.concatenate(one))


def test_a_resumed_epoch_continues_the_same_batches_at_another_rank_count_reading_only_what_it_needs():
    uninterrupted = global_batches(2, 12, epoch=3)
    for dp in (1, 2, 3):
        resumed = global_batches(dp, 24 // dp, epoch=3, skip=9)
        assert len(resumed) == len(uninterrupted) - 9
        for mine, theirs in zip(resumed, uninterrupted[9:]):
            np.testing.assert_array_equal(mine, theirs)
    files = Files()
    list(streamed(files, 1, 0, 24).epoch(3, skip=14))
    windows = StreamOrder(FILE_ROWS, 100, 0).windows(3)
    first = next(w for w in windows if 14 * 24 < w.start + w.rows)
    assert files.reads == [[files.paths[f] for w in windows[windows.index(first):] for f in w.files]]


def test_windows_are_whole_files_of_at_least_the_buffer_and_the_order_without_shuffle_is_the_stored_one():
    order = StreamOrder(FILE_ROWS, 100, seed=5)
    windows = order.windows(1)
    assert sorted(f for w in windows for f in w.files) == list(range(7))
    assert all(w.rows >= 100 for w in windows[:-1]) and sum(w.rows for w in windows) == 365
    assert [w.start for w in windows] == np.cumsum([0] + [w.rows for w in windows[:-1]]).tolist()
    plain = StreamOrder(FILE_ROWS, 100, seed=5, shuffle=False)
    rows = np.concatenate([np.arange(w.start, w.start + w.rows)[plain.window_order(1, w, i, 24)]
                           for i, w in enumerate(plain.windows(1))])
    np.testing.assert_array_equal(rows, np.arange(365))


def test_lengths_are_grouped_per_global_batch_without_losing_a_row():
    plain = global_batches(2, 8, epoch=1)
    grouped = global_batches(2, 8, epoch=1, bucket=True)
    assert sorted(np.concatenate(grouped).tolist()) == list(range(365))
    length = lambda rows: (rows * 7919) % 97 + 1  # noqa: E731  (as Files stores it)
    spread = lambda batches: np.mean([np.ptp(length(b)) for b in batches[:-1]])  # noqa: E731
    assert spread(grouped) < spread(plain) / 2
    np.testing.assert_array_equal(np.concatenate(global_batches(1, 16, epoch=1, bucket=True)),
                                  np.concatenate(grouped))


@pytest.mark.parametrize("total, batch, dp, steps", [(365, 24, 1, 16), (365, 24, 3, 16), (362, 24, 3, 15),
                                                     (360, 24, 3, 15), (2, 24, 3, 0)])
def test_a_short_last_batch_is_trained_when_every_rank_gets_a_row(total, batch, dp, steps):
    assert epoch_steps(total, batch, dp) == steps
    for step in range(steps):
        parts = [rank_rows(step, batch, total, dp, rank) for rank in range(dp)]
        assert parts[0][0] == step * batch and all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        assert all(stop > start for start, stop in parts) and max(s - t for t, s in parts) - \
            min(s - t for t, s in parts) <= 1
    assert epoch_steps(365, 24, 1, drop_last=True) == 15


def test_a_streamed_epoch_has_the_steps_of_the_same_data_held_in_memory():
    """Held in memory, each of dp ranks holds rows // dp rows (Ray's equal split) and trains ceil(that / batch)
    steps; streamed, an epoch has as many: a learning-rate schedule (its length in steps) is the same, step for
    step, whichever way the data is read."""
    for rows in range(1, 400, 7):
        for dp in (1, 2, 3, 4):
            for batch in (1, 5, 8, 32):
                assert epoch_steps(rows, batch * dp, dp) == -(-(rows // dp) // batch), (rows, dp, batch)


def test_a_rank_reads_about_its_share_of_each_window_in_row_groups(tmp_path):
    """Each global batch's part of a window is drawn one row per slice of the window and put in read order, so rank
    r's part comes from the r-th slice; its read tasks read only the Parquet row groups holding its rows
    (`read_rows`). 4 files of 600 rows in row groups of 50, windows of 2 files, a global batch of 64: every row
    trained once an epoch, at 1 rank the data read once, at 4 ranks under 1.6 times (each rank reading every file
    would be 4 times; the excess is row groups shared by two ranks' slices and the parts of batches that run from
    one window into the next)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainers.streamed import file_rows, read_rows, row_groups_of

    paths = [str(tmp_path / f"f{i}.parquet") for i in range(4)]
    for i, path in enumerate(paths):
        pq.write_table(pa.table({"row": np.arange(600 * i, 600 * (i + 1))}), path, row_group_size=50)

    def counted(tally: list[int]):
        def read(reads, columns, part, prep):
            for file in reads:
                def take(rows, path=file.path):
                    groups, _ = row_groups_of([50] * 12, rows)
                    tally.append(50 * len(groups))
                    return {"row": read_rows(path, rows, columns).column("row").to_numpy()}
                yield file_rows(take, file, part, prep)
        return read

    for dp, bound in ((1, 1.0), (4, 1.6)):
        tally, trained = [], []
        for rank in range(dp):
            rows = StreamedRows(SplitFiles(paths, [600] * 4), ["row"], StreamOrder([600] * 4, 1200, seed=1), 64 // dp,
                                dp, rank, read=counted(tally))
            trained += [batch["row"] for batch in rows.epoch(1)]
        assert sorted(np.concatenate(trained).tolist()) == list(range(2400))
        assert sum(tally) <= bound * 2400, (dp, sum(tally))
