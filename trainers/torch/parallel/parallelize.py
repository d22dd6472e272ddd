"""Every parallelism of the N-D mesh applied to a plain model, in one place and in TorchTitan's order: pipeline
split -> tensor-parallel plan -> activation checkpointing -> FSDP (with its mixed-precision policy). Each step
leaves the parameter names of the dense model, so checkpoints stay layout-free."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from contract.registry import ModelSpec, resolve
from trainers.torch.parallel.fsdp import apply_activation_checkpointing, data_parallel_mesh, parallelize_fsdp
from trainers.torch.parallel.mesh import ParallelDims
from trainers.torch.parallel.pipeline import rank_stages
from trainers.torch.parallel.schedules import stages_per_rank


@dataclass(frozen=True)
class ModelPlans:
    """A model spec's parallel plans, resolved (contract/registry.py `ModelSpec`): None where it has none."""
    tensor_parallel: Callable[[nn.Module, DeviceMesh, str], nn.Module] | None = None
    pipeline_split: Callable[[nn.Module, int, int], nn.Module] | None = None
    fsdp_blocks: tuple[type, ...] = ()

    @classmethod
    def of(cls, spec: ModelSpec, model: nn.Module) -> "ModelPlans":
        """The plans of `spec` for `model` (its FSDP blocks may depend on the model built)."""
        def optional(ref: object) -> Callable | None:
            return resolve(ref) if ref is not None else None

        blocks = resolve(spec.fsdp_blocks)(model) if spec.fsdp_blocks is not None else ()
        return cls(optional(spec.tensor_parallel), optional(spec.pipeline_split), tuple(blocks))


@dataclass(frozen=True)
class Parallelized:
    parts: list[nn.Module]  # this rank's parts of the model: the whole model without a pipeline, else its stages
    stages: list[int]       # the pipeline stage of each part ([0] without a pipeline)
    n_stages: int           # stages of the whole pipeline (1 without one)


def parallelize(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, plans: ModelPlans,
                pp_schedule: str = "1f1b", activation_checkpointing: bool = False, reshard_after_forward: bool = True,
                param_dtype: torch.dtype | None = None) -> Parallelized:
    """This rank's parts of `model` (the same dense weights on every rank) on `mesh` (`build_nd_mesh(dims)`), by
    the model's `plans`: TP (dims.tp > 1) needs its `tensor_parallel` plan, pipelines (dims.pp > 1) its
    `pipeline_split` (the config checks refuse a run without them)."""
    if dims.pp > 1:
        per_rank = stages_per_rank(pp_schedule)
        n_stages = dims.pp * per_rank
        stages = rank_stages(mesh["pp"].get_local_rank(), dims.pp, per_rank)
        parts = [plans.pipeline_split(model, stage, n_stages) for stage in stages]
    else:
        n_stages, stages, parts = 1, [0], [model]
    for i, part in enumerate(parts):
        if dims.tp > 1:
            part = plans.tensor_parallel(part, mesh, "dtensor")
        if activation_checkpointing:
            part = apply_activation_checkpointing(part, plans.fsdp_blocks)
        parts[i] = parallelize_fsdp(part, data_parallel_mesh(mesh), reshard_after_forward, param_dtype,
                                    plans.fsdp_blocks)
    return Parallelized(parts, stages, n_stages)
