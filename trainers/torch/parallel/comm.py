"""The conjugate tensor-parallel collectives (Megatron's f and g), as autograd functions.

The process group is always an argument (never a global), so the same code runs in a 1D TP job or in the TP
dimension of a 2D (dp, tp) mesh. With a group of size 1 every function is the identity and does no communication.

    copy_to_tp:     forward identity     backward all-reduce   (before a column-parallel layer: "f")
    reduce_from_tp: forward all-reduce   backward identity     (after a row-parallel layer:     "g")
    gather_from_tp: forward all-gather   backward own slice    (to get a full output on every rank)
    split_to_tp:    forward own slice    backward all-gather   (to feed a replicated tensor to a row layer)
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def collective_device(group: ProcessGroup | None = None) -> torch.device:
    """Where a tensor must live to go through `group`'s collectives: NCCL (GPU runs) takes CUDA tensors only."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _size(group: ProcessGroup) -> int:
    return dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    out = x.contiguous().clone()  # never modify the caller's tensor in place
    # Looked up on the module at call time, so tests can count calls by patching torch.distributed.all_reduce.
    dist.all_reduce(out, group=group)
    return out


def _all_gather(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _own_slice(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    size = _size(group)
    if x.shape[dim] % size:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split evenly over {size} TP ranks")
    return x.chunk(size, dim=dim)[dist.get_rank(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Each rank's sharded layer produced a partial gradient for the replicated input: sum them.
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # The output is replicated, so every rank already holds the full gradient of its partial sum.
        return grad, None


class _GatherOrSplitTP(torch.autograd.Function):
    """The conjugate pair along `dim`: all-gather forward and this rank's slice backward, or (`split`) this rank's
    slice forward and all-gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, dim: int, split: bool) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.split = group, dim, split
        return _own_slice(x, group, dim) if split else _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gathered = _all_gather(grad, ctx.group, ctx.dim) if ctx.split else _own_slice(grad, ctx.group, ctx.dim)
        return gathered, None, None, None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Identity forward, all-reduce (sum) of the gradient backward."""
    return x if _size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-reduce (sum) forward, identity backward."""
    return x if _size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: ProcessGroup, dim: int = -1) -> torch.Tensor:
    """All-gather along `dim` (rank order) forward; backward keeps this rank's slice of the gradient."""
    return x if _size(group) == 1 else _GatherOrSplitTP.apply(x, group, dim, False)


def split_to_tp(x: torch.Tensor, group: ProcessGroup, dim: int = -1) -> torch.Tensor:
    """This rank's slice along `dim` forward; backward all-gathers the gradient slices."""
    return x if _size(group) == 1 else _GatherOrSplitTP.apply(x, group, dim, True)
