"""IDX parsing and Parquet sharding on generated MNIST-format files."""
from __future__ import annotations


import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.data import mnist
from pipelines.data.idx import DataError, read_idx, write_idx
from pipelines.data.shards import read_manifest, shard_paths
from pipelines.prepare import main as prepare_main
from tests.conftest import make_mnist_like


def test_idx_round_trip_gz_and_raw(tmp_path):
    array = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)
    write_idx(tmp_path / "a.gz", array)
    write_idx(tmp_path / "a", array, compress=False)
    np.testing.assert_array_equal(read_idx(tmp_path / "a.gz", 3), array)
    np.testing.assert_array_equal(read_idx(tmp_path / "a", 3), array)


def test_truncated_data_names_file(tmp_path):
    path = tmp_path / "imgs"
    write_idx(path, np.zeros((3, 28, 28)), compress=False)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DataError, match=r"imgs: truncated"):
        read_idx(path, 3)


def test_truncated_gzip_names_file(tmp_path):
    path = tmp_path / "imgs.gz"
    write_idx(path, np.zeros((3, 28, 28)))
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(DataError, match=r"imgs.gz: corrupt or truncated gzip"):
        read_idx(path, 3)


def test_wrong_magic_names_file(tmp_path):
    path = tmp_path / "labels"
    write_idx(path, np.zeros(5), compress=False)  # 1-D file where images (3-D) are expected
    with pytest.raises(DataError, match=r"labels: wrong magic number 0x00000801"):
        read_idx(path, 3)


def test_count_mismatch_names_both_files(tmp_path):
    raw = make_mnist_like(tmp_path / "raw", 20, 10)
    write_idx(raw / "train-labels-idx1-ubyte.gz", np.zeros(19))
    with pytest.raises(DataError, match=r"train-labels-idx1-ubyte.gz: 19 labels for 20 images"):
        mnist.prepare(raw, tmp_path / "out", 2)
    assert not (tmp_path / "out").exists()  # nothing written when the input is bad


def test_missing_file_is_named(tmp_path):
    raw = make_mnist_like(tmp_path / "raw", 20, 10)
    (raw / "t10k-labels-idx1-ubyte.gz").unlink()
    assert prepare_main(["mnist", "--source", str(raw), "--out", str(tmp_path / "out")]) == 2


def test_shards_schema_counts_and_content(tmp_path):
    raw = make_mnist_like(tmp_path / "raw", 101, 37)
    manifest = mnist.prepare(raw, tmp_path / "out", 3)
    assert manifest["splits"]["train"]["rows"] == 101
    assert [s["rows"] for s in manifest["splits"]["train"]["shards"]] == [33, 34, 34]
    assert sum(s["rows"] for s in manifest["splits"]["test"]["shards"]) == 37
    table = pa.concat_tables(pq.read_table(p) for p in shard_paths(tmp_path / "out", manifest, "train"))
    assert table.schema.field("image").type == pa.list_(pa.uint8(), 784)
    assert table.schema.field("label").type == pa.int8()
    images = read_idx(raw / "train-images-idx3-ubyte.gz", 3).reshape(101, 784)
    labels = read_idx(raw / "train-labels-idx1-ubyte.gz", 1)
    np.testing.assert_array_equal(np.stack(table.column("image").to_numpy(zero_copy_only=False)), images)
    np.testing.assert_array_equal(table.column("label").to_numpy(), labels)
    assert manifest["canonical_sources"] is False


def test_manifest_check_catches_corrupt_shard(tmp_path):
    raw = make_mnist_like(tmp_path / "raw", 40, 10)
    mnist.prepare(raw, tmp_path / "out", 2)
    shard = tmp_path / "out" / "train-00001-of-00002.parquet"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(DataError, match="train-00001-of-00002.parquet: missing or not a readable Parquet"):
        read_manifest(tmp_path / "out")


def test_vendored_files_are_the_canonical_ones():
    from pipelines.data.shards import sha256_of

    for name, digest in mnist.CANONICAL.items():
        assert sha256_of(mnist.EMBEDDED_RAW / name) == digest, name
