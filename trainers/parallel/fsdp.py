"""Sharded data parallelism with FSDP2 (`torch.distributed.fsdp.fully_shard`, DTensor parameters).

Every rank holds 1/N of each parameter (dim 0, over the mesh's shard dimension). Each repeated block (the
entries of the model's `nn.ModuleList`s: BERT's encoder blocks) is its own FSDP unit, so only one block's full
parameters exist at a time in forward and backward; the root unit takes the rest (embeddings, head). Gradients
are reduce-scattered (averaged) over the ranks, so the optimizer steps on shards. A 2D mesh ("dp_replicate",
"dp_shard") is HSDP: the model is sharded inside a replica group and gradients are also all-reduced across them.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor


def build_fsdp_mesh(dp_replicate: int, dp_shard: int, device_type: str = "cpu") -> DeviceMesh:
    """("dp_shard",) over the default process group, or ("dp_replicate", "dp_shard") for HSDP, where rank =
    replica * dp_shard + shard rank: a replica's ranks are consecutive (one node's, on a GPU cluster)."""
    if dp_replicate == 1:
        return init_device_mesh(device_type, (dp_shard,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(device_type, (dp_replicate, dp_shard), mesh_dim_names=("dp_replicate", "dp_shard"))


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The blocks that get their own FSDP unit: every entry of every `nn.ModuleList` in the model."""
    return [block for module in model.modules() if isinstance(module, nn.ModuleList) for block in module]


def parallelize_fsdp(model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool = True) -> nn.Module:
    """Shard `model` in place over `mesh` (blocks first, then the root); returns it. `reshard_after_forward`:
    free each unit's gathered parameters after its forward and gather them again for backward (ZeRO-3), or keep
    them until backward (ZeRO-2: less communication, more memory)."""
    from torch.distributed.fsdp import fully_shard

    for block in fsdp_units(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def local_bytes(tensors: Iterable[torch.Tensor | None]) -> float:
    """Bytes this rank holds of `tensors` (a DTensor's local shard; None skipped)."""
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return float(total)


def rank_memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """This rank's parameter, gradient and optimizer-state bytes (with FSDP over N ranks: ~1/N of the model's)."""
    states = [value for state in optimizer.state.values() for value in state.values()
              if isinstance(value, torch.Tensor) and value.dim() > 0]  # Adam's step counts are scalars
    params = list(model.parameters())
    return {"param_bytes": local_bytes(params), "grad_bytes": local_bytes(p.grad for p in params),
            "optimizer_state_bytes": local_bytes(states)}
