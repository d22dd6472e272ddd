"""Ray Data datasets over prepared Parquet shards. The driver only reads the manifest and footers."""
from __future__ import annotations

from pathlib import Path

from contract.progress import progress_wanted
from pipelines.data.shards import read_manifest, shard_paths


def parquet_datasets(data_dir: str | Path, splits: dict[str, str], progress: str = "auto") -> dict:
    """One lazy `ray.data.Dataset` per entry of `splits` ({dataset name for the trainer: split on disk}); they
    carry their context to the actors that run them, progress bars included or not (`progress`: `run.progress`).
    Ray Data's bars are drawn by its split coordinator actor whatever the driver's terminal: in a log they add
    redrawn lines every second (measured: 328 bar lines, 88 KB, in the log of a 1-minute IMDb run)."""
    import ray.data

    manifest = read_manifest(data_dir)
    datasets = {name: ray.data.read_parquet(shard_paths(data_dir, manifest, split)) for name, split in splits.items()}
    for dataset in datasets.values():
        dataset.context.enable_progress_bars = progress_wanted(progress)
    return datasets


def model_inputs(manifest: dict) -> dict:
    """What the model needs to know about the data (vocabulary size and sequence length for text)."""
    return dict(manifest.get("model_inputs", {}))
