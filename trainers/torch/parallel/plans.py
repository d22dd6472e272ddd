"""Apply tensor parallelism to the plain BERT classifier, and move weights between dense and sharded form.

Two implementations of the same layout (q/k/v and fc_in column-parallel, out_proj and fc_out row-parallel):
  - "megatron": swaps submodules for our explicit layers (trainers.torch.parallel.layers); the token embedding is
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
from trainers.torch.parallel.layers import (ColumnParallelLinear, ParallelMLP, ParallelSelfAttention, TPLayer,
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


def _shard_like(model: nn.Module, name: str, value: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `full`, the dense form of the local tensor `value` of state entry `name`."""
    owner, leaf = _owner(model, name)
    if isinstance(value, DTensor):
        return _dtensor_local(full, value)
    if isinstance(owner, TPLayer):
        return owner.local_shard(leaf, full)
    return full


@torch.no_grad()
def _unshard_like(model: nn.Module, name: str, value: torch.Tensor) -> torch.Tensor:
    """The dense form of the local tensor `value` of state entry `name` (a collective over the TP group)."""
    owner, leaf = _owner(model, name)
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(owner, TPLayer):
        return owner.full_tensor(leaf, value)
    return value


def shard_state_dict(model: nn.Module, dense_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's local piece of each tensor of a dense state dict, keyed like model.state_dict().

    For a megatron model the result loads with model.load_state_dict, so a checkpoint saved at one tp (after
    `unshard_state_dict`) resumes at another. For a dtensor model the values are the local shards (`to_local()`).
    """
    return {name: _shard_like(model, name, value, dense_state[name]) for name, value in model.state_dict().items()}


@torch.no_grad()
def unshard_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The dense state dict of a tensor-parallel model (either impl), gathered onto every TP rank.

    A collective: every rank of the TP group must call it (in the same order, which state_dict() guarantees).
    """
    return {name: _unshard_like(model, name, value) for name, value in model.state_dict().items()}


def _placed_like(model: nn.Module, name: str, like: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `full` in the form of `like`: a DTensor laid out like it, or a plain local shard."""
    local = _shard_like(model, name, like, full)
    if isinstance(like, DTensor):
        return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False)
    return local


@torch.no_grad()
def load_dense_state_dict(model: nn.Module, dense_state: dict[str, torch.Tensor]) -> None:
    """Load a dense state dict (saved at any tp) into a tensor-parallel model of either impl."""
    model.load_state_dict({name: _placed_like(model, name, value, dense_state[name])
                           for name, value in model.state_dict().items()})


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """Optimizer state index -> parameter name (`optimizer.state_dict()` numbers parameters group by group)."""
    names = {id(param): name for name, param in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {index: names[id(param)] for index, param in enumerate(params)}


@torch.no_grad()
def dense_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """`optimizer.state_dict()` with every per-parameter tensor shaped like its parameter (Adam's moments, SGD's
    momentum) gathered to its dense form, so a run resumes with its optimizer state at any tp. Scalars (Adam's
    step) stay as they are. A collective over the TP group, like `unshard_state_dict`."""
    state = optimizer.state_dict()
    names = _param_names(model, optimizer)
    params = dict(model.named_parameters())
    dense = {}
    for index, entry in state["state"].items():
        name = names[index]
        dense[index] = {key: _unshard_like(model, name, value)
                        if torch.is_tensor(value) and value.shape == params[name].shape else value
                        for key, value in entry.items()}
    return {"state": dense, "param_groups": state["param_groups"]}


def load_dense_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, dense: dict) -> None:
    """Load what `dense_optimizer_state` saved (at any tp) into this rank's optimizer: each dense tensor is cut
    to this rank's shard of its parameter (a DTensor parameter gets a DTensor laid out like it)."""
    names = _param_names(model, optimizer)
    params = dict(model.named_parameters())
    local = {}
    for index, entry in dense["state"].items():
        name = names[int(index)]
        param = params[name]
        local[index] = {}
        for key, value in entry.items():
            local[index][key] = (_placed_like(model, name, param, value)
                                 if torch.is_tensor(value) and value.dim() > 0 else value)
    optimizer.load_state_dict({"state": local, "param_groups": dense["param_groups"]})
