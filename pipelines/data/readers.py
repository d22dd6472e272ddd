"""Ray Data datasets over prepared Parquet shards. The driver only reads the manifest and footers."""
from __future__ import annotations

from pathlib import Path

from pipelines.data.shards import read_manifest, shard_paths


def parquet_datasets(data_dir: str | Path, splits: dict[str, str]) -> dict:
    """One lazy `ray.data.Dataset` per entry of `splits` ({dataset name for the trainer: split on disk})."""
    import ray.data

    manifest = read_manifest(data_dir)
    return {name: ray.data.read_parquet(shard_paths(data_dir, manifest, split)) for name, split in splits.items()}


def model_inputs(manifest: dict) -> dict:
    """What the model needs to know about the data (vocabulary size and sequence length for text)."""
    return dict(manifest.get("model_inputs", {}))
