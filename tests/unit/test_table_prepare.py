"""`rtp prepare table`: a user's CSV, Parquet or HuggingFace save_to_disk table -> Parquet shards + manifest."""
from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from contract.data import DataSchema, Target
from pipelines.data import table as table_prep
from pipelines.data.idx import DataError
from pipelines.data.shards import read_manifest, sha256_of
from pipelines.data.table_sources import SPLIT_NAMES


def prepare(*argv: object) -> dict:
    parser = argparse.ArgumentParser()
    table_prep.add_arguments(parser)
    return table_prep.prepare(parser.parse_args([str(arg) for arg in argv]))


def stored(out: Path, manifest: dict, split: str) -> dict:
    """One split's stored columns, as Python lists, in shard order."""
    shards = [pq.read_table(out / shard["file"]) for shard in manifest["splits"][split]["shards"]]
    return pa.concat_tables(shards).to_pydict()


def write_csv(path: Path, columns: dict) -> Path:
    pd.DataFrame(columns).to_csv(path, index=False)
    return path


def numeric_csv(tmp_path: Path, rows: int = 200, seed: int = 0) -> tuple[Path, dict]:
    rng = np.random.default_rng(seed)
    columns = {"x1": rng.normal(5, 2, rows), "x2": rng.integers(0, 100, rows),
               "label": rng.choice(["e", "b", "a", "d", "c"], rows)}
    return write_csv(tmp_path / "table.csv", columns), columns


def test_csv_classes_sorted_ids_stats_and_manifest(tmp_path):
    source, columns = numeric_csv(tmp_path)
    out = tmp_path / "mine" / "parquet"
    manifest = prepare("--source", source, "--out", out, "--features", "x1", "x2", "--label", "label")

    assert manifest["dataset"] == "mine"
    assert {split: info["rows"] for split, info in manifest["splits"].items()} == \
        {"train": 160, "validation": 20, "test": 20}
    assert json.loads(json.dumps(manifest)) == read_manifest(out)
    assert manifest["sources"] == {"table.csv": sha256_of(source)}
    assert manifest["split_plan"] == {"val_fraction": 0.1, "test_fraction": 0.1, "grouped_by": None, "seed": 0}
    classes = ("a", "b", "c", "d", "e")
    source_values = np.stack([columns["x1"], columns["x2"]], axis=1).astype(np.float32)
    seen = []
    for split in ("train", "validation", "test"):
        data = stored(out, manifest, split)
        rows = np.asarray(data["row"])
        seen.append(rows)
        assert [classes[i] for i in data["label"]] == list(columns["label"][rows])
        np.testing.assert_array_equal(np.asarray(data["features"], np.float32), source_values[rows])
        assert sum(manifest["label_counts"][split].values()) == len(rows)
    assert sorted(np.concatenate(seen).tolist()) == list(range(200))

    train = source_values[seen[0]].astype(np.float64)
    schema = DataSchema.from_manifest(read_manifest(out))
    assert schema.target == Target("label", "classification", classes)
    assert (schema.features.kind, schema.features.shape, schema.features.source_columns) == \
        ("numeric", (2,), ("x1", "x2"))
    np.testing.assert_allclose(schema.features.mean, train.mean(axis=0), rtol=1e-9)
    np.testing.assert_allclose(schema.features.std, train.std(axis=0), rtol=1e-9)
    assert abs(schema.features.mean[0] - source_values[:, 0].mean()) > 1e-6  # the train split's, not all rows'


def test_regression_parquet_float_labels_and_list_features(tmp_path):
    rng = np.random.default_rng(1)
    values = rng.normal(size=(50, 3))
    target = values.sum(axis=1)
    pq.write_table(pa.table({"emb": pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), 3),
                             "y": target}), tmp_path / "data.parquet")
    out = tmp_path / "reg"
    manifest = prepare("--source", tmp_path / "data.parquet", "--out", out, "--features", "emb", "--label", "y",
                       "--task", "regression", "--val-fraction", "0.2", "--test-fraction", "0.2")
    train = pq.read_table(out / manifest["splits"]["train"]["shards"][0]["file"])
    assert train.schema.field("label").type == pa.float32()
    assert train.schema.field("features").type == pa.list_(pa.float32(), 3)
    data = stored(out, manifest, "test")
    np.testing.assert_allclose(data["label"], target[data["row"]].astype(np.float32))
    schema = DataSchema.from_manifest(manifest)
    assert schema.target == Target("label", "regression", ())
    assert schema.features.shape == (3,) and schema.features.source_columns == ("emb",)
    assert "label_counts" not in manifest


