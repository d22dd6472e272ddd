"""Tensor parallelism (Megatron-style layers or torch DTensor plans) x data parallelism on Ray Train.

Every worker builds the same dense model from the same seed, `parallelize_bert` shards it over the "tp" mesh
dimension, and gradients are averaged over the "dp" dimension. Checkpoints hold the dense (unsharded) model and
the dense optimizer state, so a run resumes with its Adam moments, at the same or another tp.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from contract.registry import MODELS, resolve
from trainers.adapter import WorkerData
from trainers.context import WorkerContext
from trainers.models import build_model
from trainers.torch.adapter import TorchAdapter, seed_dropout, worker_device
from trainers.torch.backend import TorchBackend
from trainers.torch.data import Batch
from trainers.torch.recipe import build_recipe

class CollectiveTimer:
    """Wall time spent inside torch.distributed collectives called by Python code on this rank (our Megatron
    layers and the DP gradient sync; DTensor's functional collectives are not seen)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextmanager
    def patch(self) -> Iterator[None]:
        originals = {name: getattr(dist, name) for name in self.NAMES}

        def timed(fn):
            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - start
            return wrapper

        for name, fn in originals.items():
            setattr(dist, name, timed(fn))
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)


def rank_stats(model: torch.nn.Module, collective_s: float) -> dict[str, float]:
    """This rank's share of the model's parameters and its time in collectives."""
    from torch.distributed.tensor import DTensor

    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return {"param_count": float(sum(p.numel() for p in local)), "collective_time_s": collective_s}


class TPAdapter(TorchAdapter):
    """The loop's adapter for a tensor-parallel model: gradients averaged over the "dp" group after backward,
    checkpoints hold the dense model and the dense optimizer state (gathered from the TP shards), so a run
    resumes with its Adam moments at any tp; per-rank stats (`rank<r>.*`) are logged each epoch."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.timer = CollectiveTimer()

    def train_step(self, batch: Batch) -> tuple[float, int, int]:
        with self.timer.patch():  # training steps only, so collective time compares with train time
            return super().train_step(batch)

    def dense_model_state(self) -> dict[str, torch.Tensor]:
        from trainers.torch.parallel.plans import unshard_state_dict

        return unshard_state_dict(self.model)

    def dense_optimizer_state(self) -> dict:
        from trainers.torch.parallel.plans import dense_optimizer_state

        return dense_optimizer_state(self.model, self.optimizer)

    def load_dense_state(self, model_state: dict[str, torch.Tensor], optimizer_state: dict | None) -> None:
        from trainers.torch.parallel.plans import load_dense_optimizer_state, load_dense_state_dict

        load_dense_state_dict(self.model, model_state)
        if optimizer_state is not None:
            load_dense_optimizer_state(self.model, self.optimizer, optimizer_state)

    def own_stats(self) -> dict[str, float]:
        """Memory, as every PyTorch backend's, plus the parameter count and the time in collectives."""
        return {**super().own_stats(), **rank_stats(self.model, self.timer.seconds)}


class TP(TorchBackend):
    """trainer=tp: the dense model sharded over the "tp" mesh dimension by its spec's plan, gradients averaged over
    "dp"; every TP group reads one data-parallel shard."""

    def build_adapter(self, cfg: DictConfig, ctx: WorkerContext, data: WorkerData) -> TPAdapter:
        """Mesh, the dense model from the shared seed, sharded by its spec's tensor-parallel plan (`trainer.tp_impl`
        says which implementation, where the plan has two); each TP group reads one DP shard (`data.shards(seed)` ->
        (train, evaluation) batches), shuffled alike on its ranks."""
        from trainers.torch.parallel.data_parallel import average_gradients
        from trainers.torch.parallel.grad_norm import clip_grad_norm
        from trainers.torch.parallel.mesh import ParallelDims, build_mesh, rank_coords

        device = worker_device(ctx)
        dims = ParallelDims(dp=cfg.trainer.dp, tp=cfg.trainer.tp)
        dims.validate(ctx.world_size)
        dp_rank, _ = rank_coords(ctx.rank, dims.dp, dims.tp)
        mesh = build_mesh(dims, "cuda" if cfg.trainer.use_gpu else "cpu")
        torch.manual_seed(cfg.run.seed)  # same seed everywhere: identical dense weights before sharding
        tensor_parallel = resolve(MODELS.get(cfg.model.name).tensor_parallel)
        model = tensor_parallel(build_model(cfg.model, data.inputs).to(device), mesh, cfg.trainer.tp_impl)
        dp_group, tp_group = mesh.get_group("dp"), mesh.get_group("tp")
        train, evaluation = data.shards(cfg.run.seed + 1000 * dp_rank)  # same shuffle in a TP group
        recipe = build_recipe(model, cfg.trainer, train.steps(), device)
        seed_dropout(cfg.run.seed, dims.dropout_stream(ctx.rank))  # identical dropout masks inside a TP group
        return TPAdapter(model, recipe, train, evaluation, device, ctx.rank, ranks_per_sample=dims.tp,
                         sync_gradients=lambda: average_gradients(model, dp_group),
                         clip=lambda max_norm: clip_grad_norm(model, max_norm, tp_group))

    def batch_group(self, cfg: DictConfig) -> int:
        """A TP group's ranks read identical batches."""
        return cfg.trainer.tp
