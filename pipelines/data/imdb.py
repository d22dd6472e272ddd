"""IMDb Large Movie Review Dataset (Maas et al., ACL 2011): reviews -> cleaned text table.

Sources, in its published layout `aclImdb/{train,test}/{pos,neg}/{id}_{rating}.txt`:
the official `aclImdb_v1.tar.gz` (or any .tar.gz in that layout), its extracted folder, or a Parquet/CSV
file with `text,label` columns. Reviews that cannot be used (malformed file name, non-UTF-8 bytes, empty
text) are skipped and counted by reason, and so are archive members outside that layout; a missing split
folder or a split without one usable review is an error. The official archive's `<split>/urls_{pos,neg}.txt`
name each review's movie (line i: review i), and the validation split is drawn by movie from them.
"""
from __future__ import annotations

import re
import tarfile
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

import numpy as np
import pyarrow as pa

from contract.data import DataSchema, Features, Target
from pipelines.data.idx import DataError
from pipelines.data.shards import check_not_empty, sha256_of, staged_output, write_manifest, write_split_shards

OFFICIAL_URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
OFFICIAL_SHA256 = "c40f74a18d3b61f90feba1e17730e0d38e8b97c05fde7008942e91923d1658fe"
NAME_RE = re.compile(r"^(\d+)_(\d+)\.txt$")
URLS_RE = re.compile(r"^urls_(pos|neg)\.txt$")
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
    movies: list[str] = field(default_factory=list)  # the review's movie (urls_<label>.txt), "" if unknown
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


def _add_review(reviews: SplitReviews, label_dir: str, name: str, payload: bytes, urls: list[str]) -> None:
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
    review_id = int(match.group(1))
    reviews.ids.append(review_id)
    reviews.ratings.append(int(match.group(2)))
    reviews.labels.append(LABELS[label_dir])
    reviews.texts.append(text)
    reviews.movies.append(urls[review_id] if review_id < len(urls) else "")


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


def read_reviews(source: Path) -> tuple[dict[str, SplitReviews], SplitReviews]:
    """Reviews from an aclImdb archive or folder, in sorted file order: `train` (required) and `test`
    (when present; the train-only archive has none); and, as skips, the members outside that layout."""
    if not source.exists():
        raise DataError(f"{source}: not found")
    found: dict[str, dict[str, list[tuple[str, bytes]]]] = {s: {"pos": [], "neg": []} for s in ("train", "test")}
    urls: dict[tuple[str, str], list[str]] = {}
    outside = SplitReviews()
    for path, payload in _members(source):
        parts = path.parts
        # .../<split>/<pos|neg>/<file> and .../<split>/urls_<pos|neg>.txt; the aclImdb/ prefix is optional
        if len(parts) >= 3 and parts[-3] in found and parts[-2] in LABELS:
            found[parts[-3]][parts[-2]].append((parts[-1], payload))
        elif len(parts) >= 2 and parts[-2] in found and (url := URLS_RE.match(parts[-1])):
            urls[(parts[-2], url.group(1))] = payload.decode("utf-8", "replace").splitlines()
        else:
            outside.skip("not in aclImdb/<train|test>/<pos|neg>/", str(path))
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
                _add_review(reviews, label_dir, name, payload, urls.get((split, label_dir), []))
        result[split] = reviews
    return result, outside


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
    text_type = table.schema.field("text").type
    if not (pa.types.is_string(text_type) or pa.types.is_large_string(text_type)):
        raise DataError(f"{source}: column 'text' holds {text_type} values, not text")
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
            reviews.movies.append("")
    return reviews


def read_source(source: Path) -> tuple[dict[str, SplitReviews], SplitReviews]:
    """Every split's reviews from an archive, folder or Parquet/CSV file (no Ray needed: a bad source is
    reported before anything starts), plus the archive members outside the layout as skips."""
    if source.is_file() and source.suffix in (".parquet", ".csv"):
        return {"train": read_table_file(source)}, SplitReviews()
    return read_reviews(source)


