"""Parallel dimensions and the rank layout: rank = dp_rank * tp + tp_rank.

TP groups are consecutive ranks (on a multi-GPU node they share the fast intra-node links, and TP talks every
layer); DP groups are strided (they talk once per step).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class ParallelDims:
    dp: int  # data-parallel replicas: each sees a different micro-batch
    tp: int  # tensor-parallel ranks: each holds 1/tp of every sharded layer, all see the same micro-batch

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    def validate(self, world_size: int, heads: int | None = None, hidden: int | None = None) -> None:
        """Raise ValueError before any process group exists if these dims cannot run the model."""
        if self.dp < 1 or self.tp < 1:
            raise ValueError(f"dp and tp must be >= 1, got dp={self.dp} tp={self.tp}")
        if self.world_size != world_size:
            raise ValueError(f"dp*tp={self.world_size} != world_size={world_size}")
        if heads is not None and heads % self.tp:
            raise ValueError(f"tp={self.tp} does not divide heads={heads}")
        if hidden is not None and hidden % self.tp:
            raise ValueError(f"tp={self.tp} does not divide hidden={hidden}")


def rank_coords(rank: int, dp: int, tp: int) -> tuple[int, int]:
    """Global rank -> (dp_rank, tp_rank) for the layout rank = dp_rank * tp + tp_rank."""
    if not 0 <= rank < dp * tp:
        raise ValueError(f"rank={rank} is outside [0, dp*tp={dp * tp})")
    return rank // tp, rank % tp


def build_mesh(dims: ParallelDims, device_type: str = "cpu") -> DeviceMesh:
    """A 2D ("dp", "tp") mesh over the default process group; use mesh.get_group("tp") / ("dp")."""
    # Row-major (dp, tp) shape gives exactly the rank layout of `rank_coords`.
    return init_device_mesh(device_type, (dims.dp, dims.tp), mesh_dim_names=("dp", "tp"))
