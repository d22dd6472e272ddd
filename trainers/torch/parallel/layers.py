"""Megatron-style tensor-parallel layers over an explicit process group.

Sharding (nn.Linear.weight is [out, in]):
    ColumnParallelLinear  weight rows    [out/tp, in], bias [out/tp]; input replicated, output sharded
    RowParallelLinear     weight columns [out, in/tp], bias [out] (replicated); input sharded, output replicated
    VocabParallelEmbedding  vocabulary rows, padded to a multiple of tp
A column layer followed by a row layer (a model's plan pairs them: trainers/models/bert_parallel.py) keeps the
activation sharded in between, so the pair costs one all-reduce forward (after the row layer) and one backward
(before the columns).

Every layer has `from_dense(dense, group)`, which copies this rank's shard of a dense module's weights, so a
TP=k model starts as exactly the same function as the TP=1 model. `local_shard` / `full_tensor` convert one
parameter between the dense and the sharded form (used for checkpoints and in the tests).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from trainers.torch.parallel.comm import copy_to_tp, gather_from_tp, reduce_from_tp, split_to_tp


def check_divides(size: int, tp: int, what: str) -> None:
    if size % tp:
        raise ValueError(f"tp={tp} does not divide {what}={size}")


class TPLayer(nn.Module):
    """A layer whose parameters are slices of a dense layer's parameters of the same names."""

    # parameter name -> dense dimension split across TP ranks; parameters not listed are replicated
    shard_dims: dict[str, int] = {}

    def __init__(self, group: ProcessGroup):
        super().__init__()
        self.group = group
        self.tp_size = dist.get_world_size(group)
        self.tp_rank = dist.get_rank(group)

    def local_shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the dense tensor `full` for parameter `name`."""
        if name not in self.shard_dims:
            return full
        return full.chunk(self.tp_size, dim=self.shard_dims[name])[self.tp_rank]

    @torch.no_grad()
    def full_tensor(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The dense tensor for parameter `name`, gathered from every rank (a collective: all ranks must call)."""
        if name not in self.shard_dims or self.tp_size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=self.shard_dims[name])

    def adopt_shards(self, dense: nn.Module) -> None:
        """Register this rank's shard of each parameter of a freshly initialised dense module as our own.

        Drawing the full dense weights and keeping a slice (Megatron's "master weight" init) means TP ranks that
        share a seed hold one consistent model, and the same seed gives the same function for any tp.
        """
        for name, param in dense.named_parameters(recurse=False):
            self.register_parameter(name, nn.Parameter(self.local_shard(name, param.detach()).clone()))

    @torch.no_grad()
    def load_dense(self, dense: nn.Module) -> None:
        """Copy this rank's shard of every parameter of `dense` (same parameter names)."""
        for name, param in self.named_parameters(recurse=False):
            param.copy_(self.local_shard(name, getattr(dense, name)))


def _linear_from_dense(cls: type, dense: nn.Linear, group: ProcessGroup, **kwargs) -> TPLayer:
    """A column- or row-parallel layer of `dense`'s shape holding this rank's shard of its weights."""
    layer = cls(dense.in_features, dense.out_features, group, bias=dense.bias is not None,
                dtype=dense.weight.dtype, device=dense.weight.device, **kwargs)
    layer.load_dense(dense)
    return layer


class ColumnParallelLinear(TPLayer):
    shard_dims = {"weight": 0, "bias": 0}

    def __init__(self, in_features: int, out_features: int, group: ProcessGroup, bias: bool = True,
                 gather_output: bool = False, sync_input_grad: bool = True, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        """`sync_input_grad=False` when the caller already passed the input through copy_to_tp (several column
        layers sharing one input, e.g. q/k/v): the input-gradient all-reduce then happens once, not per layer."""
        super().__init__(group)
        check_divides(out_features, self.tp_size, "out_features")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sync_input_grad = gather_output, sync_input_grad
        self.adopt_shards(nn.Linear(in_features, out_features, bias, device=device, dtype=dtype))
        if not bias:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sync_input_grad:
            x = copy_to_tp(x, self.group)
        y = F.linear(x, self.weight, self.bias)  # (..., out/tp)
        return gather_from_tp(y, self.group, dim=-1) if self.gather_output else y

    @classmethod
    def from_dense(cls, dense: nn.Linear, group: ProcessGroup, **kwargs) -> ColumnParallelLinear:
        return _linear_from_dense(cls, dense, group, **kwargs)


class RowParallelLinear(TPLayer):
    shard_dims = {"weight": 1}  # the bias is replicated and added once, after the reduction

    def __init__(self, in_features: int, out_features: int, group: ProcessGroup, bias: bool = True,
                 input_is_parallel: bool = True, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        super().__init__(group)
        check_divides(in_features, self.tp_size, "in_features")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.adopt_shards(nn.Linear(in_features, out_features, bias, device=device, dtype=dtype))
        if not bias:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = split_to_tp(x, self.group, dim=-1)  # (..., in) -> (..., in/tp)
        y = reduce_from_tp(F.linear(x, self.weight), self.group)  # partial sums -> (..., out) on every rank
        # Adding the bias before the reduce would add it tp times.
        return y if self.bias is None else y + self.bias

    @classmethod
    def from_dense(cls, dense: nn.Linear, group: ProcessGroup, **kwargs) -> RowParallelLinear:
        return _linear_from_dense(cls, dense, group, **kwargs)


class VocabParallelEmbedding(TPLayer):
    """Each rank holds a contiguous block of ceil(V/tp) vocabulary rows (the last block padded with unused rows);
    ids outside the block look up zeros, and the all-reduce sums the one non-zero contribution per token."""

    shard_dims = {"weight": 0}

    def __init__(self, num_embeddings: int, embedding_dim: int, group: ProcessGroup,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.rows_per_rank = math.ceil(num_embeddings / self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.adopt_shards(nn.Embedding(num_embeddings, embedding_dim, device=device, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)  # (B, T)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # (B, T, h)
        return reduce_from_tp(out, self.group)

    def local_shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        padded = full.new_zeros(self.rows_per_rank * self.tp_size, full.shape[1])  # padding rows stay 0
        padded[: full.shape[0]] = full
        return super().local_shard(name, padded)

    def full_tensor(self, name: str, local: torch.Tensor) -> torch.Tensor:
        return super().full_tensor(name, local)[: self.num_embeddings]

    @classmethod
    def from_dense(cls, dense: nn.Embedding, group: ProcessGroup) -> VocabParallelEmbedding:
        layer = cls(dense.num_embeddings, dense.embedding_dim, group, dtype=dense.weight.dtype,
                    device=dense.weight.device)
        layer.load_dense(dense)
        return layer
