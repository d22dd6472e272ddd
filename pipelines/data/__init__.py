"""Raw dataset formats -> Parquet shards -> Ray Data datasets."""