def split_validation(table: pa.Table, movies: list[str], fraction: float,
                     seed: int) -> tuple[pa.Table, pa.Table, bool]:
    """Deterministic (by seed) shuffle and train/validation split, by movie where the reviews' movies are known:
    every review of a movie lands on the same side, so validation scores reviews of movies the model has not
    seen (IMDb has up to 30 reviews per movie). Reviews without a movie are groups of one. Shuffled, not
    sorted: the source is ordered neg-then-pos, and Ray Data hands whole shards to workers.
    Returns (train, validation, grouped by movie)."""
    rng = np.random.default_rng(seed)
    groups = np.array([movie or f"#review-{i}" for i, movie in enumerate(movies)])
    names, group_of, sizes = np.unique(groups, return_inverse=True, return_counts=True)
    target = int(round(fraction * table.num_rows))
    in_validation = np.zeros(len(names), dtype=bool)
    taken = 0
    for group in rng.permutation(len(names)):  # whole groups until the fraction is reached
        if taken >= target:
            break
        in_validation[group] = True
        taken += sizes[group]
    order = rng.permutation(table.num_rows)
    validation_rows = in_validation[group_of[order]]
    grouped = any(movies)
    return table.take(pa.array(order[~validation_rows])), table.take(pa.array(order[validation_rows])), grouped


@dataclass
class Splits:
    """The tables to tokenise and write, with what was skipped on the way."""
    tables: dict[str, pa.Table]
    skipped: dict[str, dict]
    by_movie: bool


def plan_splits(reviews: dict[str, SplitReviews], outside: SplitReviews, source: Path, val_fraction: float,
                seed: int) -> Splits:
    """train/validation (by movie) and test tables; a split without rows is an error."""
    skipped = {split: {"counts": dict(r.skipped), "examples": r.skipped_examples} for split, r in reviews.items()}
    if outside.skipped:
        skipped["archive"] = {"counts": dict(outside.skipped), "examples": outside.skipped_examples}
    check_not_empty({split: len(r.texts) for split, r in reviews.items()}, source,
                    f" (every review skipped: {skipped})")
    train, validation, by_movie = split_validation(reviews["train"].table(), reviews["train"].movies,
                                                   val_fraction, seed)
    tables = {"train": train, "validation": validation}
    if "test" in reviews:
        tables["test"] = reviews["test"].table()
    check_not_empty({split: table.num_rows for split, table in tables.items()}, source,
                    f" (--val-fraction {val_fraction} of {len(reviews['train'].texts)} reviews)")
    return Splits(tables, skipped, by_movie)


def prepare(splits: Splits, source: Path, out_dir: Path, num_shards: int, vocab_size: int, max_len: int,
            head_tokens: int, val_fraction: float, seed: int, tokenizer_path: Path | None = None) -> dict:
    """Splits (`plan_splits`) -> WordPiece tokenizer (trained on our train split only, or the one at
    `tokenizer_path`) -> tokenised Parquet shards in `out_dir` (replaced as a whole, once all is written); a
    review longer than `max_len` ids keeps `head_tokens` from its start and the rest from its end.
    Tokenises with Ray Data: needs a Ray connection."""
    from pipelines.data.tokenize import tokenise_table, train_wordpiece

    if tokenizer_path is not None:
        tokenizer = read_tokenizer(tokenizer_path)
    else:
        tokenizer = train_wordpiece(splits.tables["train"].column("text").to_pylist(), vocab_size)
    with staged_output(out_dir) as stage:
        tokenizer.save(str(stage / "tokenizer.json"))
        splits_info = {}
        for split, table in splits.tables.items():
            tokenised = tokenise_table(table, tokenizer.to_str(), max_len, head_tokens)
            splits_info[split] = {"rows": tokenised.num_rows,
                                  "shards": write_split_shards(tokenised, stage, split, num_shards)}
        manifest = {"dataset": "imdb", "splits": splits_info, "skipped": splits.skipped,
                    "source": str(source), "source_sha256": sha256_of(source) if source.is_file() else None,
                    "tokenizer": "tokenizer.json",
                    "tokenizer_from": str(tokenizer_path) if tokenizer_path else "trained on the train split",
                    "seed": seed, "val_fraction": val_fraction,
                    "validation_grouped_by": "movie" if splits.by_movie else "review",
                    "model_inputs": {"vocab_size": tokenizer.get_vocab_size(), "max_len": max_len},
                    "head_tokens": head_tokens,  # kept from a long review's start; the rest from its end
                    "schema": str(tokenised.schema),
                    **imdb_schema(tokenizer.get_vocab_size(), max_len).to_dict()}
        write_manifest(stage, manifest)
    return manifest


