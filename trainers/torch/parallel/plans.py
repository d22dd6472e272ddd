"""Tensor-parallel plans applied to a plain model, and its weights moved between dense and sharded form.

A model's plan is its spec's `tensor_parallel(model, mesh, impl)` (contract/registry.py): either our explicit
Megatron-style layers swapped in (trainers.torch.parallel.layers; trainers/models/bert_parallel.py does so), or
torch's `parallelize_module` with a `ParallelStyle` per module name (`styles_plan` builds such a plan from a
pattern table). Either way every parameter keeps its dense name, so the state-dict helpers below move weights
and optimizer state between the dense form (checkpoints) and a rank's shards at any tp. Replicated parameters
get identical gradients on every TP rank, so TP needs no gradient sync; data parallelism afterwards averages
every gradient over the "dp" group. TP ranks must share the RNG seed: dropout on replicated activations has to
drop the same elements on every rank.
"""
from __future__ import annotations

import fnmatch
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from trainers.torch.parallel.layers import TPLayer

Plan = Callable[[nn.Module, DeviceMesh, str], nn.Module]  # (model, mesh, impl) -> the model, sharded over "tp"


def styles_plan(styles: dict[str, ParallelStyle]) -> Plan:
    """A model spec's `tensor_parallel` from torch `ParallelStyle`s keyed by module-name pattern (fnmatch:
    `"blocks.*.attn.q_proj": ColwiseParallel()`): torch's `parallelize_module` shards every matching module over
    the mesh's "tp" dimension (the "dtensor" implementation, whatever `trainer.tp_impl` says). A pattern that
    matches no module is an error: a plan that shards nothing would train a dense model on every rank."""

    def plan(model: nn.Module, mesh: DeviceMesh, impl: str = "dtensor") -> nn.Module:
        names = [name for name, _ in model.named_modules()]
        matched: dict[str, ParallelStyle] = {}
        for pattern, style in styles.items():
            hits = fnmatch.filter(names, pattern)
            if not hits:
                raise ValueError(f"tensor-parallel plan: '{pattern}' names no module of {type(model).__name__}")
            matched.update({name: style for name in hits})
        return parallelize_module(model, mesh["tp"], matched)

    return plan


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
