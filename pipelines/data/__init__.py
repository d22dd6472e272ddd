"""Raw dataset formats -> Parquet shards -> Ray Data datasets. The datasets `rtp prepare` makes, registered as
specs (contract/registry.py) exactly as a user's own are: the built-in MNIST and IMDb, `synthetic` (generated rows
of any size), and `table`, any table of a user's (CSV, Parquet, a HuggingFace dataset on disk)."""
from __future__ import annotations

from typing import Any

from contract.data import DataSchema
from contract.registry import DATASETS, DatasetSpec, register_dataset, resolve

for _spec in (
    DatasetSpec("mnist", "pipelines.data.mnist:prepare_command", "pipelines.data.mnist:add_arguments",
                "MNIST handwritten digits, 10 classes of 28x28 images (vendored IDX files)", "data/mnist/parquet",
                old_manifest="pipelines.data.mnist:mnist_schema"),
    DatasetSpec("imdb", "pipelines.data.imdb:prepare_command", "pipelines.data.imdb:add_arguments",
                "IMDb movie reviews, positive or negative, as WordPiece tokens (aclImdb archive)",
                "data/imdb/parquet", old_manifest="pipelines.data.imdb:schema_of_old_manifest",
                clean_text="pipelines.data.imdb:clean_text",
                # the validation split prepare carves from the train split (by movie); batches of reviews of
                # similar length, cut to their longest (faster runs: benchmarks/README.md, length_buckets)
                data_keys={"eval_split": "validation", "bucket_by_length": True}),
    DatasetSpec("synthetic", "pipelines.data.synthetic:prepare", "pipelines.data.synthetic:add_arguments",
                "generated rows of any size, numbers or tokens, with a learnable rule (tests, benchmarks)",
                "data/synthetic/parquet"),
    DatasetSpec("table", "pipelines.data.table:prepare", "pipelines.data.table:add_arguments",
                "your own table: CSV, Parquet or a HuggingFace dataset on disk; numeric, image or text features"),
):
    register_dataset(_spec)


def data_schema(manifest: dict[str, Any]) -> DataSchema:
    """The prepared dataset's features and target as its manifest records them; a manifest written before manifests
    recorded them, through its dataset's spec (`DatasetSpec.old_manifest`). KeyError, TypeError or ValueError for
    a manifest that describes neither."""
    if "features" in manifest:
        return DataSchema.from_manifest(manifest)
    name = manifest.get("dataset")
    spec = DATASETS.specs.get(name)
    if spec is None or spec.old_manifest is None:
        raise ValueError(f"dataset '{name}': its manifest has no features and target")
    return resolve(spec.old_manifest)(manifest)