def test_folder_of_csv_files_in_sorted_order(tmp_path):
    folder = tmp_path / "tables"
    folder.mkdir()
    write_csv(folder / "b.csv", {"x": [10.0, 11.0, 12.0, 13.0, 14.0], "label": [0, 1, 0, 1, 0]})
    write_csv(folder / "a.csv.gz", {"x": [0.5, 1.5, 2.5, 3.5, 4.5], "label": [1, 0, 1, 0, 1]})
    argv = ("--source", folder, "--out", folder / "parquet", "--features", "x", "--label", "label",
            "--val-fraction", "0.2", "--test-fraction", "0.2")
    prepare(*argv)
    manifest = prepare(*argv)  # again: the prepared shards inside the source folder are not sources
    assert set(manifest["sources"]) == {"tables/a.csv.gz", "tables/b.csv"}
    assert manifest["dataset"] == "tables"
    for split in ("train", "validation", "test"):
        data = stored(folder / "parquet", manifest, split)
        assert [value[0] for value in data["features"]] == [[0.5, 1.5, 2.5, 3.5, 4.5, 10, 11, 12, 13, 14][row]
                                                            for row in data["row"]]


@pytest.mark.parametrize("values, classes", [([10, 2, 1, 2, 10, 1] * 5, ("1", "2", "10")),
                                             ([True, False] * 15, ("False", "True"))])
def test_numeric_and_boolean_classes_sorted_as_values(tmp_path, values, classes):
    source = write_csv(tmp_path / "t.csv", {"x": range(30), "label": values})
    manifest = prepare("--source", source, "--out", tmp_path / "o", "--features", "x", "--label", "label")
    assert manifest["target"]["classes"] == classes
    data = stored(tmp_path / "o", manifest, "train")
    assert [classes[i] for i in data["label"]] == [str(values[row]) for row in data["row"]]


def test_features_default_to_the_numeric_columns_in_source_order(tmp_path):
    """Without --features: every numeric or boolean column but the label, split, group and --features-except ones,
    as an 8x8-pixel table's 64 columns would be, recorded in the manifest."""
    rng = np.random.default_rng(5)
    columns = {"id": np.arange(40), "p1": rng.normal(size=40), "name": [f"n{i}" for i in range(40)],
               "label": np.arange(40) % 2, "p0": rng.integers(0, 16, 40),
               "part": ["train", "train", "test", "test"] * 10, "flag": [True, False, False, True] * 10,
               "movie": np.arange(40) % 5}
    source = write_csv(tmp_path / "t.csv", columns)
    manifest = prepare("--source", source, "--out", tmp_path / "o", "--label", "label", "--split-column", "part",
                       "--group-by", "movie", "--features-except", "id")
    assert manifest["features"]["source_columns"] == ("p1", "p0", "flag")
    data = stored(tmp_path / "o", manifest, "train")
    expected = np.stack([columns["p1"], columns["p0"], columns["flag"]], axis=1).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(data["features"], np.float32), expected[data["row"]])
    manifest = prepare("--source", source, "--out", tmp_path / "o2", "--label", "label")
    assert manifest["features"]["source_columns"] == ("id", "p1", "p0", "flag", "movie")


def test_features_except_goes_with_the_default_features_only(tmp_path):
    source, _ = numeric_csv(tmp_path)
    for kind in (["--features", "x1"], ["--text", "label"], ["--image", "x1", "--image-shape", "1,1"]):
        with pytest.raises(SystemExit):
            prepare("--source", source, "--out", tmp_path / "o", *kind, "--features-except", "x2", "--label", "label")
    manifest = table_prep.prepare_table(source=[source], out=tmp_path / "o", label="label", features_except=["x1"])
    assert manifest["features"]["source_columns"] == ("x2",)
    assert table_prep.prepare_table(source=[source], out=tmp_path / "o", label="label", features=[],
                                    features_except=[])["features"]["source_columns"] == ("x1", "x2")


def grouped_csv(tmp_path: Path) -> Path:
    rng = np.random.default_rng(2)
    sizes = rng.integers(1, 12, 40)
    movies = np.repeat([f"movie-{i}" for i in range(40)], sizes)
    return write_csv(tmp_path / "reviews.csv", {"movie": movies, "score": rng.normal(size=len(movies)),
                                                "label": rng.integers(0, 2, len(movies))})


