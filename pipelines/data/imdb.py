"""IMDb Large Movie Review Dataset (Maas et al., ACL 2011): reviews -> cleaned text table.

Sources, in its published layout `aclImdb/{train,test}/{pos,neg}/{id}_{rating}.txt`:
the official `aclImdb_v1.tar.gz` (or any .tar.gz in that layout), its extracted folder, or a Parquet/CSV
file with `text,label` columns. Reviews that cannot be used (malformed file name, non-UTF-8 bytes, empty
text) are skipped and counted by reason; a missing split folder is an error.
"""
from __future__ import annotations

import re
import tarfile
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Iterator

import numpy as np
import pyarrow as pa

from pipelines.data.idx import DataError
from pipelines.data.shards import sha256_of

OFFICIAL_URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
OFFICIAL_SHA256 = "c40f74a18d3b61f90feba1e17730e0d38e8b97c05fde7008942e91923d1658fe"
NAME_RE = re.compile(r"^(\d+)_(\d+)\.txt$")
LABELS = {"neg": 0, "pos": 1}
BR_RE = re.compile(r"<br\s*/?>", re.IGNORECASE)
SPACE_RE = re.compile(r"\s+")


@dataclass
class SplitReviews:
    """One split's reviews as columns, plus the skips counted by reason."""
    ids: list[int] = field(default_factory=list)
    ratings: list[int] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)
    skipped_examples: list[str] = field(default_factory=list)

    def skip(self, reason: str, name: str) -> None:
        self.skipped[reason] += 1
        if len(self.skipped_examples) < 20:
            self.skipped_examples.append(f"{name}: {reason}")

    def table(self) -> pa.Table:
        return pa.table({"id": pa.array(self.ids, pa.int32()), "rating": pa.array(self.ratings, pa.int8()),
                         "label": pa.array(self.labels, pa.int8()), "text": pa.array(self.texts, pa.string())})


def clean_text(text: str) -> str:
    return SPACE_RE.sub(" ", BR_RE.sub(" ", text)).strip()


def download(dest: Path) -> Path:
    """Fetch the official archive with a progress bar and check its SHA-256; returns its path."""
    from tqdm import tqdm

    dest.mkdir(parents=True, exist_ok=True)
    target = dest / "aclImdb_v1.tar.gz"
    if target.is_file() and sha256_of(target) == OFFICIAL_SHA256:
        return target
    part = dest / "aclImdb_v1.tar.gz.part"
    try:
        with urllib.request.urlopen(OFFICIAL_URL, timeout=60) as resp, open(part, "wb") as out:
            total = int(resp.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc="aclImdb_v1.tar.gz") as bar:
                for block in iter(lambda: resp.read(1 << 20), b""):
                    out.write(block)
                    bar.update(len(block))
    except OSError as err:
        raise DataError(f"{OFFICIAL_URL}: download failed ({err}); pass a local archive or folder") from err
    if sha256_of(part) != OFFICIAL_SHA256:
        part.unlink()
        raise DataError(f"{OFFICIAL_URL}: SHA-256 mismatch, download discarded")
    part.rename(target)
    return target


def _add_review(reviews: SplitReviews, label_dir: str, name: str, payload: bytes) -> None:
    match = NAME_RE.match(name)
    if not match:
        reviews.skip("malformed file name", f"{label_dir}/{name}")
        return
    try:
        text = clean_text(payload.decode("utf-8"))
    except UnicodeDecodeError:
        reviews.skip("not UTF-8", f"{label_dir}/{name}")
        return
    if not text:
        reviews.skip("empty review", f"{label_dir}/{name}")
        return
    reviews.ids.append(int(match.group(1)))
    reviews.ratings.append(int(match.group(2)))
    reviews.labels.append(LABELS[label_dir])
    reviews.texts.append(text)


def _members(source: Path) -> Iterator[tuple[PurePosixPath, bytes]]:
    """(path inside the dataset, bytes) of every file, from an archive or a folder."""
    if source.is_dir():
        for path in sorted(source.rglob("*")):
            if path.is_file():
                yield PurePosixPath(path.relative_to(source).as_posix()), path.read_bytes()
        return
    try:
        with tarfile.open(source, "r:*") as archive:
            for member in archive:
                if member.isfile():
                    yield PurePosixPath(member.name), archive.extractfile(member).read()
    except (tarfile.TarError, EOFError, OSError) as err:
        raise DataError(f"{source}: corrupt or truncated archive ({err})") from err


