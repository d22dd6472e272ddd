"""Prepare a dataset as Parquet shards: `python -m pipelines.prepare mnist [--source DIR | --download]`.

Exit codes: 0 ok, 2 bad input (the message names the file).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipelines.data import mnist
from pipelines.data.idx import DataError


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pipelines.prepare", description=__doc__)
    sub = parser.add_subparsers(dest="dataset", required=True)
    mn = sub.add_parser("mnist", help="canonical MNIST IDX files -> Parquet shards")
    mn.add_argument("--source", type=Path, default=mnist.EMBEDDED_RAW,
                    help="folder with the four IDX files (.gz or not); default: the vendored copy")
    mn.add_argument("--download", action="store_true",
                    help="fetch the canonical files into --source first (SHA-256 verified)")
    mn.add_argument("--out", type=Path, default=Path("data/mnist/parquet"))
    mn.add_argument("--shards", type=int, default=4, help="Parquet files per split")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.shards < 1:
        print(f"error: --shards must be >= 1, got {args.shards}", file=sys.stderr)
        return 2
    try:
        if args.download:
            mnist.download(args.source)
        manifest = mnist.prepare(args.source, args.out.resolve(), args.shards)
    except DataError as err:
        print(f"data error: {err}", file=sys.stderr)
        return 2
    rows = ", ".join(f"{s}={info['rows']}" for s, info in manifest["splits"].items())
    print(f"wrote {args.shards} shards per split ({rows}) to {args.out.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
