"""Apply tensor parallelism to the plain BERT classifier, and move weights between dense and sharded form.

Two implementations of the same layout (q/k/v and fc_in column-parallel, out_proj and fc_out row-parallel):
  - "megatron": swaps submodules for our explicit layers (trainers.parallel.layers); the token embedding is
    vocab-parallel and the classifier column-parallel (when tp divides num_classes).
  - "dtensor":  torch's native `parallelize_module` with ColwiseParallel / RowwiseParallel; embeddings and the
    classifier stay replicated.
Either way the model code is untouched: attention infers its local head count from tensor shapes. Replicated
parameters (LayerNorms, position embedding, ...) get identical gradients on every TP rank, so TP needs no
gradient sync; data parallelism afterwards averages every gradient over the "dp" group. TP ranks must share
the RNG seed: dropout on replicated activations has to drop the same elements on every rank.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from trainers.models.bert import BertClassifier
from trainers.parallel.layers import (ColumnParallelLinear, ParallelMLP, ParallelSelfAttention, TPLayer,
                                      VocabParallelEmbedding)


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
        for i in range(len(model.blocks)):
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


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner_name, _, leaf = name.rpartition(".")
    return model.get_submodule(owner_name), leaf


def _dtensor_local(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's piece of `full` laid out like `like` (Shard placements split in mesh-dimension order)."""
    local = full
    for mesh_dim, placement in enumerate(like.placements):
        if placement.is_shard():
            mesh = like.device_mesh
            local = local.chunk(mesh.size(mesh_dim), dim=placement.dim)[mesh.get_local_rank(mesh_dim)]
    return local


def shard_state_dict(model: nn.Module, dense_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's local piece of each tensor of a dense state dict, keyed like model.state_dict().

    For a megatron model the result loads with model.load_state_dict, so a checkpoint saved at one tp (after
    `unshard_state_dict`) resumes at another. For a dtensor model the values are the local shards (`to_local()`).
    """
    out = {}
    for name, value in model.state_dict().items():
        full = dense_state[name]
        owner, leaf = _owner(model, name)
        if isinstance(value, DTensor):
            out[name] = _dtensor_local(full, value)
        elif isinstance(owner, TPLayer):
            out[name] = owner.local_shard(leaf, full)
        else:
            out[name] = full
    return out


@torch.no_grad()
def unshard_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The dense state dict of a tensor-parallel model (either impl), gathered onto every TP rank.

    A collective: every rank of the TP group must call it (in the same order, which state_dict() guarantees).
    """
    out = {}
    for name, value in model.state_dict().items():
        owner, leaf = _owner(model, name)
        if isinstance(value, DTensor):
            out[name] = value.full_tensor()
        elif isinstance(owner, TPLayer):
            out[name] = owner.full_tensor(leaf, value)
        else:
            out[name] = value
    return out
