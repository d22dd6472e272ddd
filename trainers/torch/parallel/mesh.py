"""Parallel dimensions, one object for every mesh backend, and the rank layout.

Row-major over (dp, pp, tp): rank = (dp_rank * pp + stage) * tp + tp_rank. TP groups are consecutive ranks (on a
multi-GPU node they share the fast intra-node links, and TP talks every layer), then a pipeline's stages, so the
pp x tp ranks that read the same batches are consecutive too; DP groups are strided (they talk once per step).
The data-parallel ranks are dp_replicate groups (HSDP replicas) of dp / dp_replicate FSDP shards each.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    dp: int  # data-parallel ranks: each sees different batches
    tp: int  # tensor-parallel ranks: each holds 1/tp of every sharded layer, all see the same batches
    pp: int = 1  # pipeline stages: each holds some of the layers, all see the same batches
    dp_replicate: int = 1  # of the dp ranks, replica groups (HSDP); FSDP shards inside each (`dp_shard`)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def batch_group(self) -> int:
        """Consecutive ranks that read the same batches (a pipeline's stages and their TP ranks)."""
        return self.pp * self.tp

    def data_rank(self, rank: int) -> int:
        """Which data-parallel shard `rank` reads."""
        return rank // self.batch_group

    def dropout_stream(self, rank: int) -> int:
        """Which dropout stream `rank` draws from: one per TP group, whose ranks hold replicated activations that
        must be dropped alike; a pipeline's stages hold different layers and draw their own."""
        return rank // self.tp

    def validate(self, world_size: int, heads: int | None = None, hidden: int | None = None) -> None:
        """Raise ValueError before any process group exists if these dims cannot run the model."""
        if min(self.dp, self.tp, self.pp, self.dp_replicate) < 1:
            raise ValueError(f"dp, tp, pp and dp_replicate must be >= 1, got {self}")
        if self.dp % self.dp_replicate:
            raise ValueError(f"dp_replicate={self.dp_replicate} does not divide dp={self.dp}")
        if self.world_size != world_size:
            raise ValueError(f"dp*pp*tp={self.world_size} != world_size={world_size}")
        if heads is not None and heads % self.tp:
            raise ValueError(f"tp={self.tp} does not divide heads={heads}")
        if hidden is not None and hidden % self.tp:
            raise ValueError(f"tp={self.tp} does not divide hidden={hidden}")


def rank_coords(rank: int, dp: int, tp: int) -> tuple[int, int]:
    """Global rank -> (dp_rank, tp_rank) for the layout rank = dp_rank * tp + tp_rank (pp = 1)."""
    if not 0 <= rank < dp * tp:
        raise ValueError(f"rank={rank} is outside [0, dp*tp={dp * tp})")
    return rank // tp, rank % tp


def build_mesh(dims: ParallelDims, device_type: str = "cpu") -> DeviceMesh:
    """The TP backend's 2D ("dp", "tp") mesh over the default process group; use mesh.get_group("tp") / ("dp")."""
    if dims.pp != 1:
        raise ValueError("the 2D (dp, tp) mesh has no pipeline dimension: use build_nd_mesh")
    # Row-major (dp, tp) shape gives exactly the rank layout of `rank_coords`.
    return init_device_mesh(device_type, (dims.dp, dims.tp), mesh_dim_names=("dp", "tp"))


def build_nd_mesh(dims: ParallelDims, device_type: str = "cpu") -> DeviceMesh:
    """The mesh of the fsdp backend over the default process group, row-major over ("dp_replicate", "dp_shard",
    "pp", "tp") (the module's layout), leaving out the dimensions of size 1 other than "dp_shard":
    rank = ((replica * dp_shard + shard rank) * pp + stage) * tp + tp rank."""
    sizes = {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "pp": dims.pp, "tp": dims.tp}
    names = tuple(name for name, size in sizes.items() if size > 1 or name == "dp_shard")
    return init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)