def imdb_schema(vocab_size: int, max_len: int) -> DataSchema:
    """IMDb's features and target, as `rtp prepare imdb` records them."""
    return DataSchema("imdb", Features("input_ids", "tokens", (max_len,), vocab_size=vocab_size,
                                       length_column="length", id_column="id", source_columns=("text",)),
                      Target("label", "classification", ("neg", "pos")))


def schema_of_old_manifest(manifest: dict[str, Any]) -> DataSchema:
    """The schema of an IMDb manifest written before manifests recorded one (its `model_inputs`)."""
    inputs = manifest.get("model_inputs", {})
    return imdb_schema(int(inputs.get("vocab_size", 0)), int(inputs.get("max_len", 0)))


def add_arguments(parser: Any) -> None:
    """`rtp prepare imdb`'s options."""
    parser.add_argument("--source", type=Path, default=Path("data/imdb/aclImdb_v1.tar.gz"),
                        help="aclImdb .tar.gz, its extracted folder, or a Parquet/CSV file with text,label")
    parser.add_argument("--download", action="store_true",
                        help="fetch the official archive into the --source folder first (SHA-256 verified)")
    parser.add_argument("--out", type=Path, default=Path("data/imdb/parquet"))
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--head-tokens", type=int, default=128,
                        help="a longer review keeps this many tokens from its start and the rest from its end "
                             "(>= max-len - 2: its start only)")
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0, help="seed of the shuffle and validation split")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="reuse this tokenizer.json instead of training one (same ids as an earlier run)")


def read_tokenizer(path: Path) -> Any:
    """A HF `tokenizers` tokenizer.json (`--tokenizer`); DataError naming the file when it is none."""
    from tokenizers import Tokenizer

    if not path.is_file():
        raise DataError(f"{path}: tokenizer file not found")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # the Rust library's errors: a file that is not JSON, or not a tokenizer's
        reason = (str(err).splitlines() or [""])[0][:160]
        raise DataError(f"{path}: not a tokenizer.json of HF tokenizers ({reason})") from None


def prepare_command(args: Any) -> dict:
    """`rtp prepare imdb`: bad input is reported before Ray starts (Ray only tokenises)."""
    from pipelines.ray_session import connect_or_start_ray, shutdown_ray

    source = args.source
    if args.download:
        source = download(source.parent if source.suffix == ".gz" else source)
    if not source.exists():
        raise DataError(f"{source}: not found (pass --source, or --download when online)")
    if args.tokenizer is not None:
        read_tokenizer(args.tokenizer)
    if not 0 < args.val_fraction < 1 or args.vocab_size < 16 or args.max_len < 4 or args.head_tokens < 0:
        raise DataError("--val-fraction must be in (0, 1), --vocab-size >= 16, --max-len >= 4, --head-tokens >= 0")
    splits = plan_splits(*read_source(source), source, args.val_fraction, args.seed)
    connect_or_start_ray({"include_dashboard": False, "log_to_driver": False}, log_to_driver=False)
    try:
        return prepare(splits, source, args.out.resolve(), args.shards, args.vocab_size, args.max_len,
                       min(args.head_tokens, args.max_len - 2), args.val_fraction, args.seed, args.tokenizer)
    finally:
        shutdown_ray()