def read_reviews(source: Path) -> dict[str, SplitReviews]:
    """Reviews from an aclImdb archive or folder, in sorted file order: `train` (required) and `test`
    (when present; the train-only archive has none)."""
    if not source.exists():
        raise DataError(f"{source}: not found")
    found: dict[str, dict[str, list[tuple[str, bytes]]]] = {s: {"pos": [], "neg": []} for s in ("train", "test")}
    for path, payload in _members(source):
        parts = path.parts
        # .../<split>/<pos|neg>/<file>; the aclImdb/ prefix is optional for folders
        if len(parts) >= 3 and parts[-3] in found and parts[-2] in LABELS:
            found[parts[-3]][parts[-2]].append((parts[-1], payload))
    result = {}
    for split, by_label in found.items():
        if split == "test" and not any(by_label.values()):
            continue
        missing = [label for label, files in by_label.items() if not files]
        if missing:
            raise DataError(f"{source}: missing or empty split folder(s) "
                            f"{', '.join(f'aclImdb/{split}/{m}' for m in missing)}")
        reviews = SplitReviews()
        for label_dir in ("neg", "pos"):
            for name, payload in sorted(by_label[label_dir]):
                _add_review(reviews, label_dir, name, payload)
        result[split] = reviews
    return result


def read_table_file(source: Path) -> SplitReviews:
    """A Parquet or CSV file with `text,label` columns (label 0/1 or neg/pos)."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(source) if source.suffix == ".parquet" else pacsv.read_csv(source)
    except (OSError, pa.ArrowInvalid) as err:
        raise DataError(f"{source}: not a readable Parquet/CSV file ({err})") from err
    for column in ("text", "label"):
        if column not in table.column_names:
            raise DataError(f"{source}: no '{column}' column (have {table.column_names})")
    reviews = SplitReviews()
    for row, (text, label) in enumerate(zip(table.column("text").to_pylist(), table.column("label").to_pylist())):
        label = LABELS.get(label, label) if isinstance(label, str) else label
        cleaned = clean_text(text or "")
        if label not in (0, 1):
            reviews.skip("label not 0/1/neg/pos", f"row {row}")
        elif not cleaned:
            reviews.skip("empty review", f"row {row}")
        else:
            reviews.ids.append(row)
            reviews.ratings.append(-1)
            reviews.labels.append(int(label))
            reviews.texts.append(cleaned)
    return reviews


def shuffle_split(table: pa.Table, fraction: float, seed: int) -> tuple[pa.Table, pa.Table]:
    """Deterministic (by seed) shuffle and train/validation split. Shuffled, not sorted: the source is
    ordered neg-then-pos, and Ray Data hands whole shards to workers."""
    order = np.random.default_rng(seed).permutation(table.num_rows)
    n_val = int(round(fraction * table.num_rows))
    return table.take(pa.array(order[n_val:])), table.take(pa.array(order[:n_val]))


def prepare(source: Path, out_dir: Path, num_shards: int, vocab_size: int, max_len: int,
            val_fraction: float, seed: int, tokenizer_path: Path | None = None) -> dict:
    """Reviews -> WordPiece tokenizer (trained on our train split only, or the one at `tokenizer_path`)
    -> tokenised Parquet shards."""
    from pipelines.data.shards import write_manifest, write_split_shards
    from pipelines.data.tokenize import tokenise_table, train_wordpiece

    if source.is_file() and source.suffix in (".parquet", ".csv"):
        tables, skipped = {"train": read_table_file(source)}, {}
    else:
        tables, skipped = read_reviews(source), {}
    train, validation = shuffle_split(tables["train"].table(), val_fraction, seed)
    out = {"train": train, "validation": validation}
    if "test" in tables:
        out["test"] = tables["test"].table()
    for split, reviews in tables.items():
        skipped[split] = {"counts": dict(reviews.skipped), "examples": reviews.skipped_examples}

    if tokenizer_path is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    else:
        tokenizer = train_wordpiece(train.column("text").to_pylist(), vocab_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    splits_info = {}
    for split, table in out.items():
        tokenised = tokenise_table(table, tokenizer.to_str(), max_len)
        splits_info[split] = {"rows": tokenised.num_rows,
                              "shards": write_split_shards(tokenised, out_dir, split, num_shards)}
    manifest = {"dataset": "imdb", "splits": splits_info, "skipped": skipped,
                "source": str(source), "source_sha256": sha256_of(source) if source.is_file() else None,
                "tokenizer": "tokenizer.json",
                "tokenizer_from": str(tokenizer_path) if tokenizer_path else "trained on the train split",
                "seed": seed, "val_fraction": val_fraction,
                "model_inputs": {"vocab_size": tokenizer.get_vocab_size(), "max_len": max_len},
                "schema": str(tokenised.schema)}
    write_manifest(out_dir, manifest)
    return manifest

