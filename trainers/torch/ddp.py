"""trainer=ddp: PyTorch DistributedDataParallel (gloo on CPU, NCCL on GPU): the plain model on every rank, its
gradients all-reduced by DDP's buckets during backward."""
from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import nn

from trainers.adapter import WorkerData
from trainers.context import WorkerContext
from trainers.models import build_model
from trainers.torch.adapter import TorchAdapter, place_model, seed_dropout, worker_device
from trainers.torch.backend import TorchBackend
from trainers.torch.recipe import build_recipe


class DDP(TorchBackend):
    def build_adapter(self, cfg: DictConfig, ctx: WorkerContext, data: WorkerData) -> TorchAdapter:
        """The plain model and optimizer, wrapped in DDP when there are several ranks (as Ray's `prepare_model`
        wraps it), and this rank's shard, shuffled by its own seed."""
        device = worker_device(ctx)
        torch.manual_seed(cfg.run.seed)  # same initial weights on every rank (DDP also broadcasts them)
        model = place_model(build_model(cfg.model, data.inputs, seed=cfg.run.seed), device)
        train, evaluation = data.shards(cfg.run.seed + 1000 * ctx.rank)
        recipe = build_recipe(model, cfg.trainer, train.steps(), device)
        if ctx.world_size > 1:
            model = nn.parallel.DistributedDataParallel(model,
                                                        device_ids=[device.index] if device.type == "cuda" else None)
        seed_dropout(cfg.run.seed, ctx.rank)
        return TorchAdapter(model, recipe, train, evaluation, device, ctx.rank)
