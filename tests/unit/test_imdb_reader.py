"""Reading aclImdb archives and folders (no Ray): cleaning, labels, counted skips, clear errors."""
from __future__ import annotations

import shutil

import pytest

from pipelines.data.idx import DataError
from pipelines.data.imdb import clean_text, read_reviews, shuffle_split
from tests.imdb_fixtures import make_aclimdb, tar_of


def test_clean_text_removes_br_tags_and_extra_space():
    assert clean_text("Great  film.<br /><br />Loved\tit <BR/>!") == "Great film. Loved it !"


def test_folder_and_archive_read_the_same_with_counted_skips(tmp_path):
    root = make_aclimdb(tmp_path / "folder", per_label=5, test_per_label=2)
    from_folder = read_reviews(root)
    from_tar = read_reviews(tar_of(root, tmp_path / "a.tar.gz"))
    for split in ("train", "test"):
        assert from_folder[split].table().equals(from_tar[split].table())
    train = from_folder["train"]
    assert train.labels.count(1) == 5 and train.labels.count(0) == 5
    assert dict(train.skipped) == {"malformed file name": 1, "not UTF-8": 1, "empty review": 1}
    assert from_folder["test"].table().num_rows == 4 and not from_folder["test"].skipped
    assert all(r >= 7 for r, label in zip(train.ratings, train.labels) if label == 1)


def test_missing_split_folder_is_an_error(tmp_path):
    root = make_aclimdb(tmp_path / "folder", per_label=3, bad_files=False)
    shutil.rmtree(root / "aclImdb" / "train" / "neg")
    with pytest.raises(DataError, match="missing or empty split folder.*aclImdb/train/neg"):
        read_reviews(root)


def test_corrupt_archive_is_an_error(tmp_path):
    root = make_aclimdb(tmp_path / "folder", per_label=20, bad_files=False)
    archive = tar_of(root, tmp_path / "a.tar.gz")
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    with pytest.raises(DataError, match="a.tar.gz: corrupt or truncated archive"):
        read_reviews(archive)


def test_validation_split_is_deterministic_and_disjoint(tmp_path):
    table = read_reviews(make_aclimdb(tmp_path / "f", per_label=20, bad_files=False))["train"].table()
    train_a, val_a = shuffle_split(table, 0.25, seed=3)
    train_b, val_b = shuffle_split(table, 0.25, seed=3)
    assert train_a.equals(train_b) and val_a.equals(val_b)
    assert val_a.num_rows == 10 and train_a.num_rows == 30
    keys = lambda t: set(zip(t.column("id").to_pylist(), t.column("label").to_pylist()))
    assert not keys(train_a) & keys(val_a) and len(keys(train_a) | keys(val_a)) == 40
    assert not shuffle_split(table, 0.25, seed=4)[1].equals(val_a)


def test_parquet_and_csv_sources_with_counted_skips(tmp_path):
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from pipelines.data.imdb import read_table_file

    table = pa.table({"text": ["Great<br />film", "", "awful", "meh"], "label": ["pos", "neg", "neg", "7"]})
    pq.write_table(table, tmp_path / "r.parquet")
    pacsv.write_csv(table, tmp_path / "r.csv")
    for path in (tmp_path / "r.parquet", tmp_path / "r.csv"):
        reviews = read_table_file(path)
        assert reviews.texts == ["Great film", "awful"] and reviews.labels == [1, 0]
        assert dict(reviews.skipped) == {"empty review": 1, "label not 0/1/neg/pos": 1}
    pq.write_table(pa.table({"review": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match="bad.parquet: no 'text' column"):
        read_table_file(tmp_path / "bad.parquet")
