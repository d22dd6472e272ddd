"""`rtp prepare synthetic`: generated rows in the shards and manifest every prepared dataset has, of a learnable
rule, drawn shard by shard from the seed; the config checks take them as any prepared data."""
from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipelines.config import ConfigError, load_config
from pipelines.data.shards import read_manifest
from pipelines.prepare import main as prepare_main


def read_split(folder, split):
    """(features, labels, rows) of a prepared split, its shards in order."""
    tables = [pq.read_table(folder / shard["file"]) for shard in read_manifest(folder)["splits"][split]["shards"]]
    features = np.concatenate([np.stack(t.column("features").to_numpy(zero_copy_only=False)) for t in tables])
    labels = np.concatenate([t.column("label").to_numpy() for t in tables])
    rows = np.concatenate([t.column("row").to_numpy() for t in tables])
    return features, labels, rows


def test_numeric_rows_follow_a_linear_rule_shard_by_shard_and_twice_alike(tmp_path, capsys):
    args = ["synthetic", "--rows", "1000", "--features", "6", "--classes", "3", "--rows-per-shard", "300"]
    assert prepare_main([*args, "--out", str(tmp_path / "a")]) == 0
    assert "wrote 1/3 shards per split (train=800, validation=100, test=100)" in capsys.readouterr().out
    manifest = read_manifest(tmp_path / "a")  # every shard's footer checked against the manifest
    assert manifest["features"]["kind"] == "numeric" and manifest["features"]["shape"] == [6]
    assert manifest["target"]["classes"] == ["0", "1", "2"]
    features, labels, rows = read_split(tmp_path / "a", "train")
    assert features.shape == (800, 6) and features.dtype == np.float32
    assert rows.tolist() == list(range(800))
    assert abs(features.mean()) < 0.1 and abs(features.std() - 1) < 0.1
    assert set(np.unique(labels)) == {0, 1, 2}
    # The rule is linear: a least-squares fit of one-hot labels on the features classifies most rows right.
    weights, *_ = np.linalg.lstsq(features, np.eye(3)[labels], rcond=None)
    assert (np.argmax(features @ weights, axis=1) == labels).mean() > 0.8
    assert prepare_main([*args, "--out", str(tmp_path / "b")]) == 0
    again, _, _ = read_split(tmp_path / "b", "train")
    np.testing.assert_array_equal(again, features)


def test_token_rows_are_padded_ids_labelled_by_which_half_of_the_vocabulary_they_hold_more_of(tmp_path):
    assert prepare_main(["synthetic", "--rows", "400", "--tokens", "12", "--vocab-size", "50",
                         "--out", str(tmp_path)]) == 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["features"]["kind"] == "tokens" and manifest["features"]["vocab_size"] == 50
    table = pq.read_table(tmp_path / manifest["splits"]["train"]["shards"][0]["file"])
    ids = np.stack(table.column("features").to_numpy(zero_copy_only=False))
    lengths, labels = table.column("length").to_numpy(), table.column("label").to_numpy()
    for row, length, label in zip(ids, lengths, labels):
        assert 3 <= length <= 12 and (row[:length] > 0).all() and (row[length:] == 0).all()
        assert label == int(2 * ((row > 0) & (row < 25)).sum() > length)
    cfg = load_config([f"data.path={tmp_path}", "model=embed_pool"])
    assert (cfg.data.name, cfg.run.monitor) == ("synthetic", "test_accuracy")


def test_bad_sizes_are_one_line_and_exit_2(tmp_path, capsys):
    assert prepare_main(["synthetic", "--rows", "2", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.strip() == "data error: --rows: must be >= 3, got 2"
    assert not (tmp_path / "x").exists()
    with pytest.raises(ConfigError, match=r"^data\.path: no prepared dataset"):
        load_config(["data=synthetic", f"data.path={tmp_path / 'x'}"])
