"""Prepare a dataset as Parquet shards + manifest (`rtp prepare`, or `python -m pipelines.prepare`).

    rtp prepare mnist [--source DIR | --download] [--out DIR] [--shards N]
    rtp prepare imdb --source ARCHIVE|FOLDER|FILE [--download] [--out DIR] [--vocab-size V] ...
    rtp prepare mnist --help      the options of one dataset


Exit codes: 0 ok, 2 bad input (the message names the file).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipelines.data import mnist
from pipelines.data.idx import DataError
from pipelines.data.shards import check_out_dir
from pipelines.ray_session import connect_or_start_ray, shutdown_ray


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rtp prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="dataset", required=True)
    mn = sub.add_parser("mnist", help="canonical MNIST IDX files -> Parquet shards")
    mn.add_argument("--source", type=Path, default=mnist.EMBEDDED_RAW,
                    help="folder with the four IDX files (.gz or not); default: the vendored copy")
    mn.add_argument("--download", action="store_true",
                    help="fetch the canonical files into --source first (SHA-256 verified)")
    mn.add_argument("--out", type=Path, default=Path("data/mnist/parquet"))
    mn.add_argument("--shards", type=int, default=4, help="Parquet files per split")
    im = sub.add_parser("imdb", help="aclImdb reviews -> WordPiece tokens in Parquet shards (Ray Data)")
    im.add_argument("--source", type=Path, default=Path("data/imdb/aclImdb_v1.tar.gz"),
                    help="aclImdb .tar.gz, its extracted folder, or a Parquet/CSV file with text,label")
    im.add_argument("--download", action="store_true",
                    help="fetch the official archive into the --source folder first (SHA-256 verified)")
    im.add_argument("--out", type=Path, default=Path("data/imdb/parquet"))
    im.add_argument("--shards", type=int, default=4)
    im.add_argument("--vocab-size", type=int, default=8000)
    im.add_argument("--max-len", type=int, default=256)
    im.add_argument("--head-tokens", type=int, default=128,
                    help="a longer review keeps this many tokens from its start and the rest from its end "
                         "(>= max-len - 2: its start only)")
    im.add_argument("--val-fraction", type=float, default=0.1)
    im.add_argument("--seed", type=int, default=0, help="seed of the shuffle and validation split")
    im.add_argument("--tokenizer", type=Path, default=None,
                    help="reuse this tokenizer.json instead of training one (same ids as an earlier run)")
    return parser.parse_args(argv)


def prepare_imdb(args: argparse.Namespace) -> dict:
    from pipelines.data import imdb

    source = args.source
    if args.download:
        source = imdb.download(source.parent if source.suffix == ".gz" else source)
    if not source.exists():
        raise DataError(f"{source}: not found (pass --source, or --download when online)")
    if args.tokenizer is not None and not args.tokenizer.is_file():
        raise DataError(f"{args.tokenizer}: tokenizer file not found")
    if not 0 < args.val_fraction < 1 or args.vocab_size < 16 or args.max_len < 4 or args.head_tokens < 0:
        raise DataError("--val-fraction must be in (0, 1), --vocab-size >= 16, --max-len >= 4, --head-tokens >= 0")
    # Bad input is reported before Ray starts (Ray only tokenises).
    splits = imdb.plan_splits(*imdb.read_source(source), source, args.val_fraction, args.seed)
    connect_or_start_ray({"include_dashboard": False, "log_to_driver": False}, log_to_driver=False)
    try:
        return imdb.prepare(splits, source, args.out.resolve(), args.shards, args.vocab_size, args.max_len,
                            min(args.head_tokens, args.max_len - 2), args.val_fraction, args.seed, args.tokenizer)
    finally:
        shutdown_ray()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.shards < 1:
        print(f"error: --shards must be >= 1, got {args.shards}", file=sys.stderr)
        return 2
    try:
        check_out_dir(args.out.resolve())
        if args.dataset == "imdb":
            manifest = prepare_imdb(args)
        else:
            if args.download:
                mnist.download(args.source)
            manifest = mnist.prepare(args.source, args.out.resolve(), args.shards)
    except DataError as err:
        print(f"data error: {err}", file=sys.stderr)
        return 2
    rows = ", ".join(f"{s}={info['rows']}" for s, info in manifest["splits"].items())
    print(f"wrote {args.shards} shards per split ({rows}) to {args.out.resolve()}")
    for split, info in manifest.get("skipped", {}).items():
        if info["counts"]:
            print(f"skipped in {split}: {info['counts']} (examples in manifest.json)")
    if "validation_grouped_by" in manifest:
        print(f"validation split drawn by {manifest['validation_grouped_by']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
