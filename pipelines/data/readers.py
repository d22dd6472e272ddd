"""Ray Data datasets over prepared Parquet shards. The driver only reads the manifest and footers."""
from __future__ import annotations

from pathlib import Path

from pipelines.data.shards import read_manifest, shard_paths


def parquet_datasets(data_dir: str | Path, splits: tuple[str, ...] = ("train", "test")) -> dict:
    """One lazy `ray.data.Dataset` per split, reading that split's shards."""
    import ray.data

    manifest = read_manifest(data_dir)
    return {split: ray.data.read_parquet(shard_paths(data_dir, manifest, split)) for split in splits}
