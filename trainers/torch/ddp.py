"""PyTorch DistributedDataParallel on Ray Train (`TorchTrainer`): gloo on CPU, NCCL on GPU."""
from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from contract.data import DataSchema
from trainers.adapter import WorkerData
from trainers.loop import WorkerContext
from trainers.models import build_model
from trainers.torch import common as tc
from trainers.torch.recipe import build_recipe

log_final_model = tc.log_final_model  # checkpoints hold the dense model


def build_adapter(cfg: DictConfig, ctx: WorkerContext, data: WorkerData) -> tc.TorchAdapter:
    """The plain model and optimizer, wrapped in DDP when there are several ranks (as Ray's `prepare_model` wraps
    it), and this rank's shard, shuffled by its own seed."""
    device = tc.worker_device(ctx)
    torch.manual_seed(cfg.run.seed)  # same initial weights on every rank (DDP also broadcasts them)
    model = tc.place_model(build_model(cfg.model, data.inputs, seed=cfg.run.seed), device)
    train, evaluation = data.shards(cfg.run.seed + 1000 * ctx.rank)
    recipe = build_recipe(model, cfg.trainer, train.steps(), device)
    if ctx.world_size > 1:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    tc.seed_dropout(cfg.run.seed, ctx.rank)
    return tc.TorchAdapter(model, recipe, train, evaluation, device, ctx.rank)


def run_worker(cfg: DictConfig, ctx: WorkerContext, data: WorkerData) -> bool:
    """This worker's adapter on the shared loop. False: stopped on request."""
    return tc.train_adapter(cfg, ctx, build_adapter(cfg, ctx, data))


def train_loop_per_worker(config: dict[str, Any]) -> None:
    tc.run_on_ray(config, run_worker)


def build_trainer(cfg: DictConfig, datasets: dict, run_id: str, tracking_uri: str, inputs: DataSchema,
                  callbacks: list | None = None):
    return tc.torch_trainer(train_loop_per_worker, cfg, datasets, run_id, tracking_uri, inputs,
                            callbacks=callbacks)
