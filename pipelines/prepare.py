"""Prepare a dataset as Parquet shards + manifest (`rtp prepare`, or `python -m pipelines.prepare`).

    rtp prepare mnist [--source DIR | --download] [--out DIR] [--shards N]
    rtp prepare imdb --source ARCHIVE|FOLDER|FILE [--download] [--out DIR] [--vocab-size V] ...
    rtp prepare table --source FILE|FOLDER ... [--features COL ... | --features-except COL ... | --image COL |
                      --text COL] --label COL --out DIR
    rtp prepare synthetic --rows N [--features W | --tokens T] --out DIR   generated rows of any size
    rtp prepare --plugin my_project.rtp_plugins my_data ...   a dataset your module registers
    rtp prepare mnist --help      the options of one dataset

Exit codes: 0 ok, 2 bad input (the message names the file).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pipelines.data  # noqa: F401  (registers the built-in datasets)
from contract.console import one_line
from contract.registry import DATASETS, RegistryError, entry_point_plugins, load_plugins, ref_name, resolve
from pipelines.data.idx import DataError
from pipelines.data.shards import check_out_dir


def load_dataset_plugins(argv: list[str]) -> list[str]:
    """The `--plugin` modules (and installed packages' `rtp.plugins` entry points) imported, so their datasets are
    commands; the rest of the command line."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--plugin", action="append", default=[])
    known, rest = early.parse_known_args(argv)
    load_plugins([*known.plugin, *entry_point_plugins()])
    return rest


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rtp prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plugin", action="append", default=[], help="a module of yours that registers datasets")
    sub = parser.add_subparsers(dest="dataset", required=True)
    for spec in DATASETS.specs.values():
        options = sub.add_parser(spec.name, help=spec.description, description=spec.description)
        if spec.add_arguments is not None:
            try:
                resolve(spec.add_arguments)(options)
            except Exception as err:  # a plugin's: one line naming it, as a plugin that fails to load
                raise RegistryError(f"dataset '{spec.name}': add_arguments={ref_name(spec.add_arguments)} failed "
                                    f"({one_line(err)})") from err
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        load_dataset_plugins(argv)
        args = parse_args(argv)
    except RegistryError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if getattr(args, "shards", 1) < 1:
        print(f"error: --shards must be >= 1, got {args.shards}", file=sys.stderr)
        return 2
    if getattr(args, "out", None) is not None:
        args.out = Path(args.out)  # a plugin's option may be declared without type=Path
    try:
        if getattr(args, "out", None) is not None:
            check_out_dir(args.out.resolve())
        manifest = resolve(DATASETS.get(args.dataset).prepare)(args)
    except (DataError, ValueError) as err:  # ValueError: a plugin's `prepare` refusing its input
        print(f"data error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # the machine's, not the input's: a full disk, a file size limit, permissions
        print(f"error: {err.filename or args.out}: {err.strerror or err}; the previous dataset there, if any, is "
              f"unchanged", file=sys.stderr)
        return 1
    if not isinstance(manifest, dict) or not isinstance(manifest.get("splits"), dict):
        print(f"error: dataset '{args.dataset}': its prepare returned {type(manifest).__name__}, not the manifest it "
              f"wrote (pipelines.data.shards.write_manifest's)", file=sys.stderr)
        return 2
    splits = manifest["splits"]
    rows = ", ".join(f"{s}={info['rows']}" for s, info in splits.items())
    shards = {len(info["shards"]) for info in splits.values()}
    where = args.out.resolve() if getattr(args, "out", None) is not None else "its folder"
    print(f"wrote {'/'.join(map(str, sorted(shards)))} shards per split ({rows}) to {where}")
    for split, info in manifest.get("skipped", {}).items():
        if info["counts"]:
            print(f"skipped in {split}: {info['counts']} (examples in manifest.json)")
    if "validation_grouped_by" in manifest:
        print(f"validation split drawn by {manifest['validation_grouped_by']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
