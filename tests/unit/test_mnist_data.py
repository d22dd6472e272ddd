"""IDX parsing and Parquet sharding on generated MNIST-format files."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from pipelines.data import mnist
from pipelines.data.idx import DataError, read_idx, write_idx
from pipelines.data.shards import read_manifest, shard_paths, write_manifest, write_split_shards
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
    manifest = mnist.prepare(raw, tmp_path / "out", 3, val_fraction=0)
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


def test_the_validation_split_is_the_end_of_the_train_file_and_what_runs_evaluate_on(tmp_path):
    """By default the last twelfth of the train file is the validation split: the epochs are measured on it, the
    test split is left for the chosen model."""
    from pipelines.config import default_eval_split

    raw = make_mnist_like(tmp_path / "raw", 120, 20)
    out = tmp_path / "out"
    assert prepare_main(["mnist", "--source", str(raw), "--out", str(out), "--shards", "2"]) == 0
    manifest = read_manifest(out)
    assert {split: info["rows"] for split, info in manifest["splits"].items()} == {"train": 110, "validation": 10,
                                                                                 "test": 20}
    assert manifest["validation_from"] == "the last 10 rows of the train file"
    images = read_idx(raw / "train-images-idx3-ubyte.gz", 3).reshape(120, 784)
    for split, rows in (("train", images[:110]), ("validation", images[110:])):
        table = pa.concat_tables(pq.read_table(p) for p in shard_paths(out, manifest, split))
        np.testing.assert_array_equal(np.stack(table.column("image").to_numpy(zero_copy_only=False)), rows)
    assert default_eval_split(OmegaConf.create({"path": str(out)})) == "validation"
    assert prepare_main(["mnist", "--source", str(raw), "--out", str(out), "--val-fraction", "0"]) == 0
    assert set(read_manifest(out)["splits"]) == {"train", "test"}
    assert default_eval_split(OmegaConf.create({"path": str(out)})) == "test"


def test_manifest_check_catches_corrupt_shard(tmp_path):
    raw = make_mnist_like(tmp_path / "raw", 40, 10)
    mnist.prepare(raw, tmp_path / "out", 2)
    shard = tmp_path / "out" / "train-00001-of-00002.parquet"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(DataError, match="train-00001-of-00002.parquet: missing or not a readable Parquet"):
        read_manifest(tmp_path / "out")


def test_manifest_check_catches_totals_and_columns_that_disagree_with_the_shards(tmp_path):
    """A split's total against its shards' rows (the footers hold the truth), and a manifest without a recorded
    Arrow schema: the columns its features and target name must be in the shards, holding what they need."""
    mnist.prepare(make_mnist_like(tmp_path / "raw", 40, 10), tmp_path / "out", 2, val_fraction=0)
    path = tmp_path / "out" / "manifest.json"
    good = json.loads(path.read_text())
    for rows in (6_000_000, 0):
        path.write_text(json.dumps({**good, "splits": {**good["splits"], "train": {**good["splits"]["train"],
                                                                                    "rows": rows}}}))
        with pytest.raises(DataError, match=rf"split 'train' says {rows} rows, its shards say 40"):
            read_manifest(tmp_path / "out")
    path.write_text(json.dumps({key: value for key, value in good.items() if key != "schema"}))
    assert read_manifest(tmp_path / "out")["splits"]["train"]["rows"] == 40  # the same shards: fine
    shard = tmp_path / "out" / good["splits"]["test"]["shards"][0]["file"]
    rows = pq.read_metadata(shard).num_rows
    pq.write_table(pa.table({"image": pa.array(["x"] * rows), "label": pa.array([0] * rows)}), shard)
    with pytest.raises(DataError, match=r"column 'image' is string; the manifest's features and target need a list "
                                        r"of numbers per row there"):
        read_manifest(tmp_path / "out")
    pq.write_table(pa.table({"pixels": pa.array([[0.0]] * rows), "label": pa.array([0] * rows)}), shard)
    with pytest.raises(DataError, match=r"no column 'image', which the manifest's features and target name"):
        read_manifest(tmp_path / "out")


def test_vendored_files_are_the_canonical_ones():
    from pipelines.data.shards import sha256_of

    for name, digest in mnist.CANONICAL.items():
        assert sha256_of(mnist.EMBEDDED_RAW / name) == digest, name


def shards_of(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_zero_row_idx_files_are_an_error_and_nothing_is_written(tmp_path, capsys):
    raw = make_mnist_like(tmp_path / "raw", 20, 0)
    assert prepare_main(["mnist", "--source", str(raw), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == f"data error: {raw}: split 'test' has no rows (zero-row IDX files)"
    assert not (tmp_path / "out").exists()


def test_prepare_replaces_a_dataset_whole_and_keeps_the_old_one_after_a_failure(tmp_path, monkeypatch):
    out = tmp_path / "out"
    mnist.prepare(make_mnist_like(tmp_path / "raw", 40, 10), out, 3, val_fraction=0)
    before = shards_of(out)
    other = make_mnist_like(tmp_path / "other", 30, 12, seed=1)

    def fail_on_test_split(table, folder, split, num_shards):  # a failure after the train shards are written
        if split == "test":
            raise KeyboardInterrupt
        return write_split_shards(table, folder, split, num_shards)

    monkeypatch.setattr(mnist, "write_split_shards", fail_on_test_split)
    with pytest.raises(KeyboardInterrupt):
        mnist.prepare(other, out, 2, val_fraction=0)
    assert shards_of(out) == before  # the old dataset, unmixed
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging folder left
    monkeypatch.undo()
    manifest = mnist.prepare(other, out, 2, val_fraction=0)  # fewer shards: no stale third shard beside the new ones
    assert sorted(shards_of(out)) == sorted(["manifest.json", *(s["file"] for split in ("train", "test")
                                                                for s in manifest["splits"][split]["shards"])])
    assert read_manifest(out)["splits"]["test"]["rows"] == 12


def test_out_must_be_a_folder_prepare_may_replace(tmp_path, capsys):
    raw = make_mnist_like(tmp_path / "raw", 20, 10)
    (tmp_path / "a_file").write_text("keep me")
    assert prepare_main(["mnist", "--source", str(raw), "--out", str(tmp_path / "a_file")]) == 2
    assert "a_file: exists and is not a folder" in capsys.readouterr().err
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me too")
    assert prepare_main(["mnist", "--source", str(raw), "--out", str(notes)]) == 2
    assert "notes: a non-empty folder that is not a prepared dataset" in capsys.readouterr().err
    assert (tmp_path / "a_file").read_text() == "keep me" and shards_of(notes) == {"todo.txt": b"keep me too"}


def test_manifest_shape_shard_schema_and_empty_split_are_checked_before_training(tmp_path, capsys):
    from pipelines.train import main as train_main

    out = tmp_path / "out"
    manifest = mnist.prepare(make_mnist_like(tmp_path / "raw", 40, 10), out, 2, val_fraction=0)
    train_args = ["trainer=ddp", f"data.path={out}"]
    (out / "manifest.json").write_text('{"dataset": "mnist"}')
    assert train_main(train_args) == 2
    assert "manifest.json: not a prepared-dataset manifest (no 'splits')" in capsys.readouterr().err
    write_manifest(out, manifest)
    shard = out / manifest["splits"]["test"]["shards"][0]["file"]
    rows = pq.read_table(shard).num_rows
    pq.write_table(pa.table({"image": pa.array([[0.0] * 784] * rows), "label": pa.array([0] * rows)}), shard)
    assert train_main(train_args) == 2  # right row count, wrong schema
    assert f"{shard}: schema (image: list<element: double>" in capsys.readouterr().err
    empty = {**manifest, "splits": {**manifest["splits"], "test": {"rows": 0, "shards": []}}}
    write_manifest(out, empty)
    assert train_main(train_args) == 2
    assert capsys.readouterr().err.strip() == f"error: {out}: split 'test' has no rows"


class Terminal:
    """A stand-in for sys.stdout that says whether it is a terminal (the only thing asked of it here)."""

    def __init__(self, tty: bool):
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("setting, tty, asked, wanted", [
    ("auto", True, None, True), ("auto", False, None, False),  # a terminal draws them, a log file does not
    ("auto", False, "0", True), ("auto", True, "1", False),     # RAY_DATA_DISABLE_PROGRESS_BARS decides when set
    ("on", False, "1", True), ("off", True, "0", False),        # run.progress=on|off decides alone
])
def test_progress_bars_only_where_someone_watches(monkeypatch, setting, tty, asked, wanted):
    from contract.progress import progress_wanted

    monkeypatch.setattr("sys.stdout", Terminal(tty))
    if asked is None:
        monkeypatch.delenv("RAY_DATA_DISABLE_PROGRESS_BARS", raising=False)
    else:
        monkeypatch.setenv("RAY_DATA_DISABLE_PROGRESS_BARS", asked)
    assert progress_wanted(setting) is wanted
