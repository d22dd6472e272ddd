"""Parquet shards + manifest: the on-disk contract between `prepare` and the Ray Data readers.

A prepared dataset folder holds `<split>-<i>-of-<n>.parquet` files and `manifest.json`:
    {"dataset": ..., "schema": ..., "splits": {split: {"rows": N, "shards": [{"file", "rows"}]}},
     "sources": {name: sha256}, ...}
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from contract.data import MANIFEST
from contract.tracking import DatasetRef
from pipelines.data import data_schema
from pipelines.data.idx import DataError



def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


ROW_GROUP_BYTES = 8 << 20  # about this much of a table in each Parquet row group


def row_group_rows(table: pa.Table) -> int:
    """Rows of a row group of about ROW_GROUP_BYTES: a streaming rank reads only the row groups it trains rows of
    (trainers/streamed.py), so a file of many groups is read in part."""
    return max(1, min(table.num_rows, ROW_GROUP_BYTES * table.num_rows // max(1, table.nbytes)))


def write_split_shards(table: pa.Table, out_dir: Path, split: str, num_shards: int) -> list[dict]:
    """Write `table` as `num_shards` near-equal Parquet files (row groups of about ROW_GROUP_BYTES); return their
    manifest entries."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    bounds = np.linspace(0, table.num_rows, num_shards + 1).astype(int)
    entries = []
    for i in range(num_shards):
        name = f"{split}-{i:05d}-of-{num_shards:05d}.parquet"
        piece = table.slice(bounds[i], bounds[i + 1] - bounds[i])
        pq.write_table(piece, out_dir / name, row_group_size=row_group_rows(piece))
        entries.append({"file": name, "rows": piece.num_rows})
    return entries


def write_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def check_out_dir(out_dir: Path) -> None:
    """Refuse an output folder that is a file, or a non-empty folder that is not a prepared dataset: writing a
    dataset replaces the folder's contents, which would be lost."""
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"{out_dir}: exists and is not a folder; --out must name a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MANIFEST).is_file():
        raise DataError(f"{out_dir}: a non-empty folder that is not a prepared dataset (no {MANIFEST}); "
                        f"--out must name a new, empty or earlier prepared folder (its contents are replaced)")


