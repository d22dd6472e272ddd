"""How Ray Train hands each worker its part of a dataset.

Ray's default `DataConfig` uses `streaming_split`: blocks go to whichever worker asks first, so which rows a
worker gets, and in which order, changes from run to run. That breaks two promises: the same seed gives the
same batches (a TP group must also see identical batches on all its ranks), and a run resumed mid-epoch skips
exactly the batches it already trained on. `OrderedSplit` gives both, at the cost of materialising the
dataset in the object store, which a worker that caches its shard in memory (`data.cache_in_worker`) pays
anyway.
"""
from __future__ import annotations

from typing import Any

from ray.train import DataConfig


class OrderedSplit(DataConfig):
    """Split each dataset, in file order, into `dp` equal parts; the `group` consecutive ranks
    dp_rank*group .. dp_rank*group + group-1 (a TP group, a pipeline) all read part dp_rank (group=1: one part per
    rank)."""

    def __init__(self, dp: int, group: int = 1):
        super().__init__()
        self.dp, self.group = dp, group

    def configure(self, datasets: dict[str, Any], world_size: int, worker_handles: Any, worker_node_ids: Any,
                  **kwargs: Any) -> list[dict[str, Any]]:
        if world_size != self.dp * self.group:
            raise ValueError(f"dp*group={self.dp * self.group} != world_size={world_size}")
        output: list[dict[str, Any]] = [{} for _ in range(world_size)]
        for name, dataset in datasets.items():
            dataset.context.execution_options.preserve_order = True
            # materialises, unless the driver did (pipelines/data/readers.py); block order = file order
            shards = dataset.split(self.dp, equal=True)
            for rank in range(world_size):
                output[rank][name] = shards[rank // self.group].iterator()
        return output


class RoleSplit(DataConfig):
    """tf_ps: the train split in `workers` equal shards, in file order, for the last `workers` ranks (the
    TensorFlow workers); the other splits whole for rank 0 (the chief, which evaluates). Ray Train wants an
    iterator of every dataset on every rank: the others get an empty one (never read)."""

    def __init__(self, workers: int):
        super().__init__()
        self.workers = workers

    def configure(self, datasets: dict[str, Any], world_size: int, worker_handles: Any, worker_node_ids: Any,
                  **kwargs: Any) -> list[dict[str, Any]]:
        output: list[dict[str, Any]] = [{} for _ in range(world_size)]
        first = world_size - self.workers
        for name, dataset in datasets.items():
            dataset.context.execution_options.preserve_order = True
            for rank in range(world_size):
                output[rank][name] = dataset.limit(0).iterator()
            if name == "train":
                for index, shard in enumerate(dataset.split(self.workers, equal=True)):
                    output[first + index][name] = shard.iterator()
            else:
                output[0][name] = dataset.split(1)[0].iterator()
        return output


def split_config(num_workers: int, cache_in_worker: bool, group: int = 1) -> DataConfig:
    """An ordered split when the workers cache their part (the default) or a group of ranks needs identical
    batches; Ray's streaming split otherwise (data too big to materialise: reproducible order is given up)."""
    if cache_in_worker or group > 1:
        return OrderedSplit(dp=num_workers // group, group=group)
    return DataConfig()
