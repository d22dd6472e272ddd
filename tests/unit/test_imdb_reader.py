"""Reading aclImdb archives and folders (no Ray): cleaning, labels, movies, counted skips, the validation split
by movie, clear errors."""
from __future__ import annotations

import shutil

import pytest

from pipelines.data.idx import DataError
from pipelines.data.imdb import SplitReviews, clean_text, plan_splits, read_reviews, split_validation
from tests.conftest import free_port
from tests.support.imdb_fixtures import make_aclimdb, movie_of, tar_of


def test_clean_text_removes_br_tags_and_extra_space():
    assert clean_text("Great  film.<br /><br />Loved\tit <BR/>!") == "Great film. Loved it !"


def test_folder_and_archive_read_the_same_with_counted_skips(tmp_path):
    root = make_aclimdb(tmp_path / "folder", per_label=5, test_per_label=2)
    from_folder, outside = read_reviews(root)
    from_tar, outside_tar = read_reviews(tar_of(root, tmp_path / "a.tar.gz"))
    for split in ("train", "test"):
        assert from_folder[split].table().equals(from_tar[split].table())
        assert from_folder[split].movies == from_tar[split].movies
    train = from_folder["train"]
    assert train.labels.count(1) == 5 and train.labels.count(0) == 5
    assert dict(train.skipped) == {"malformed file name": 1, "not UTF-8": 1, "empty review": 1}
    assert from_folder["test"].table().num_rows == 4 and not from_folder["test"].skipped
    assert all(r >= 7 for r, label in zip(train.ratings, train.labels) if label == 1)
    assert [m.split("/")[-2] for m in train.movies] == [movie_of(i) for i in train.ids]  # from urls_<label>.txt
    assert dict(outside.skipped) == dict(outside_tar.skipped) == {"not in aclImdb/<train|test>/<pos|neg>/": 1}
    assert outside.skipped_examples[0].endswith("README: not in aclImdb/<train|test>/<pos|neg>/")


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


def test_prepare_reports_a_corrupt_archive_before_starting_ray(tmp_path, capsys, monkeypatch):
    import ray

    from pipelines.prepare import main as prepare_main

    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{free_port()}")  # no Ray there: connecting first would fail
    archive = tar_of(make_aclimdb(tmp_path / "folder", per_label=20, bad_files=False), tmp_path / "a.tar.gz")
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    assert prepare_main(["imdb", "--source", str(archive), "--out", str(tmp_path / "out")]) == 2
    assert "a.tar.gz: corrupt or truncated archive" in capsys.readouterr().err
    assert not ray.is_initialized() and not (tmp_path / "out").exists()


def test_validation_split_is_by_movie_deterministic_and_disjoint(tmp_path):
    reviews, _ = read_reviews(make_aclimdb(tmp_path / "f", per_label=20, bad_files=False))
    table, movies = reviews["train"].table(), reviews["train"].movies
    train_a, val_a, by_movie = split_validation(table, movies, 0.25, seed=3)
    train_b, val_b, _ = split_validation(table, movies, 0.25, seed=3)
    assert by_movie and train_a.equals(train_b) and val_a.equals(val_b)
    keys = lambda t: set(zip(t.column("id").to_pylist(), t.column("label").to_pylist()))
    assert not keys(train_a) & keys(val_a) and len(keys(train_a) | keys(val_a)) == 40
    films = lambda t: {movie_of(i) for i in t.column("id").to_pylist()}
    assert not films(train_a) & films(val_a)  # no movie on both sides
    assert val_a.num_rows == 12  # whole movies (4 reviews each) until a quarter (10) is reached
    assert not split_validation(table, movies, 0.25, seed=4)[1].equals(val_a)
    # Without movies (a CSV source) every review is its own group: exactly a quarter.
    train_c, val_c, by_movie = split_validation(table, [""] * len(movies), 0.25, seed=3)
    assert not by_movie and val_c.num_rows == 10 and train_c.num_rows == 30


def test_a_split_without_rows_is_an_error(tmp_path):
    everything_skipped = SplitReviews()
    everything_skipped.skip("empty review", "pos/0_9.txt")
    with pytest.raises(DataError, match=r"src: split 'train' has no rows \(every review skipped: .*empty review"):
        plan_splits({"train": everything_skipped}, SplitReviews(), tmp_path / "src", 0.1, 0)
    reviews, outside = read_reviews(make_aclimdb(tmp_path / "f", per_label=2, bad_files=False))
    with pytest.raises(DataError, match=r"split 'validation' has no rows \(--val-fraction 0.01 of 4 reviews\)"):
        plan_splits(reviews, outside, tmp_path / "f", 0.01, 0)


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
    pacsv.write_csv(pa.table({"text": [1, 2], "label": [0, 1]}), tmp_path / "numbers.csv")
    with pytest.raises(DataError, match="numbers.csv: column 'text' holds int64 values, not text"):
        read_table_file(tmp_path / "numbers.csv")


def test_a_long_review_keeps_its_head_and_its_tail():
    import pyarrow as pa

    from pipelines.data.tokenize import Tokenise, wordpiece_tokenizer

    words = [f"w{i}" for i in range(20)]
    tokenizer = wordpiece_tokenizer(words)
    full = tokenizer.encode(" ".join(words)).ids  # [CLS] w0 .. w19 [SEP]
    texts = pa.table({"text": [" ".join(words), "w3 w4"]})
    table = Tokenise(tokenizer.to_str(), 10, head_tokens=3)(texts)
    long, short = table.column("input_ids").to_pylist()
    assert long == full[:4] + full[-6:]  # [CLS] w0 w1 w2, then w15 .. w19 [SEP]
    assert short == tokenizer.encode("w3 w4").ids + [0] * 6  # shorter than max_len: whole, then [PAD]s
    assert table.column("length").to_pylist() == [10, 4]
    # head_tokens None (data prepared before it existed): the head alone, as the tokenizer's own truncation cuts.
    tokenizer.enable_truncation(10)
    head_only = Tokenise(tokenizer.to_str(), 10)(texts).column("input_ids").to_pylist()[0]
    assert head_only == tokenizer.encode(" ".join(words)).ids and head_only[-1] == full[-1]
