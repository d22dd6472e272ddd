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

from trainers.parallel.data_parallel import local_grad
from trainers.parallel.layers import TPLayer


def is_sharded(model: nn.Module, name: str, param: nn.Parameter) -> bool:
    """Whether each TP rank holds a different piece of `param`."""
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
        if is_sharded(model, name, param):
            sharded += squares
        else:
            replicated += squares
    if dist.get_world_size(tp_group) > 1:
        dist.all_reduce(sharded, group=tp_group)
    return (sharded + replicated).sqrt()


@torch.no_grad()
def clip_grad_norm(model: nn.Module, max_norm: float, tp_group: ProcessGroup) -> torch.Tensor:
    """Scale every gradient by min(1, max_norm / global norm), as `clip_grad_norm_` does for a dense model;
    returns the norm before clipping."""
    norm = global_grad_norm(model, tp_group)
    scale = min(1.0, max_norm / (float(norm) + 1e-6))
    if scale < 1.0:
        for param in model.parameters():
            grad = local_grad(param)
            if grad is not None:
                grad.mul_(scale)
    return norm
