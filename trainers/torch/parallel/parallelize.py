"""Every parallelism of the N-D mesh applied to a plain model, in one place and in TorchTitan's order: pipeline
split -> tensor-parallel plan -> activation checkpointing -> FSDP (with its mixed-precision policy). Each step
leaves the parameter names of the dense model, so checkpoints stay layout-free."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainers.torch.parallel.fsdp import apply_activation_checkpointing, data_parallel_mesh, parallelize_fsdp
from trainers.torch.parallel.mesh import ParallelDims
from trainers.torch.parallel.pipeline import rank_stages, split_stage
from trainers.torch.parallel.schedules import stages_per_rank
from trainers.torch.parallel.plans import parallelize_bert


@dataclass(frozen=True)
class Parallelized:
    parts: list[nn.Module]  # this rank's parts of the model: the whole model without a pipeline, else its stages
    stages: list[int]       # the pipeline stage of each part ([0] without a pipeline)
    n_stages: int           # stages of the whole pipeline (1 without one)


def parallelize(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, pp_schedule: str = "1f1b",
                activation_checkpointing: bool = False, reshard_after_forward: bool = True,
                param_dtype: torch.dtype | None = None) -> Parallelized:
    """This rank's parts of `model` (the same dense weights on every rank) on `mesh` (`build_nd_mesh(dims)`).
    TP (dims.tp > 1) and pipelines (dims.pp > 1) need the BERT classifier."""
    if dims.pp > 1:
        per_rank = stages_per_rank(pp_schedule)
        n_stages = dims.pp * per_rank
        stages = rank_stages(mesh["pp"].get_local_rank(), dims.pp, per_rank)
        parts = [split_stage(model, stage, n_stages) for stage in stages]
    else:
        n_stages, stages, parts = 1, [0], [model]
    for i, part in enumerate(parts):
        if dims.tp > 1:
            part = parallelize_bert(part, mesh, impl="dtensor")
        if activation_checkpointing:
            part = apply_activation_checkpointing(part)
        parts[i] = parallelize_fsdp(part, data_parallel_mesh(mesh), reshard_after_forward, param_dtype)
    return Parallelized(parts, stages, n_stages)