def split_rows(out: Path, manifest: dict) -> dict[str, list[int]]:
    return {split: sorted(stored(out, manifest, split)["row"]) for split in manifest["splits"]}


def test_group_by_keeps_groups_whole_and_is_deterministic_per_seed(tmp_path):
    source = grouped_csv(tmp_path)
    movies = np.asarray(pa.csv.read_csv(source).column("movie").to_pylist())

    def carve(seed: int, out: str) -> dict[str, list[int]]:
        manifest = prepare("--source", source, "--out", tmp_path / out, "--features", "score", "--label", "label",
                           "--group-by", "movie", "--seed", seed, "--val-fraction", "0.2", "--test-fraction", "0.2")
        assert manifest["split_plan"]["grouped_by"] == "movie"
        return split_rows(tmp_path / out, manifest)

    first, again, other = carve(0, "a"), carve(0, "b"), carve(1, "c")
    assert first == again
    assert first != other
    for rows in (first, other):
        groups = {split: set(movies[index]) for split, index in rows.items()}
        assert not groups["train"] & groups["validation"] and not groups["train"] & groups["test"]
        assert not groups["validation"] & groups["test"]
        assert all(rows.values())


def test_split_column_gives_the_splits(tmp_path):
    parts = ["train", "VAL", "test", "train", "dev", "Train"] * 10
    source = write_csv(tmp_path / "t.csv", {"part": parts, "x": np.arange(60.0), "label": [0, 1] * 30})
    manifest = prepare("--source", source, "--out", tmp_path / "o", "--features", "x", "--label", "label",
                       "--split-column", "part")
    assert manifest["split_plan"] == {"given_by": "part", "seed": 0}
    expected = {split: [i for i, part in enumerate(parts) if SPLIT_NAMES[part.lower()] == split]
                for split in ("train", "validation", "test")}
    assert split_rows(tmp_path / "o", manifest) == expected


def write_hf_split(folder: Path, table: pa.Table) -> None:
    """A split as `datasets.Dataset.save_to_disk` writes it: Arrow IPC stream files, state.json, dataset_info.json."""
    folder.mkdir(parents=True)
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink, \
            pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}],
                                                   "_split": folder.name}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {
        "x": {"dtype": "float64", "_type": "Value"},
        "label": {"names": ["neg", "pos"], "_type": "ClassLabel"}}}))


def test_huggingface_dataset_dict_folder(tmp_path):
    source = tmp_path / "hf"
    write_hf_split(source / "train", pa.table({"x": np.arange(40.0), "label": np.arange(40) % 2}))
    write_hf_split(source / "test", pa.table({"x": np.arange(100.0, 110.0), "label": np.arange(10) % 2}))
    write_hf_split(source / "unsupervised", pa.table({"x": [1.0], "label": [-1]}))
    (source / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test", "unsupervised"]}))
    out = tmp_path / "out"
    manifest = prepare("--source", source, "--out", out, "--features", "x", "--label", "label",
                       "--val-fraction", "0.25")
    assert manifest["split_plan"]["given_by"] == "split folders"
    assert manifest["split_plan"]["carved"] == ["validation"]
    assert manifest["ignored_splits"] == ["unsupervised"]
    assert set(manifest["sources"]) == {"hf/train/data-00000-of-00001.arrow", "hf/test/data-00000-of-00001.arrow"}
    assert manifest["target"]["classes"] == ("neg", "pos")  # the ClassLabel's names
    rows = split_rows(out, manifest)
    assert rows["test"] == list(range(40, 50))
    assert len(rows["validation"]) == 10 and max(rows["validation"] + rows["train"]) < 40
    test = stored(out, manifest, "test")
    assert [value[0] for value in test["features"]] == [100.0 + row - 40 for row in test["row"]]


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("form", ["nested lists", "png bytes", "hf struct"])
def test_images(tmp_path, form):
    images = np.random.default_rng(3).integers(0, 256, (40, 8, 8), dtype=np.uint8)
    column = {"nested lists": lambda: pa.array(images.tolist(), pa.list_(pa.list_(pa.uint8()))),
              "png bytes": lambda: pa.array([png(image) for image in images], pa.binary()),
              "hf struct": lambda: pa.array([{"bytes": png(image), "path": None} for image in images],
                                            pa.struct([("bytes", pa.binary()), ("path", pa.string())]))}[form]()
    pq.write_table(pa.table({"image": column, "label": np.arange(40) % 4}), tmp_path / "images.parquet")
    out = tmp_path / "out"
    manifest = prepare("--source", tmp_path / "images.parquet", "--out", out, "--image", "image",
                       "--image-shape", "8,8", "--label", "label")
    train = stored(out, manifest, "train")
    np.testing.assert_array_equal(np.asarray(train["features"]), images[train["row"]].reshape(-1, 64))
    pixels = images[train["row"]] / 255.0
    features = DataSchema.from_manifest(manifest).features
    assert (features.kind, features.shape, features.source_columns) == ("image", (8, 8), ("image",))
    np.testing.assert_allclose(features.mean + features.std, (pixels.mean(), pixels.std()), rtol=1e-9)
    assert manifest["schema"].startswith("features: fixed_size_list<item: uint8>[64]")


def test_image_of_wrong_shape(tmp_path):
    images = [png(np.zeros((8, 8), np.uint8))] * 5 + [png(np.zeros((8, 9), np.uint8))]
    pq.write_table(pa.table({"image": images, "label": [0, 1] * 3}), tmp_path / "images.parquet")
    with pytest.raises(DataError, match=r"images.parquet: column 'image' row 5: .*shape \(8, 9\).*expected \(8, 8\)"):
        prepare("--source", tmp_path / "images.parquet", "--out", tmp_path / "out", "--image", "image",
                "--image-shape", "8,8", "--label", "label")


WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa romeo "
         "sierra tango uniform victor whiskey xray yankee zulu").split()  # no 'q'


