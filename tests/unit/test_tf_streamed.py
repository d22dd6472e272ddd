"""Streamed TensorFlow input (`StreamedArrays`, trainers/tf/data.py) over real Parquet files of `rtp prepare
synthetic`, read here by pyarrow in-process (Ray Data reading the same files is tests/integration/test_streamed.py):
the `tf.data` batches a worker trains on are its part of each global batch in the order of `StreamedRows`, the one
the PyTorch backends stream; a resumed epoch gives the rest of the same batches; several replicas per worker cut each
step's rows in turn; the tokens per step and the evaluation's rows are the streamed rows'."""
from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipelines.data import data_schema
from pipelines.data.shards import read_manifest
from contract.stream_order import StreamOrder
from pipelines.prepare import main as prepare_main
from tests.support.streamed import in_process
from trainers.streamed import SplitFiles, StreamedRows
from trainers.tf.data import StreamedArrays

SEED, WINDOW = 7, 150


def read(paths: list[str], columns: list[str]):
    """The files' columns, file by file, as Ray Data's numpy batches give them."""
    for path in paths:
        table = pq.read_table(path, columns=columns)
        yield {c: table.column(c).to_numpy(zero_copy_only=False) for c in columns}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokens")
    assert prepare_main(["synthetic", "--rows", "700", "--tokens", "12", "--vocab-size", "50",
                         "--rows-per-shard", "70", "--out", str(folder)]) == 0
    return folder, data_schema(read_manifest(folder))


def reference(folder, schema, split: str, batch: int, workers: int, rank: int, shuffle: bool, bucket: bool):
    """The same worker's batches as the PyTorch backends stream them, with the row ids."""
    files = SplitFiles.of_split(str(folder), split)
    return StreamedRows(files, ["features", "label", "length", "row"], StreamOrder(files.rows, WINDOW, SEED, shuffle),
                        batch, workers, rank, drop_last=shuffle, bucket_column="length" if bucket else None,
                        read=in_process(read), stored=schema.stored_columns)


def arrays(folder, schema, split: str, workers: int, rank: int, shuffle: bool = True, **kwargs) -> StreamedArrays:
    return StreamedArrays(str(folder), split, schema, SEED, WINDOW, shuffle, workers, rank, read=in_process(read),
                          **kwargs)


def batches(dataset) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(x.numpy(), y.numpy()) for x, y in dataset]


@pytest.mark.parametrize("bucket", [False, True])
def test_a_workers_tf_batches_are_its_part_of_the_streamed_global_batches(tokens, bucket):
    import tensorflow as tf

    folder, schema = tokens
    seen = []
    for rank in range(2):
        train = arrays(folder, schema, "train", 2, rank)
        train.bucket_rows = 8 if bucket else 0
        steps = train.steps(8, None)
        expected = list(reference(folder, schema, "train", 8, 2, rank, True, bucket).epoch(1))
        assert steps == len(expected) == 560 // 16
        got = batches(train.dataset(tf, 8, seed=123, epoch=1, steps=steps))
        assert len(got) == steps
        for (features, labels), want in zip(got, expected):
            np.testing.assert_array_equal(features, want["features"])
            np.testing.assert_array_equal(labels, want["label"])
        np.testing.assert_array_equal(train.step_tokens(8, 123, steps, epoch=1), [b["length"].sum() for b in expected])
        resumed = batches(train.dataset(tf, 8, seed=123, epoch=1, steps=steps, skip=20))
        assert len(resumed) == steps - 20
        for (features, _), (want, _) in zip(resumed, got[20:]):
            np.testing.assert_array_equal(features, want)
        seen += [row for b in expected for row in b["row"].tolist()]
    assert sorted(seen) == list(range(560))  # 560 train rows: 35 global batches of 16, each row once


def test_replicas_of_a_worker_take_its_step_rows_in_turn(tokens):
    import tensorflow as tf

    folder, schema = tokens
    train = arrays(folder, schema, "train", 1, 0)
    steps = train.steps(16, 10)  # two replicas of 8 rows; max_steps_per_epoch 10
    assert steps == 10
    got = batches(train.dataset(tf, 8, seed=0, epoch=0, steps=2 * steps, skip=4))  # resumed after 2 steps
    expected = list(reference(folder, schema, "train", 16, 1, 0, True, False).epoch(0))[2:10]
    assert len(got) == 16
    for step, want in enumerate(expected):
        np.testing.assert_array_equal(np.concatenate([got[2 * step][0], got[2 * step + 1][0]]), want["features"])


def test_evaluation_streams_each_workers_part_of_the_stored_rows(tokens):
    import tensorflow as tf

    folder, schema = tokens
    parts = []
    for rank in range(2):
        evaluation = arrays(folder, schema, "validation", 2, rank, shuffle=False, rows_per_step=34)
        got = batches(evaluation.dataset(tf, 34))
        expected = list(reference(folder, schema, "validation", 34, 2, rank, False, False).epoch(0))
        assert evaluation.rows == sum(len(y) for _, y in got) == sum(len(b["label"]) for b in expected)
        parts.append(np.concatenate([b["row"] for b in expected]))
        np.testing.assert_array_equal(np.concatenate([x for x, _ in got]),
                                      np.concatenate([b["features"] for b in expected]))
    # every validation row (ids count per split; 70 = 68 + a tail of 2)
    assert sorted(np.concatenate(parts).tolist()) == list(range(70))
