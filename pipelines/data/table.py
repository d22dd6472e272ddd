"""A user's own table -> Parquet shards + manifest (`rtp prepare table`).

Sources: CSV files (.csv, .csv.gz), Parquet files, folders of them, or a folder HuggingFace `datasets` wrote with
`save_to_disk` (a Dataset, or a DatasetDict whose split folders give the splits), read with pyarrow alone.
Stored columns: `features` (numbers as float32, an image as uint8 pixels, or a text as int32 WordPiece ids, with
`length`), `label` (a class id, int64, or a float32 value) and `row` (the row's index in the concatenated sources,
so a prediction can be traced back). The splits a source does not give (by a column or folders) are carved from
its train rows with a seed, whole groups at a time with --group-by. Everything is read and checked before anything
is written; then the prepared folder is replaced at once.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from contract.data import DataSchema, Features, Target
from pipelines.data.idx import DataError
from pipelines.data.shards import check_not_empty, check_out_dir, staged_output, write_manifest, write_split_shards
from pipelines.data.table_sources import Sources, feature_columns, read_sources, sources_text

SPLITS = ("train", "validation", "test")
TOKENIZER = "tokenizer.json"


def image_shape(text: str) -> tuple[int, ...]:
    """`H,W` (grayscale) or `H,W,C`: positive integers."""
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) not in (2, 3) or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected H,W or H,W,C (positive integers), got {text!r}")
    return shape


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `rtp prepare table`."""
    parser.add_argument("--source", type=Path, nargs="+", required=True, metavar="PATH",
                        help="CSV (.csv, .csv.gz) or Parquet files, folders of them, or a HuggingFace save_to_disk "
                             "folder (a DatasetDict's train/validation/test folders give the splits)")
    parser.add_argument("--name", help="dataset name (default: the --out folder's name, or its parent's if it is "
                                       "called 'parquet')")
    parser.add_argument("--out", type=Path, required=True, help="the prepared folder (replaced as a whole)")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--features", nargs="+", metavar="COL",
                      help="numeric feature columns, or one column of fixed-size numeric lists (default: every "
                           "numeric or boolean column but the label, split and group ones, in the source's order)")
    kind.add_argument("--features-except", nargs="+", default=[], metavar="COL",
                      help="columns left out of the default features (an id, say)")
    kind.add_argument("--image", metavar="COL", help="an image column: uint8 pixel lists, PNG/JPEG bytes, "
                                                     "{'bytes', 'path'} structs or file paths (needs --image-shape)")
    kind.add_argument("--text", metavar="COL", help="a text column, tokenised with WordPiece")
    parser.add_argument("--image-shape", type=image_shape, metavar="H,W[,C]", help="every image's shape")
    parser.add_argument("--vocab-size", type=int, default=8000, help="of the tokenizer trained on the train split")
    parser.add_argument("--max-len", type=int, default=256, help="token ids per row (head and tail of longer texts)")
    parser.add_argument("--tokenizer", type=Path, help="reuse this tokenizer.json instead of training one (or a "
                        "model's folder holding one: a Transformers model's own tokenizer, for model=hf)")
    parser.add_argument("--label", required=True, metavar="COL", help="the target column")
    parser.add_argument("--task", choices=("classification", "regression"), default="classification")
    parser.add_argument("--split-column", metavar="COL",
                        help="gives each row's split: train, validation (val, valid, dev) or test")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="of the train rows, to carve validation")
    parser.add_argument("--test-fraction", type=float, default=0.1, help="of the train rows, to carve test")
    parser.add_argument("--group-by", metavar="COL", help="rows sharing a value of this column share a split")
    parser.add_argument("--seed", type=int, default=0, help="of the carving and of the train rows' order")
    parser.add_argument("--shards", type=int, default=2, help="Parquet files per split")


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Read and check the sources, split them, encode labels and features, then write the shards, the tokenizer
    (text) and the manifest in place of `args.out`. Returns the manifest."""
    check_options(args)
    out = args.out.resolve()
    check_out_dir(out)
    data = read_sources(args, out)
    rows, plan = plan_splits(data, args)
    labels, target, label_counts = encode_labels(data, rows, args)
    encoded = encode_features(data, rows, args)
    tables = {split: split_table(encoded, labels, index) for split, index in rows.items()}
    name = args.name or (out.parent.name if out.name == "parquet" else out.name)
    with staged_output(out) as stage:
        manifest = {"dataset": name, "schema": str(tables["train"].schema), "sources": data.sources,
                    "split_plan": plan, **DataSchema(name, encoded.features, target).to_dict(),
                    "splits": {split: {"rows": table.num_rows,
                                       "shards": write_split_shards(table, stage, split, args.shards)}
                               for split, table in tables.items()}}
        if label_counts:
            manifest["label_counts"] = label_counts
        if data.ignored_splits:
            manifest["ignored_splits"] = data.ignored_splits
        if encoded.tokenizer is not None:
            encoded.tokenizer.save(str(stage / TOKENIZER))
            manifest.update(tokenizer=TOKENIZER, tokenizer_from=str(args.tokenizer or "trained on the train split"),
                            model_inputs={"vocab_size": encoded.features.vocab_size, "max_len": args.max_len},
                            head_tokens=args.max_len // 2)
        write_manifest(stage, manifest)
    return manifest


def prepare_table(**options: Any) -> dict[str, Any]:
    """`prepare` called from Python (what a user's dataset spec calls): the options of `rtp prepare table` as
    keywords, `source=[...]`, `out=...`, `features=[...]`, `label=...` and so on, parsed as the command line
    parses them (the others at their defaults)."""
    argv: list[str] = []
    for key, value in options.items():
        if value is None or value is False or (isinstance(value, (list, tuple)) and not value):
            continue
        argv.append(f"--{key.replace('_', '-')}")
        if key == "image_shape":
            argv.append(",".join(map(str, value)))
        elif isinstance(value, (list, tuple)):
            argv += [str(item) for item in value]
        elif value is not True:
            argv.append(str(value))
    parser = argparse.ArgumentParser(prog="prepare_table", exit_on_error=False)
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as err:
        raise DataError(f"prepare_table: {err}") from None
    return prepare(args)


def check_options(args: argparse.Namespace) -> None:
    """The options' values, before any file is read."""
    fractions, problems = (args.val_fraction, args.test_fraction), []
    if not (min(fractions) >= 0 and max(fractions) < 1 and sum(fractions) < 1):
        problems.append(f"--val-fraction ({fractions[0]}) and --test-fraction ({fractions[1]}) must each be in "
                        f"[0, 1) and sum to less than 1")
    if args.shards < 1:
        problems.append(f"--shards must be >= 1, got {args.shards}")
    if bool(args.image) != bool(args.image_shape):
        problems.append("--image and --image-shape H,W[,C] go together")
    if args.text and (args.vocab_size < 16 or args.max_len < 4):
        problems.append("--vocab-size must be >= 16 and --max-len >= 4")
    if args.tokenizer is not None and args.tokenizer.is_dir():  # a model's folder: its tokenizer.json
        args.tokenizer = args.tokenizer / TOKENIZER
    if args.tokenizer is not None and not args.tokenizer.is_file():
        problems.append(f"{args.tokenizer}: tokenizer file not found")
    if args.label in feature_columns(args):
        problems.append(f"--label {args.label!r} is also a feature column")
    if problems:
        raise DataError("; ".join(problems))


# Splits, labels, features.

def plan_splits(data: Sources, args: argparse.Namespace) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Row indices per split, and how they were chosen: the splits the source gives, the others carved from its
    train rows (`carve`). Train rows are shuffled (Ray Data hands whole shards to workers); validation and test
    keep the source's order."""
    rng = np.random.default_rng(args.seed)
    given, n = data.columns.get("split"), len(data.columns["label"])
    rows = {"train": np.arange(n)} if given is None else {split: np.flatnonzero(given == split) for split in SPLITS}
    missing = {split: fraction for split, fraction in (("validation", args.val_fraction),
                                                       ("test", args.test_fraction)) if not len(rows.get(split, ()))}
    plan: dict[str, Any] = {"given_by": data.given_by} if data.given_by else {}
    if missing:
        rows.update(carve(rows["train"], missing, data.columns.get("group"), rng))
        plan.update({"carved": list(missing)} if data.given_by else {})
        plan.update(val_fraction=args.val_fraction, test_fraction=args.test_fraction, grouped_by=args.group_by)
    plan["seed"] = args.seed
    rows["train"] = rng.permutation(rows["train"])
    check_not_empty({split: len(rows[split]) for split in SPLITS}, sources_text(args),
                    f" (split plan {json.dumps(plan)}, {n} rows)")
    return {split: rows[split] for split in SPLITS}, plan


def carve(rows: np.ndarray, fractions: dict[str, float], groups: np.ndarray | None,
          rng: np.random.Generator) -> dict[str, np.ndarray]:
    """`rows` split into train and the splits of `fractions`, whole groups at a time (a row is its own group
    without --group-by): shuffled groups fill each split in turn until it holds its fraction of `rows`."""
    _, group_of, sizes = np.unique(rows if groups is None else groups[rows], return_inverse=True,
                                   return_counts=True)
    owner = np.zeros(len(sizes), dtype=int)  # 0: train, i: the i-th split of `fractions`
    order, at = rng.permutation(len(sizes)), 0
    for i, fraction in enumerate(fractions.values(), start=1):
        target, taken = round(fraction * len(rows)), 0
        while taken < target and at < len(order):
            owner[order[at]], taken, at = i, taken + sizes[order[at]], at + 1
    return {split: rows[owner[group_of] == i] for i, split in enumerate(("train", *fractions))}


def encode_labels(data: Sources, rows: dict[str, np.ndarray],
                  args: argparse.Namespace) -> tuple[np.ndarray, Target, dict[str, dict[str, int]]]:
    """Stored labels (class ids in sorted order of the values, or float32 values), the target and, for classes,
    each split's count of each."""
    values, where = data.columns["label"], f"{sources_text(args)}: column '{args.label}'"
    if args.task == "regression":
        return values.astype(np.float32), Target("label", "regression", ()), {}
    uniques, ids = np.unique(values, return_inverse=True)
    names = data.class_names
    if names and values.dtype.kind in "iu" and 0 <= uniques[0] and uniques[-1] < len(names):
        classes = tuple(str(names[value]) for value in uniques)
    else:
        classes = tuple(str(value) for value in uniques)
    if len(classes) < 2:
        raise DataError(f"{where}: only one class ({classes[0]!r}); classification needs 2 or more "
                        f"(or --task regression)")
    unseen = [classes[k] for k in np.flatnonzero(np.bincount(ids[rows["train"]], minlength=len(classes)) == 0)]
    if unseen:
        raise DataError(f"{where}: class {', '.join(map(repr, unseen))} appears only outside the train split; "
                        f"a model could never learn it")
    counts = {split: dict(zip(classes, np.bincount(ids[index], minlength=len(classes)).tolist()))
              for split, index in rows.items()}
    return ids.astype(np.int64), Target("label", "classification", classes), counts


@dataclass
class Encoded:
    """The stored features of every row, and what a worker needs to know of them."""
    values: np.ndarray          # [N, width]: float32 numbers, uint8 pixels or int32 token ids
    lengths: np.ndarray | None  # real tokens per row (text)
    features: Features
    tokenizer: Any = None       # text: the `tokenizers.Tokenizer`


def encode_features(data: Sources, rows: dict[str, np.ndarray], args: argparse.Namespace) -> Encoded:
    """Scaling statistics come from the train split only: validation and test stay unseen."""
    values, train = data.columns["features"], rows["train"]
    if args.text:
        return encode_text(values, train, args)
    if args.image:
        mean, std = pixel_stats(values[train])
        return Encoded(values, None, Features("features", "image", args.image_shape, (mean,), (std,),
                                              source_columns=(args.image,)))
    seen = values[train].astype(np.float64)
    std = seen.std(axis=0)
    std[std == 0] = 1.0
    return Encoded(values, None, Features("features", "numeric", (values.shape[1],), tuple(seen.mean(0).tolist()),
                                          tuple(std.tolist()), source_columns=data.feature_columns))


def pixel_stats(pixels: np.ndarray) -> tuple[float, float]:
    """Mean and std of pixel / 255, from a histogram: exact, without a float copy of the images."""
    counts, levels = np.bincount(pixels.ravel(), minlength=256), np.arange(256) / 255.0
    mean = counts @ levels / counts.sum()
    std = float(np.sqrt(counts @ (levels - mean) ** 2 / counts.sum()))
    return float(mean), std or 1.0


def encode_text(texts: np.ndarray, train: np.ndarray, args: argparse.Namespace) -> Encoded:
    """WordPiece ids, [PAD]-padded to --max-len; a longer text keeps its first max_len // 2 tokens and its end."""
    from tokenizers import Tokenizer

    from pipelines.data.tokenize import Tokenise, train_wordpiece

    if args.tokenizer is None:
        tokenizer = train_wordpiece(texts[train].tolist(), args.vocab_size)
    else:
        try:
            tokenizer = Tokenizer.from_file(str(args.tokenizer))
        except Exception as err:  # tokenizers raises plain Exceptions
            raise DataError(f"{args.tokenizer}: not a tokenizers JSON file ({' '.join(str(err).split())})") from err
    tokens = Tokenise(tokenizer.to_str(), args.max_len, args.max_len // 2)(pa.table({"text": texts.tolist()}))
    ids = tokens.column("input_ids").combine_chunks().flatten().to_numpy().reshape(len(texts), args.max_len)
    features = Features("features", "tokens", (args.max_len,), vocab_size=tokenizer.get_vocab_size(),
                        length_column="length", source_columns=(args.text,))
    return Encoded(ids, tokens.column("length").to_numpy(), features, tokenizer)


def split_table(encoded: Encoded, labels: np.ndarray, index: np.ndarray) -> pa.Table:
    """One split's rows as stored: features (a fixed-size list), [length], label, row."""
    values = encoded.values[index]
    columns = {"features": pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])}
    if encoded.lengths is not None:
        columns["length"] = pa.array(encoded.lengths[index], pa.int32())
    columns.update(label=pa.array(labels[index]), row=pa.array(index, pa.int64()))
    return pa.table(columns)
