"""MNIST: canonical IDX files -> Parquet shards (pyarrow) -> Ray Data datasets.

Shard schema: image fixed_size_list<uint8>[784], label int8. Pixels stay uint8 on disk and in the
object store (4x smaller than float32); workers normalise them.
"""
from __future__ import annotations

import shutil
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from contract.data import DataSchema, Features, Target
from pipelines.data.idx import DataError, read_idx
from pipelines.data.shards import check_not_empty, sha256_of, staged_output, write_manifest, write_split_shards

PIXELS = 28 * 28
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # the usual MNIST train-set statistics; workers normalise with them

# SHA-256 of the canonical gzip files (the same bytes torchvision's MD5 list accepts).
CANONICAL = {
    "train-images-idx3-ubyte.gz": "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
    "train-labels-idx1-ubyte.gz": "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
    "t10k-images-idx3-ubyte.gz": "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
    "t10k-labels-idx1-ubyte.gz": "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
}
MIRRORS = ("https://ossci-datasets.s3.amazonaws.com/mnist/", "https://yann.lecun.com/exdb/mnist/")
SPLIT_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
               "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
EMBEDDED_RAW = Path(__file__).resolve().parents[2] / "data" / "mnist" / "raw"

VAL_FRACTION = 1 / 12  # of the train file, as validation: 5,000 of MNIST's 60,000, the classic 55,000/5,000 split
SCHEMA = pa.schema([("image", pa.list_(pa.uint8(), PIXELS)), ("label", pa.int8())])


def download(dest: Path) -> None:
    """Fetch the four canonical files from a mirror, verifying SHA-256 before keeping each."""
    dest.mkdir(parents=True, exist_ok=True)
    for name, expected in CANONICAL.items():
        if (dest / name).is_file() and sha256_of(dest / name) == expected:
            continue
        errors = []
        for mirror in MIRRORS:
            tmp = dest / (name + ".part")
            try:
                with urllib.request.urlopen(mirror + name, timeout=60) as resp, open(tmp, "wb") as out:
                    shutil.copyfileobj(resp, out)
            except OSError as err:
                errors.append(f"{mirror}: {err}")
                continue
            if sha256_of(tmp) != expected:
                errors.append(f"{mirror}: SHA-256 mismatch")
                tmp.unlink()
                continue
            tmp.rename(dest / name)
            break
        else:
            raise DataError(f"{name}: download failed from every mirror: {'; '.join(errors)}")


def _find(source: Path, stem: str) -> Path:
    for candidate in (source / f"{stem}.gz", source / stem):
        if candidate.is_file():
            return candidate
    raise DataError(f"{source / (stem + '.gz')}: file not found (nor an uncompressed {stem})")


def read_split(source: Path, split: str) -> tuple[np.ndarray, np.ndarray, dict[str, str]]:
    """Images [N, 784] uint8 and labels [N] int8 of one split, plus the sources' checksums."""
    images_path, labels_path = (_find(source, stem) for stem in SPLIT_FILES[split])
    images = read_idx(images_path, expected_ndim=3)
    labels = read_idx(labels_path, expected_ndim=1)
    if images.shape[1:] != (28, 28):
        raise DataError(f"{images_path}: images are {images.shape[1:]}, expected (28, 28)")
    if len(images) != len(labels):
        raise DataError(f"{labels_path}: {len(labels)} labels for {len(images)} images in {images_path}")
    if labels.size and labels.max() > 9:
        raise DataError(f"{labels_path}: label {labels.max()} outside 0..9")
    sums = {p.name: sha256_of(p) for p in (images_path, labels_path)}
    return images.reshape(len(images), PIXELS), labels.astype(np.int8), sums


def to_table(images: np.ndarray, labels: np.ndarray) -> pa.Table:
    flat = pa.array(images.reshape(-1), type=pa.uint8())
    image_col = pa.FixedSizeListArray.from_arrays(flat, PIXELS)
    return pa.Table.from_arrays([image_col, pa.array(labels, type=pa.int8())], schema=SCHEMA)


def prepare(source: Path, out_dir: Path, num_shards: int, val_fraction: float = VAL_FRACTION) -> dict[str, Any]:
    """Convert the IDX files in `source` into Parquet shards + manifest in `out_dir` (replaced as a whole, only
    once everything is written). The last `val_fraction` of the train file becomes the validation split (0: none),
    so the epochs can be measured, the best one picked and training stopped early without the test split."""
    tables, sources = {}, {}
    for split in SPLIT_FILES:  # read and check everything before writing anything
        images, labels, sums = read_split(source, split)
        tables[split] = to_table(images, labels)
        sources.update(sums)
    check_not_empty({split: table.num_rows for split, table in tables.items()}, source, " (zero-row IDX files)")
    carved = round(tables["train"].num_rows * val_fraction)
    if carved:
        train = tables["train"]
        tables = {"train": train.slice(0, train.num_rows - carved),
                  "validation": train.slice(train.num_rows - carved), "test": tables["test"]}
        check_not_empty({"train": tables["train"].num_rows}, source, f" (--val-fraction {val_fraction} takes all)")
    splits = {}
    with staged_output(out_dir) as stage:
        for split, table in tables.items():
            shards = write_split_shards(table, stage, split, num_shards)
            splits[split] = {"rows": table.num_rows, "shards": shards}
        canonical = all(CANONICAL.get(name) == digest for name, digest in sources.items())
        manifest = {**mnist_schema().to_dict(), "schema": str(SCHEMA), "splits": splits,
                    "sources": sources, "source_dir": str(source), "canonical_sources": canonical}
        if carved:
            manifest["validation_from"] = f"the last {carved} rows of the train file"
        write_manifest(stage, manifest)
    return manifest


def mnist_schema(manifest: dict[str, Any] | None = None) -> DataSchema:
    """MNIST's features and target, as `rtp prepare mnist` records them (also the schema of a manifest written
    before manifests recorded one)."""
    return DataSchema("mnist", Features("image", "image", (28, 28), (MNIST_MEAN,), (MNIST_STD,)),
                      Target("label", "classification", tuple(str(digit) for digit in range(10))))


def add_arguments(parser: Any) -> None:
    """`rtp prepare mnist`'s options."""
    parser.add_argument("--source", type=Path, default=EMBEDDED_RAW,
                        help="folder with the four IDX files (.gz or not); default: the vendored copy")
    parser.add_argument("--download", action="store_true",
                        help="fetch the canonical files into --source first (SHA-256 verified)")
    parser.add_argument("--out", type=Path, default=Path("data/mnist/parquet"))
    parser.add_argument("--shards", type=int, default=4, help="Parquet files per split")
    parser.add_argument("--val-fraction", type=float, default=VAL_FRACTION,
                        help="the last fraction of the train file becomes the validation split, which each epoch "
                             "is measured on (default 1/12: the classic 55,000 + 5,000; 0: none, epochs are "
                             "measured on the test split)")


def prepare_command(args: Any) -> dict[str, Any]:
    """`rtp prepare mnist`: the IDX files (downloaded first if asked) as Parquet shards in `--out`."""
    if args.download:
        download(args.source)
    if not 0 <= args.val_fraction < 1:
        raise DataError(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    return prepare(args.source, args.out.resolve(), args.shards, args.val_fraction)
