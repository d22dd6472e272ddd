"""Parquet shards + manifest: the on-disk contract between `prepare` and the Ray Data readers.

A prepared dataset folder holds `<split>-<i>-of-<n>.parquet` files and `manifest.json`:
    {"dataset": ..., "schema": ..., "splits": {split: {"rows": N, "shards": [{"file", "rows"}]}},
     "sources": {name: sha256}, ...}
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.data.idx import DataError

MANIFEST = "manifest.json"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_split_shards(table: pa.Table, out_dir: Path, split: str, num_shards: int) -> list[dict]:
    """Write `table` as `num_shards` near-equal Parquet files; return their manifest entries."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    bounds = np.linspace(0, table.num_rows, num_shards + 1).astype(int)
    entries = []
    for i in range(num_shards):
        name = f"{split}-{i:05d}-of-{num_shards:05d}.parquet"
        piece = table.slice(bounds[i], bounds[i + 1] - bounds[i])
        pq.write_table(piece, out_dir / name)
        entries.append({"file": name, "rows": piece.num_rows})
    return entries


def write_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def read_manifest(data_dir: str | Path) -> dict[str, Any]:
    """Read and check a prepared folder without loading data: every shard exists, is readable Parquet,
    and has the row count the manifest says. Cheap (footers only); runs before any cluster work."""
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST
    if not path.is_file():
        raise DataError(f"{path}: no manifest; run `python -m pipelines.prepare ...` first")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON ({err})") from err
    for split, info in manifest["splits"].items():
        for shard in info["shards"]:
            shard_path = data_dir / shard["file"]
            try:
                rows = pq.read_metadata(shard_path).num_rows
            except (OSError, pa.ArrowInvalid) as err:
                raise DataError(f"{shard_path}: missing or not a readable Parquet file ({err})") from err
            if rows != shard["rows"]:
                raise DataError(f"{shard_path}: has {rows} rows, manifest says {shard['rows']}")
    return manifest


def shard_paths(data_dir: str | Path, manifest: dict[str, Any], split: str) -> list[str]:
    if split not in manifest["splits"]:
        raise DataError(f"{data_dir}: no split '{split}' (have {sorted(manifest['splits'])})")
    return [str(Path(data_dir) / s["file"]) for s in manifest["splits"][split]["shards"]]
