"""Raw dataset formats -> Parquet shards -> Ray Data datasets. The datasets `rtp prepare` makes, registered as
specs (contract/registry.py) exactly as a user's own are: the built-in MNIST and IMDb, and `table`, any table of
a user's (CSV, Parquet, a HuggingFace dataset on disk) with the feature and label columns named."""
from __future__ import annotations

from contract.registry import DatasetSpec, register_dataset

for _spec in (
    DatasetSpec("mnist", "pipelines.data.mnist:prepare_command", "pipelines.data.mnist:add_arguments",
                "MNIST handwritten digits, 10 classes of 28x28 images (vendored IDX files)", "data/mnist/parquet"),
    DatasetSpec("imdb", "pipelines.data.imdb:prepare_command", "pipelines.data.imdb:add_arguments",
                "IMDb movie reviews, positive or negative, as WordPiece tokens (aclImdb archive)",
                "data/imdb/parquet"),
    DatasetSpec("table", "pipelines.data.table:prepare", "pipelines.data.table:add_arguments",
                "your own table: CSV, Parquet or a HuggingFace dataset on disk; numeric, image or text features"),
):
    register_dataset(_spec)