def test_text_tokenised_with_a_tokenizer_of_the_train_split(tmp_path):
    rng = np.random.default_rng(4)
    texts = [" ".join(rng.choice(WORDS, rng.integers(3, 30))) for _ in range(80)]
    parts = ["train"] * 60 + ["validation"] * 10 + ["test"] * 10
    texts[-1] = "quiz quiz quiz"  # 'q' appears in test only: the tokenizer never saw it
    source = write_csv(tmp_path / "texts.csv", {"text": texts, "label": np.arange(80) % 2, "part": parts})
    out = tmp_path / "out"
    manifest = prepare("--source", source, "--out", out, "--text", "text", "--label", "label",
                       "--split-column", "part", "--vocab-size", "64", "--max-len", "12")
    features = DataSchema.from_manifest(manifest).features
    assert (features.kind, features.shape, features.length_column) == ("tokens", (12,), "length")
    vocab = json.loads((out / manifest["tokenizer"]).read_text())["model"]["vocab"]
    assert features.vocab_size == len(vocab) <= 64 and "q" not in vocab and "##q" not in vocab
    assert manifest["model_inputs"] == {"vocab_size": features.vocab_size, "max_len": 12}
    schema = pq.read_schema(out / manifest["splits"]["train"]["shards"][0]["file"])
    assert [schema.field(name).type for name in ("features", "length", "label", "row")] == \
        [pa.list_(pa.int32(), 12), pa.int32(), pa.int64(), pa.int64()]
    for split in ("train", "test"):
        data = stored(out, manifest, split)
        ids, lengths = np.asarray(data["features"]), np.asarray(data["length"])
        assert ids.max() < features.vocab_size and lengths.max() == 12
        assert all((row[length:] == 0).all() and (row[:length] != 0).all() for row, length in zip(ids, lengths))
    quiz = np.asarray(stored(out, manifest, "test")["features"])[-1]
    assert quiz[:5].tolist() == [vocab["[CLS]"], vocab["[UNK]"], vocab["[UNK]"], vocab["[UNK]"], vocab["[SEP]"]]


def bad_prepare(tmp_path: Path, *argv: object) -> str:
    with pytest.raises(DataError) as err:
        prepare("--out", tmp_path / "out", *argv)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_unknown_column_lists_the_available_ones(tmp_path):
    source, _ = numeric_csv(tmp_path)
    message = bad_prepare(tmp_path, "--source", source, "--features", "x1", "nope", "--label", "label")
    assert message == f"{source}: no column 'nope' (have x1, x2, label)"


