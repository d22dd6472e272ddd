"""`python -m pipelines.prepare imdb` end to end (local Ray for tokenisation) on generated archives."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.data.shards import read_manifest, shard_paths
from tests.conftest import ROOT, pipeline_env
from tests.support.imdb_fixtures import make_aclimdb, tar_of

pytestmark = pytest.mark.slow
MAX_LEN = 32
HEAD = 8  # a review longer than MAX_LEN ids keeps [CLS] + 8 tokens + its last 23 ids (its tail and [SEP])


def prepare(source: Path, out: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipelines.prepare", "imdb", "--source", str(source), "--out", str(out),
           "--shards", "2", "--vocab-size", "200", "--max-len", str(MAX_LEN), "--head-tokens", str(HEAD),
           "--val-fraction", "0.2", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, ray_head) -> tuple[Path, Path, Path]:
    base = tmp_path_factory.mktemp("imdb")
    root = make_aclimdb(base / "src", per_label=40, test_per_label=10)
    archive = tar_of(root, base / "aclImdb_v1.tar.gz")
    # HF's WordPiece trainer breaks frequency ties in hash-map order, so two trainings on this tiny,
    # tie-heavy text can pick different sub-word pieces; the second run reuses the first's tokenizer.
    reuse = ("--tokenizer", str(base / "from_folder" / "tokenizer.json"))
    for source, out, extra in ((root, base / "from_folder", ()), (archive, base / "from_tar", reuse)):
        proc = prepare(source, out, pipeline_env("unused", ray_head), *extra)  # on the session's Ray head
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "skipped in train" in proc.stdout
    return root, base / "from_folder", base / "from_tar"


def split_table(out: Path, split: str) -> pa.Table:
    return pa.concat_tables(pq.read_table(p) for p in shard_paths(out, read_manifest(out), split))


def test_shards_schema_counts_and_skips(prepared):
    _, out, _ = prepared
    manifest = read_manifest(out)
    rows = {s: i["rows"] for s, i in manifest["splits"].items()}
    # Validation: whole movies (4 reviews each, tests/support/imdb_fixtures.py) until 20% of the 80 is reached.
    assert rows == {"train": 64, "validation": 16, "test": 20}
    assert manifest["validation_grouped_by"] == "movie"
    assert all(len(i["shards"]) == 2 for i in manifest["splits"].values())
    assert manifest["skipped"]["train"]["counts"] == {"malformed file name": 1, "not UTF-8": 1, "empty review": 1}
    assert manifest["skipped"]["archive"]["counts"] == {"not in aclImdb/<train|test>/<pos|neg>/": 1}  # README
    from tokenizers import Tokenizer

    vocab_size = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    assert manifest["model_inputs"] == {"vocab_size": vocab_size, "max_len": MAX_LEN} and vocab_size <= 200
    assert manifest["head_tokens"] == HEAD
    table = split_table(out, "train")
    assert table.schema.field("input_ids").type == pa.list_(pa.int32(), MAX_LEN)
    assert set(table.column_names) == {"id", "rating", "label", "input_ids", "length"}
    lengths = table.column("length").to_numpy()
    ids = table.column("input_ids").combine_chunks().flatten().to_numpy().reshape(-1, MAX_LEN)
    for row, length in zip(ids, lengths):
        assert (row[length:] == 0).all() and (row[:length] != 0).all()  # [PAD]=0 exactly after the tokens
    assert set(table.column("label").to_pylist()) == {0, 1}


def test_a_long_review_keeps_its_head_and_its_tail(prepared):
    """Each train row against its review file, tokenised whole: a long one keeps its first HEAD tokens and its
    end (where a verdict often is), a short one is whole."""
    from tokenizers import Tokenizer

    from pipelines.data.imdb import clean_text

    root, out, _ = prepared
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokenizer.no_truncation()
    table = split_table(out, "train").to_pydict()
    cut = 0
    for review_id, rating, label, ids, length in zip(table["id"], table["rating"], table["label"],
                                                     table["input_ids"], table["length"]):
        folder = root / "aclImdb" / "train" / ("pos" if label else "neg")
        full = tokenizer.encode(clean_text((folder / f"{review_id}_{rating}.txt").read_text(encoding="utf-8"))).ids
        if len(full) <= MAX_LEN:
            assert ids[:length] == full
            continue
        cut += 1
        assert length == MAX_LEN
        assert ids[:1 + HEAD] == full[:1 + HEAD] and ids[1 + HEAD:] == full[-(MAX_LEN - 1 - HEAD):]
    assert 0 < cut < len(table["id"])  # both kinds are checked


def test_archive_and_folder_give_identical_output(prepared):
    """Same reviews, seed and tokenizer -> byte-for-byte the same table (deterministic split and tokens)."""
    _, from_folder, from_tar = prepared
    for split in ("train", "validation", "test"):
        assert split_table(from_folder, split).equals(split_table(from_tar, split)), split


def test_tokenizer_round_trip(prepared):
    from tokenizers import Tokenizer

    _, out, _ = prepared
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "the movie was really wonderful and the plot was dull"
    encoding = tokenizer.encode(text)
    assert encoding.tokens[0] == "[CLS]" and encoding.tokens[-1] == "[SEP]"
    assert tokenizer.decode(encoding.ids) == text
    assert tokenizer.token_to_id("[PAD]") == 0
