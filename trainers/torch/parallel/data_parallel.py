"""Data parallelism on top of tensor parallelism: average gradients over the "dp" process group.

Written by hand instead of wrapping in DDP because DDP does not take DTensor parameters; one flat all-reduce
per step works for both TP implementations (DTensor gradients are averaged through their local shards).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor


def local_grad(param: nn.Parameter) -> torch.Tensor | None:
    grad = param.grad
    if grad is None:
        return None
    return grad.to_local() if isinstance(grad, DTensor) else grad


@torch.no_grad()
def average_gradients(model: nn.Module, dp_group: ProcessGroup) -> None:
    """Replace every gradient by its mean over `dp_group` (a no-op for a group of one)."""
    size = dist.get_world_size(dp_group)
    if size == 1:
        return
    grads = [g for g in (local_grad(p) for p in model.parameters()) if g is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=dp_group)
    flat /= size
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()
