"""Pipeline parallelism with `torch.distributed.pipelining`, for a model whose spec can split it into stages.

The model is split into `pp * stages_per_rank` stages by its spec's `pipeline_split(model, stage, n_stages)`
(the BERT classifier's: trainers/models/bert_parallel.py, blocks in equal runs; `sequential_split` for a model
that is one `nn.Sequential`, like the MLP). A stage is a copy of the whole model with everything other stages own
removed, so every parameter keeps its dense name: the state dicts of a rank's stages merged are a part of the
dense model's, which is what lets a sharded checkpoint load at any layout. Rank r of the pipeline group holds
stage r (GPipe, 1F1B) or stages r and r + pp (interleaved 1F1B, the "looped" assignment).

A training step is one `schedule.step` over the whole batch: the schedule cuts it into `microbatches` equal
micro-batches, runs forward and backward through the stages in its order, and scales gradients by
1/microbatches, so the step applies the mean gradient of the batch's micro-batch losses (the mean over the batch
when micro-batches are equal). Inputs (the features, or token ids) enter on the first stage, labels on the last;
a token model's padding mask is a keyword argument every stage receives from its own copy of the batch. Tensor
shapes are fixed by the first step, so every step's batch must have the same size (the caller drops an epoch's
last partial batch and pads evaluation batches).
"""
from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn


def rank_stages(pp_rank: int, pp: int, per_rank: int) -> list[int]:
    """The stages pipeline rank `pp_rank` holds: pp_rank, pp_rank + pp, ..."""
    return [pp_rank + i * pp for i in range(per_rank)]


def sequential_split(model: nn.Module, stage: int, n_stages: int) -> nn.Module:
    """A `pipeline_split` for a model that runs one `nn.Sequential` over its input (the model itself, or its only
    Sequential child, as the MLP's `net`; nothing in its forward may depend on the input's shape). A copy of the
    model in which `stage` keeps its run of the Sequential's layers and the others become `nn.Identity`, so the
    parameters keep their dense names. The layers with parameters are shared out in order, as evenly as they go;
    each layer without parameters (activation, dropout) stays with the one before it."""
    part = copy.deepcopy(model)
    chain = sequential_of(part)
    weighted = [i for i, layer in enumerate(chain) if any(True for _ in layer.parameters())]
    if len(weighted) < n_stages:
        raise ValueError(f"{len(weighted)} layers with parameters do not split into {n_stages} pipeline stages")
    starts = [weighted[len(weighted) * s // n_stages] for s in range(n_stages)]
    first = 0 if stage == 0 else starts[stage]
    end = starts[stage + 1] if stage + 1 < n_stages else len(chain)
    for i in range(len(chain)):
        if not first <= i < end:
            chain[i] = nn.Identity()
    return part


def sequential_of(model: nn.Module) -> nn.Sequential:
    if isinstance(model, nn.Sequential):
        return model
    chains = [child for child in model.children() if isinstance(child, nn.Sequential)]
    if len(chains) != 1:
        raise ValueError(f"sequential_split: {type(model).__name__} is no nn.Sequential and has {len(chains)} "
                         f"Sequential children, not one")
    return chains[0]


def stage_blocks(layers: int, n_stages: int, stage: int) -> range:
    """The block indices of `stage` when `layers` blocks are split into `n_stages` equal stages."""
    if layers % n_stages:
        raise ValueError(f"{layers} layers do not split into {n_stages} equal pipeline stages")
    per_stage = layers // n_stages
    return range(stage * per_stage, (stage + 1) * per_stage)


def build_schedule(parts: list[nn.Module], stages: list[int], n_stages: int, schedule: str, microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   group: torch.distributed.ProcessGroup, device: torch.device):
    """The pipeline schedule over this rank's `parts` (stage `stages[i]` computes `parts[i]`), talking to the other
    stages over `group` (point-to-point sends of activations and their gradients)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    pipeline_stages = [PipelineStage(part, stage, n_stages, device, group=group)
                       for part, stage in zip(parts, stages)]
    if schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(pipeline_stages, n_microbatches=microbatches, loss_fn=loss_fn)
    single = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    return single(pipeline_stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
