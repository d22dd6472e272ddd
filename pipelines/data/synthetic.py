"""`rtp prepare synthetic`: a generated dataset of any size, in the shards and manifest every prepared dataset has,
for tests and benchmarks of data larger than memory. Its rows follow a learnable rule, so accuracy still says
whether a run trained:

- numeric (`--features W`): W features drawn from N(0, 1); the label is the class whose column of a fixed random
  matrix the row scores highest against (a linear rule a small MLP learns);
- tokens (`--tokens T`): up to T token ids of a vocabulary; the label says whether a row holds more ids of the
  vocabulary's lower half than of its upper half (a bag-of-words rule).

Stored columns, as `rtp prepare table` stores them: `features` (float32 numbers, or int32 token ids with `length`),
`label` (int64 class id), `row` (the row's index in its split). Written shard by shard (`--rows-per-shard`), each
drawn from its own seed, so memory holds one shard whatever `--rows` says.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from contract.data import PAD_ID, DataSchema, Features, Target
from pipelines.data.idx import DataError
from pipelines.data.shards import row_group_rows, staged_output, write_manifest

SPLITS = ("train", "validation", "test")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `rtp prepare synthetic`."""
    parser.add_argument("--rows", type=int, required=True, help="rows in all, over the three splits")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--features", type=int, default=None, metavar="W",
                      help="numeric features per row (default 32, unless --tokens)")
    kind.add_argument("--tokens", type=int, default=None, metavar="T", help="token ids per row (padded to T)")
    parser.add_argument("--classes", type=int, default=10, help="numeric features: classes of the label")
    parser.add_argument("--vocab-size", type=int, default=1000, help="tokens: ids are below this")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="of the rows, for the validation split")
    parser.add_argument("--test-fraction", type=float, default=0.1, help="of the rows, for the test split")
    parser.add_argument("--rows-per-shard", type=int, default=100_000, help="rows of each Parquet file")
    parser.add_argument("--seed", type=int, default=0, help="of the rule and of every row")
    parser.add_argument("--name", default="synthetic", help="the dataset's name in its manifest")
    parser.add_argument("--out", type=Path, required=True, help="the prepared folder (replaced as a whole)")


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Generate every split shard by shard into a staging folder, then the manifest; returns it."""
    check_options(args)
    tokens = args.tokens is not None
    features = Features("features", "tokens", (args.tokens,), vocab_size=args.vocab_size, length_column="length",
                        id_column="row") if tokens else \
        Features("features", "numeric", (args.features or 32,), id_column="row")
    classes = 2 if tokens else args.classes
    rule = np.random.default_rng([args.seed, 0]).normal(size=(features.width, classes)).astype(np.float32)
    sizes = split_sizes(args.rows, args.val_fraction, args.test_fraction)
    with staged_output(args.out.resolve()) as stage:
        splits = {}
        for index, (split, rows) in enumerate(sizes.items()):
            shards = []
            for number, start in enumerate(range(0, rows, args.rows_per_shard)):
                count = min(args.rows_per_shard, rows - start)
                rng = np.random.default_rng([args.seed, 1 + index, number])
                table = token_rows(rng, start, count, args) if tokens else numeric_rows(rng, start, count, rule)
                name = f"{split}-{number:05d}-of-{-(-rows // args.rows_per_shard):05d}.parquet"
                pq.write_table(table, stage / name, row_group_size=row_group_rows(table))
                shards.append({"file": name, "rows": count})
            splits[split] = {"rows": rows, "shards": shards}
        target = Target("label", "classification", tuple(str(c) for c in range(classes)))
        manifest = {**DataSchema(args.name, features, target).to_dict(), "splits": splits, "seed": args.seed,
                    "rule": "token halves" if tokens else "linear", "schema": str(table.schema)}
        write_manifest(stage, manifest)
    return manifest


def check_options(args: argparse.Namespace) -> None:
    for key, value, low in (("rows", args.rows, 3), ("rows-per-shard", args.rows_per_shard, 1),
                            ("features", args.features, 1), ("tokens", args.tokens, 1), ("classes", args.classes, 2),
                            ("vocab-size", args.vocab_size, 4)):
        if value is not None and value < low:
            raise DataError(f"--{key}: must be >= {low}, got {value}")
    for key, value in (("val-fraction", args.val_fraction), ("test-fraction", args.test_fraction)):
        if not 0 < value < 0.5:
            raise DataError(f"--{key}: must be in (0, 0.5), got {value}")


def split_sizes(rows: int, val_fraction: float, test_fraction: float) -> dict[str, int]:
    """Rows of each split: every split at least one."""
    validation, test = max(1, round(rows * val_fraction)), max(1, round(rows * test_fraction))
    return {"train": rows - validation - test, "validation": validation, "test": test}


def numeric_rows(rng: np.random.Generator, start: int, count: int, rule: np.ndarray) -> pa.Table:
    """`count` rows of features ~ N(0, 1), labelled by the rule's best-scoring class."""
    values = rng.standard_normal((count, rule.shape[0]), dtype=np.float32)
    labels = np.argmax(values @ rule, axis=1)
    return rows_table(values, None, labels, start)


def token_rows(rng: np.random.Generator, start: int, count: int, args: argparse.Namespace) -> pa.Table:
    """`count` rows of between T/4 and T ids (1 .. vocab_size - 1, [PAD] after them), labelled 1 where more of
    them are in the vocabulary's lower half."""
    width, vocab = args.tokens, args.vocab_size
    lengths = rng.integers(max(1, width // 4), width + 1, size=count)
    ids = rng.integers(1, vocab, size=(count, width), dtype=np.int32)
    ids[np.arange(width)[None, :] >= lengths[:, None]] = PAD_ID
    lower = ((ids > 0) & (ids < vocab // 2)).sum(axis=1)
    labels = (2 * lower > lengths).astype(np.int64)
    return rows_table(ids, lengths, labels, start)


def rows_table(values: np.ndarray, lengths: np.ndarray | None, labels: np.ndarray, start: int) -> pa.Table:
    columns = {"features": pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])}
    if lengths is not None:
        columns["length"] = pa.array(lengths, pa.int32())
    columns.update(label=pa.array(labels, pa.int64()), row=pa.array(np.arange(start, start + len(labels)), pa.int64()))
    return pa.table(columns)