@contextmanager
def staged_output(out_dir: Path) -> Iterator[Path]:
    """A new folder beside `out_dir` to write a dataset into, put in `out_dir`'s place only when the block
    finishes. After any failure (Ctrl-C too) the old dataset is untouched and the staging folder is gone.
    The old dataset's folder is replaced whole: see `check_out_dir`."""
    check_out_dir(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.staging-", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(stage, 0o777 & ~umask)  # mkdtemp makes it private; the dataset is read by Ray workers, other users
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    # Two renames: between them the old dataset sits complete at `old` (a crash there loses nothing).
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    if out_dir.exists():
        out_dir.rename(old)
    stage.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


def check_not_empty(rows: dict[str, int], source: Path | str, hint: str = "") -> None:
    """A split without rows is an input error, never a dataset."""
    empty = [split for split, count in rows.items() if count == 0]
    if empty:
        raise DataError(f"{source}: split {', '.join(repr(s) for s in empty)} has no rows{hint}")


def _check_shape(manifest: Any, path: Path) -> None:
    """The manifest is ours: {"splits": {split: {"rows": N, "shards": [{"file", "rows"}]}}, "schema": ...}."""
    splits = manifest.get("splits") if isinstance(manifest, dict) else None
    if not isinstance(splits, dict) or not splits:
        raise DataError(f"{path}: not a prepared-dataset manifest (no 'splits'); "
                        f"run `rtp prepare ...` to make one")
    for split, info in splits.items():
        shards = info.get("shards") if isinstance(info, dict) else None
        if not (isinstance(shards, list) and isinstance(info.get("rows"), int)
                and all(isinstance(s, dict) and isinstance(s.get("rows"), int) and isinstance(s.get("file"), str)
                        and "/" not in s["file"] for s in shards)):
            raise DataError(f"{path}: split '{split}' is not of the form "
                            f"{{\"rows\": N, \"shards\": [{{\"file\": NAME, \"rows\": N}}, ...]}}")


def _same_types(schema: str) -> str:
    """A schema's text with list children named alike: Parquet calls Arrow's list `item` `element`."""
    return re.sub(r"\b(item|element)\b", "item", schema)


def read_manifest(data_dir: str | Path) -> dict[str, Any]:
    """Read and check a prepared folder without loading data: the manifest has our shape, and every shard
    exists, is readable Parquet, and has the row count and schema the manifest says. Cheap (footers only);
    runs before any cluster work."""
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST
    if not path.is_file():
        raise DataError(f"{path}: no manifest; run `rtp prepare ...` first")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON ({err})") from err
    _check_shape(manifest, path)
    columns = None if "schema" in manifest else _named_columns(manifest)
    for split, info in manifest["splits"].items():
        held = sum(shard["rows"] for shard in info["shards"])
        if held != info["rows"]:
            raise DataError(f"{path}: split '{split}' says {info['rows']} rows, its shards say {held}")
        for shard in info["shards"]:
            shard_path = data_dir / shard["file"]
            try:
                metadata = pq.read_metadata(shard_path)
            except (OSError, pa.ArrowInvalid) as err:
                raise DataError(f"{shard_path}: missing or not a readable Parquet file ({err})") from err
            if metadata.num_rows != shard["rows"]:
                raise DataError(f"{shard_path}: has {metadata.num_rows} rows, manifest says {shard['rows']}")
            schema = str(metadata.schema.to_arrow_schema())
            if "schema" in manifest and _same_types(schema) != _same_types(manifest["schema"]):
                raise DataError(f"{shard_path}: schema ({schema.replace(chr(10), '; ')}) is not the manifest's "
                                f"({manifest['schema'].replace(chr(10), '; ')})")
            if columns is not None:
                _check_columns(shard_path, metadata.schema.to_arrow_schema(), columns)
    return manifest


def _named_columns(manifest: dict[str, Any]) -> dict[str, str] | None:
    """{column: what it must hold} of the features and target a manifest without a `schema` names (the shards'
    columns are then checked against these), or None when it names none."""
    try:
        inputs = data_schema(manifest)
    except (KeyError, TypeError, ValueError):
        return None  # the config check says what is missing (pipelines/checks.py read_data_schema)
    numbers = "a list of numbers per row"
    columns = {inputs.features.column: numbers,
               inputs.target.column: "integer class ids" if inputs.target.task == "classification" else "numbers"}
    if inputs.features.length_column:
        columns[inputs.features.length_column] = "integer lengths"
    return columns


def _check_columns(shard_path: Path, schema: pa.Schema, columns: dict[str, str]) -> None:
    for name, holds in columns.items():
        if name not in schema.names:
            raise DataError(f"{shard_path}: no column '{name}', which the manifest's features and target name "
                            f"(columns: {', '.join(schema.names)})")
        kind = schema.field(name).type
        values = kind.value_type if pa.types.is_list(kind) or pa.types.is_large_list(kind) or \
            pa.types.is_fixed_size_list(kind) else None
        fits = {"a list of numbers per row": values is not None and _numeric(values),
                "integer class ids": pa.types.is_integer(kind), "integer lengths": pa.types.is_integer(kind),
                "numbers": _numeric(kind)}[holds]
        if not fits:
            raise DataError(f"{shard_path}: column '{name}' is {kind}; the manifest's features and target need "
                            f"{holds} there")


def _numeric(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind)


def shard_paths(data_dir: str | Path, manifest: dict[str, Any], split: str) -> list[str]:
    if split not in manifest["splits"]:
        raise DataError(f"{data_dir}: no split '{split}' (have {sorted(manifest['splits'])})")
    check_not_empty({split: manifest["splits"][split]["rows"]}, data_dir)
    return [str(Path(data_dir) / s["file"]) for s in manifest["splits"][split]["shards"]]


ARROW_TO_MLFLOW = {"int8": "integer", "int16": "integer", "int32": "integer", "uint8": "integer",
                   "uint16": "integer", "int64": "long", "float": "float", "double": "double", "string": "string"}


def dataset_refs(data_dir: str | Path, manifest: dict[str, Any], contexts: dict[str, str]) -> list[DatasetRef]:
    """The splits a run reads ({context: split}) as `contract.tracking.DatasetRef`s: the folder's URI, a digest
    of how the split was made (the manifest without the other splits: source checksums, preparation settings, the
    split's shards and rows), the shards' columns."""
    refs = []
    for context, split in contexts.items():
        lineage = {key: value for key, value in manifest.items() if key != "splits"}
        lineage["split"] = {split: manifest["splits"][split]}
        digest = hashlib.sha256(json.dumps(lineage, sort_keys=True).encode()).hexdigest()[:16]
        schema = pq.read_schema(shard_paths(data_dir, manifest, split)[0])
        columns = {}
        for field in schema:
            kind = field.type.value_type if pa.types.is_list(field.type) or pa.types.is_fixed_size_list(field.type) \
                else field.type
            name = ARROW_TO_MLFLOW.get(str(kind), "string")
            columns[field.name] = f"array<{name}>" if kind is not field.type else name
        refs.append(DatasetRef(f"{manifest['dataset']}-{split}", Path(data_dir).resolve().as_uri(), digest, columns,
                               context))
    return refs
