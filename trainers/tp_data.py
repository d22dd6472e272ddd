"""Ray Train data assignment for tensor x data parallelism: every rank of a TP group gets the same DP shard."""
from __future__ import annotations

from typing import Any

from ray.train import DataConfig


class TPGroupDataConfig(DataConfig):
    """Split each dataset into `dp` equal shards; ranks dp_rank*tp .. dp_rank*tp + tp-1 all read shard dp_rank.

    `Dataset.split` materialises the shards (fine for datasets that fit in the object store, as MNIST and
    IMDb do), so each TP rank can iterate its shard independently and see the same rows in the same order.
    """

    def __init__(self, dp: int, tp: int):
        super().__init__()
        self.dp, self.tp = dp, tp

    def configure(self, datasets: dict[str, Any], world_size: int, worker_handles: Any, worker_node_ids: Any,
                  **kwargs: Any) -> list[dict[str, Any]]:
        if world_size != self.dp * self.tp:
            raise ValueError(f"dp*tp={self.dp * self.tp} != world_size={world_size}")
        output: list[dict[str, Any]] = [{} for _ in range(world_size)]
        for name, dataset in datasets.items():
            # Deterministic row order: the same seed must give the same batches for any tp (and on restart).
            dataset.context.execution_options.preserve_order = True
            shards = dataset.split(self.dp, equal=True)
            for rank in range(world_size):
                output[rank][name] = shards[rank // self.tp].iterator()
        return output