def test_no_numeric_column_left_for_the_default_features(tmp_path):
    source = write_csv(tmp_path / "t.csv", {"id": range(6), "name": list("abcdef"), "label": [0, 1] * 3})
    message = bad_prepare(tmp_path, "--source", source, "--label", "label", "--features-except", "id")
    assert message == (f"{source}: no numeric column left to be the features (have id, name, label; left out: label, "
                       f"id); name them with --features, or use --image or --text")
    assert bad_prepare(tmp_path, "--source", source, "--label", "label", "--features-except", "nope") == \
        f"{source}: no column 'nope' (have id, name, label)"


def test_missing_file_and_a_single_class(tmp_path):
    assert bad_prepare(tmp_path, "--source", tmp_path / "nope.csv", "--features", "x", "--label", "label") == \
        f"{tmp_path / 'nope.csv'}: not found"
    source = write_csv(tmp_path / "t.csv", {"x": range(20), "label": ["a"] * 20})
    assert "only one class ('a')" in bad_prepare(tmp_path, "--source", source, "--features", "x", "--label", "label")


def test_null_label_names_file_count_and_first_row(tmp_path):
    source = write_csv(tmp_path / "t.csv", {"x": range(6), "label": ["a", "b", "a", None, "b", None]})
    message = bad_prepare(tmp_path, "--source", source, "--features", "x", "--label", "label")
    assert message == f"{source}: column 'label': 2 rows are null or NaN (first: row 3)"


def test_non_numeric_feature(tmp_path):
    source = write_csv(tmp_path / "t.csv", {"x": ["1", "2.5", "abc"], "label": [0, 1, 0]})
    message = bad_prepare(tmp_path, "--source", source, "--features", "x", "--label", "label")
    assert message == f"{source}: column 'x': holds text, not numbers (row 2: 'abc')"


def test_class_seen_only_in_test_is_named(tmp_path):
    source = write_csv(tmp_path / "t.csv", {"x": range(9), "label": ["a", "b", "a", "b", "a", "b", "a", "b", "z"],
                                            "part": ["train"] * 6 + ["validation", "validation", "test"]})
    message = bad_prepare(tmp_path, "--source", source, "--features", "x", "--label", "label",
                          "--split-column", "part")
    assert "column 'label': class 'z' appears only outside the train split" in message


def test_unknown_split_value(tmp_path):
    source = write_csv(tmp_path / "t.csv", {"x": range(4), "label": [0, 1, 0, 1], "part": ["train", "holdout"] * 2})
    message = bad_prepare(tmp_path, "--source", source, "--features", "x", "--label", "label",
                          "--split-column", "part")
    assert message == (f"{source}: column 'part': 2 rows are not train, validation (val, valid, dev) or test "
                       f"(first: row 1: 'holdout')")


@pytest.mark.parametrize("rows, argv, expected", [
    (20, ["--val-fraction", "0.6", "--test-fraction", "0.4"], "must each be in [0, 1) and sum to less than 1"),
    (20, ["--test-fraction", "0"], "split 'test' has no rows"),
    (4, [], "split 'validation', 'test' has no rows"),  # 0.1 of 4 rows rounds to none
    (20, ["--group-by", "x", "--val-fraction", "0.5"], "split 'train', 'test' has no rows"),  # one group
])
def test_fractions_that_leave_a_split_empty(tmp_path, rows, argv, expected):
    source = write_csv(tmp_path / "t.csv", {"x": [1] * rows, "label": [0, 1] * (rows // 2)})
    assert expected in bad_prepare(tmp_path, "--source", source, "--features", "x", "--label", "label", *argv)


def test_a_failing_prepare_leaves_the_prepared_folder_unchanged(tmp_path, monkeypatch):
    source, _ = numeric_csv(tmp_path)
    out = tmp_path / "data" / "parquet"
    prepare("--source", source, "--out", out, "--features", "x1", "--label", "label")
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    with pytest.raises(DataError):  # refused while reading
        prepare("--source", source, "--out", out, "--features", "nope", "--label", "label")

    def broken(*_):
        raise OSError("disk full")
    monkeypatch.setattr(table_prep, "write_manifest", broken)
    with pytest.raises(OSError, match="disk full"):  # failed while writing
        prepare("--source", source, "--out", out, "--features", "x2", "--label", "label", "--shards", "3")
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert [path.name for path in out.parent.iterdir()] == ["parquet"]  # no staging folder left
