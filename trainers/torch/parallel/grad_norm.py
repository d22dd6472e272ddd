"""Gradient clipping by the global norm of a tensor-parallel model: the norm of the dense model's gradient, not
of this rank's pieces.

A sharded parameter (a DTensor with a Shard placement, or a parameter our Megatron layers split) contributes
its local squares summed over the TP group; a replicated one (LayerNorms, position embeddings, the row-parallel
bias) holds the same gradient on every TP rank and counts once. `torch.nn.utils.clip_grad_norm_` cannot do this
here: it sums squares of local tensors only, and refuses a mix of DTensor and plain parameters, which the dtensor
plan leaves (its embeddings and norms stay plain).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from trainers.torch.parallel.comm import collective_device
from trainers.torch.parallel.data_parallel import local_grad
from trainers.torch.parallel.layers import TPLayer


def is_sharded(model: nn.Module, name: str, param: nn.Parameter | torch.Tensor) -> bool:
    """Whether each TP rank holds a different piece of `param` (or of a gradient)."""
    if isinstance(param, DTensor):
        return any(placement.is_shard() for placement in param.placements)
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    return isinstance(owner, TPLayer) and leaf in owner.shard_dims


@torch.no_grad()
def global_grad_norm(model: nn.Module, tp_group: ProcessGroup) -> torch.Tensor:
    """The 2-norm of the whole (dense) gradient, on every TP rank (a collective over `tp_group`), in float64."""
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for name, param in model.named_parameters():
        grad = local_grad(param)
        if grad is None:
            continue
        squares = grad.detach().double().pow(2).sum().cpu()
        # A DTensor gradient's own layout: torch's vocab-parallel embedding (RowwiseParallel on nn.Embedding) gives
        # its row-sharded weight a replicated gradient.
        if is_sharded(model, name, param.grad if isinstance(param.grad, DTensor) else param):
            sharded += squares
        else:
            replicated += squares
    if dist.get_world_size(tp_group) > 1:
        sharded = sharded.to(collective_device(tp_group))
        dist.all_reduce(sharded, group=tp_group)
    return (sharded.cpu() + replicated).sqrt()


@torch.no_grad()
def dtensor_grad_norm(model: nn.Module, pp_group: ProcessGroup | None = None) -> torch.Tensor:
    """The 2-norm of the whole gradient of a model whose parameters are all DTensors (FSDP; FSDP x TP, where they
    live on two meshes: the 2D one for TP-sharded weights, the data-parallel one for the rest). DTensor sums each
    mesh's squares over its shards, counting replicas once; the meshes' sums are then added (torch's
    `clip_grad_norm_` stacks the per-mesh norms and fails on mixed meshes). With pipeline stages, each rank's
    `model` is its stages' part and `pp_group` adds the squares of the other stages'. Float64, on every rank."""
    by_mesh: dict = {}
    for param in model.parameters():
        if param.grad is not None:
            if not isinstance(param.grad, DTensor):
                raise TypeError("dtensor_grad_norm needs every gradient as a DTensor")
            by_mesh.setdefault(param.grad.device_mesh, []).append(param.grad)
    total = torch.zeros((), dtype=torch.float64)
    for grads in by_mesh.values():
        total += torch.nn.utils.get_total_norm(grads, 2.0).full_tensor().double().cpu() ** 2
    if pp_group is not None:
        total = total.to(collective_device(pp_group))
        dist.all_reduce(total, group=pp_group)
    return total.cpu().sqrt()


@torch.no_grad()
def clip_grad_norm(model: nn.Module, max_norm: float, tp_group: ProcessGroup) -> torch.Tensor:
    """Scale every gradient by min(1, max_norm / global norm), as `clip_grad_norm_` does for a dense model;
    returns the norm before clipping."""
    norm = global_grad_norm(model, tp_group)
    scale_gradients(model, min(1.0, max_norm / (float(norm) + 1e-6)))
    return norm


@torch.no_grad()
def clip_dtensor_grad_norm(model: nn.Module, max_norm: float, pp_group: ProcessGroup | None = None
                           ) -> torch.Tensor:
    """`clip_grad_norm` for a model of DTensors (FSDP, FSDP x TP, and pipeline stages of them), by
    `dtensor_grad_norm`."""
    norm = dtensor_grad_norm(model, pp_group)
    scale_gradients(model, min(1.0, max_norm / (float(norm) + 1e-6)))
    return norm


def scale_gradients(model: nn.Module, scale: float) -> None:
    if scale < 1.0:
        for param in model.parameters():
            grad = local_grad(param)
            if grad is not None:
                grad.mul_(scale)
