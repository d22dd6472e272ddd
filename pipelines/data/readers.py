"""Ray Data datasets over prepared Parquet shards. The driver only reads the manifest and footers."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from pipelines.data.shards import read_manifest, shard_paths


def progress_bars_wanted() -> bool:
    """Ray Data's progress bars where someone watches them: in an interactive terminal, or where
    RAY_DATA_DISABLE_PROGRESS_BARS=0 asks for them. In a log (a job's, Slurm's, CI's) the bars of a training run's
    data, drawn by Ray Data's split coordinator actor whatever the driver's terminal, add redrawn lines every
    second (measured: 328 bar lines, 88 KB, in the log of a 1-minute IMDb run)."""
    asked = os.environ.get("RAY_DATA_DISABLE_PROGRESS_BARS")
    return asked == "0" if asked is not None else sys.stdout.isatty()


def parquet_datasets(data_dir: str | Path, splits: dict[str, str]) -> dict:
    """One lazy `ray.data.Dataset` per entry of `splits` ({dataset name for the trainer: split on disk}); they
    carry their context to the actors that run them, bars included or not (`progress_bars_wanted`)."""
    import ray.data

    manifest = read_manifest(data_dir)
    datasets = {name: ray.data.read_parquet(shard_paths(data_dir, manifest, split)) for name, split in splits.items()}
    for dataset in datasets.values():
        dataset.context.enable_progress_bars = progress_bars_wanted()
    return datasets


def model_inputs(manifest: dict) -> dict:
    """What the model needs to know about the data (vocabulary size and sequence length for text)."""
    return dict(manifest.get("model_inputs", {}))
