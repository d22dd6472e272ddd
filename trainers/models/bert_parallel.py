"""The BERT classifier's parallel plans, the ones its spec names (trainers/models/specs.py): a model of a user's
own gives its spec plans of the same form.

Tensor parallelism, one layout in two implementations (`trainer.tp_impl`): q/k/v and fc_in column-parallel,
out_proj and fc_out row-parallel.
  - "megatron": swaps submodules for explicit layers over the TP group (trainers.torch.parallel.layers); the token
    embedding is vocab-parallel and the classifier column-parallel (when tp divides its outputs).
  - "dtensor":  torch's native `parallelize_module` with ColwiseParallel / RowwiseParallel; embeddings and the
    classifier stay replicated.
Either way the model code is untouched: attention infers its local head count from tensor shapes.

Pipeline stages (`split_stage`): the blocks split into equal consecutive runs; the first stage also owns the
embeddings, the last the final norm and the classifier (trainers/torch/parallel/pipeline.py runs them).
"""
from __future__ import annotations

import copy
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from trainers.models.bert import MLP, BertClassifier, SelfAttention, attend
from trainers.torch.parallel.comm import copy_to_tp
from trainers.torch.parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                            check_divides)
from trainers.torch.parallel.pipeline import stage_blocks


class ParallelMLP(nn.Module):
    """fc_in (column) -> GELU -> fc_out (row): the 4h-wide activation never leaves its rank."""

    def __init__(self, hidden: int, inner: int, group: ProcessGroup, dropout: float = 0.0,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__()
        self.fc_in = ColumnParallelLinear(hidden, inner, group, dtype=dtype, device=device)
        self.act = nn.GELU()
        self.fc_out = RowParallelLinear(inner, hidden, group, dtype=dtype, device=device)
        # Acts on the replicated output: TP ranks must share the dropout RNG state to stay identical.
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc_out(self.act(self.fc_in(x))))  # (B, T, h) -> (B, T, 4h/tp) -> (B, T, h)

    @classmethod
    def from_dense(cls, dense: MLP, group: ProcessGroup) -> ParallelMLP:
        w = dense.fc_in.weight
        layer = cls(dense.fc_in.in_features, dense.fc_in.out_features, group, dense.drop.p, w.dtype, w.device)
        layer.fc_in.load_dense(dense.fc_in)
        layer.fc_out.load_dense(dense.fc_out)
        return layer


class ParallelSelfAttention(nn.Module):
    """q/k/v column-parallel by whole heads (heads/tp per rank), out_proj row-parallel."""

    def __init__(self, hidden: int, heads: int, group: ProcessGroup, dropout: float = 0.0,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__()
        check_divides(heads, dist.get_world_size(group), "heads")
        self.group = group
        self.head_dim = hidden // heads
        self.dropout = dropout
        kw = {"dtype": dtype, "device": device, "sync_input_grad": False}  # one copy_to_tp for all three
        self.q_proj = ColumnParallelLinear(hidden, hidden, group, **kw)
        self.k_proj = ColumnParallelLinear(hidden, hidden, group, **kw)
        self.v_proj = ColumnParallelLinear(hidden, hidden, group, **kw)
        self.out_proj = RowParallelLinear(hidden, hidden, group, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """x (B, T, h) replicated, key_mask (B, T) bool -> (B, T, h) replicated."""
        x = copy_to_tp(x, self.group)
        # Drops within this rank's heads. Every rank draws the same number of values, so with a shared seed the
        # RNG streams stay aligned for the dropouts on replicated activations that follow.
        p = self.dropout if self.training else 0.0
        y = attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), key_mask, self.head_dim, p)  # (B, T, h/tp)
        return self.out_proj(y)

    @classmethod
    def from_dense(cls, dense: SelfAttention, group: ProcessGroup) -> ParallelSelfAttention:
        w = dense.q_proj.weight
        hidden = dense.q_proj.in_features
        layer = cls(hidden, hidden // dense.head_dim, group, dense.dropout, w.dtype, w.device)
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            getattr(layer, name).load_dense(getattr(dense, name))
        return layer


def attention_plan(prefix: str = "") -> dict[str, ParallelStyle]:
    """DTensor plan for one SelfAttention at `prefix` (e.g. "blocks.0.attn.")."""
    return {prefix + "q_proj": ColwiseParallel(), prefix + "k_proj": ColwiseParallel(),
            prefix + "v_proj": ColwiseParallel(), prefix + "out_proj": RowwiseParallel()}


def mlp_plan(prefix: str = "") -> dict[str, ParallelStyle]:
    """DTensor plan for one MLP at `prefix` (e.g. "blocks.0.mlp.")."""
    return {prefix + "fc_in": ColwiseParallel(), prefix + "fc_out": RowwiseParallel()}


def parallelize_bert(model: BertClassifier, mesh: DeviceMesh,
                     impl: Literal["megatron", "dtensor"] = "megatron") -> BertClassifier:
    """Shard `model` in place over mesh["tp"] and return it. Every TP rank must pass the same dense weights."""
    tp_mesh = mesh["tp"]
    tp = tp_mesh.size()
    if model.cfg.heads % tp:
        raise ValueError(f"tp={tp} does not divide heads={model.cfg.heads}")
    if impl == "dtensor":
        plan: dict[str, ParallelStyle] = {}
        for i, block in enumerate(model.blocks):
            if hasattr(block, "attn"):  # not another pipeline stage's block (trainers/torch/parallel/pipeline.py)
                plan |= attention_plan(f"blocks.{i}.attn.") | mlp_plan(f"blocks.{i}.mlp.")
        parallelize_module(model, tp_mesh, plan)
        return model
    if impl != "megatron":
        raise ValueError(f"unknown TP implementation {impl!r}; use 'megatron' or 'dtensor'")
    group = tp_mesh.get_group()
    model.tok_emb = VocabParallelEmbedding.from_dense(model.tok_emb, group)
    for block in model.blocks:
        block.attn = ParallelSelfAttention.from_dense(block.attn, group)
        block.mlp = ParallelMLP.from_dense(block.mlp, group)
    # Two classes cannot be split four ways; a replicated head is cheap and needs no communication.
    if model.classifier.out_features % tp == 0:
        model.classifier = ColumnParallelLinear.from_dense(model.classifier, group, gather_output=True)
    return model


class SkippedBlock(nn.Module):
    """A block another stage owns: passes the hidden states through, holds no parameters."""

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        return x


def split_stage(model: nn.Module, stage: int, n_stages: int) -> nn.Module:
    """A copy of the BERT classifier `model` holding only `stage`'s parts (dense names kept)."""
    part = copy.deepcopy(model)
    owned = stage_blocks(len(part.blocks), n_stages, stage)
    for i in range(len(part.blocks)):
        if i not in owned:
            part.blocks[i] = SkippedBlock()
    if stage > 0:
        part.tok_emb = part.pos_emb = None
    if stage < n_stages - 1:
        part.ln_f = part.classifier = None
    return part
