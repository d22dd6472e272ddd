"""PyTorch side of `trainer=horovod` (`trainer.framework=torch`): `hvd.DistributedOptimizer` on the shared
`TorchAdapter`. Checkpoints are ddp's (rank 0 writes the model and optimizer state), as is the logged model."""
from __future__ import annotations

import itertools
from typing import Any

import torch
from omegaconf import DictConfig

from contract.metrics import AsyncReducer, PendingReduce
from trainers.adapter import WorkerData
from trainers.horovod.common import import_horovod, init_horovod, record_init
from trainers.loop import WorkerContext
from trainers.models import build_model
from trainers.torch import common as tc
from trainers.torch.recipe import build_recipe


def hvd_reduce_later(hvd: Any) -> AsyncReducer:
    """`AsyncReducer` over Horovod's allreduce, run by Horovod's background thread until the result is asked for
    (the shared epoch metrics, the stop agreement, step losses)."""
    ops = {"sum": hvd.Sum, "max": hvd.Max}
    calls = itertools.count()

    def reduce_later(values: list[float], op: str) -> PendingReduce:
        # Named ops: every rank issues them in the same order, so the same counter value names the same op.
        handle = hvd.allreduce_async(torch.tensor(values, dtype=torch.float64), op=ops[op],
                                     name=f"metrics.{next(calls)}")
        return lambda: hvd.synchronize(handle).tolist()
    return reduce_later


class ContiguousCompression:
    """Horovod all-reduces and broadcasts only contiguous tensors, and a channels-last model's
    (`trainers.torch.common.place_model`) convolution weights and gradients are not: each such gradient is
    all-reduced as a contiguous copy (through `inner`, Horovod's compression) and the result copied back into it."""

    def __init__(self, inner: Any):
        self.inner = inner

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        dense = tensor.contiguous()
        compressed, inner_ctx = self.inner.compress(dense)
        return compressed, (tensor, dense, inner_ctx)

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        original, dense, inner_ctx = ctx
        reduced = self.inner.decompress(tensor, inner_ctx)
        return reduced if dense is original else original.copy_(reduced)


def broadcast_from_rank0(hvd: Any, tensors: dict[str, torch.Tensor]) -> None:
    """`hvd.broadcast_parameters` for tensors in any memory layout: rank 0's values into every rank's tensors."""
    dense = {name: tensor.contiguous() for name, tensor in tensors.items()}
    hvd.broadcast_parameters(dense, root_rank=0)
    for name, tensor in tensors.items():
        if dense[name] is not tensor:
            tensor.copy_(dense[name])


class HorovodTorchAdapter(tc.TorchAdapter):
    """Rank 0's weights become everyone's at the start (ranks draw different initial weights on purpose, so the
    broadcast is what aligns them) and again after a restore, with the optimizer state. On a fresh start the
    optimizer state is not broadcast: Horovod would take a zero-gradient step to create it, an extra Adam step."""

    def __init__(self, hvd: Any, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.hvd = hvd
        broadcast_from_rank0(hvd, self.model.state_dict())

    def step_optimizer(self) -> None:
        with self.optimizer.skip_synchronize():  # `sync_gradients` (optimizer.synchronize) already ran
            self.optimizer.step()

    def load_dense_state(self, model_state: dict[str, torch.Tensor], optimizer_state: dict | None) -> None:
        super().load_dense_state(model_state, optimizer_state)
        broadcast_from_rank0(self.hvd, self.model.state_dict())
        if optimizer_state is not None:
            for state in self.optimizer.state.values():  # Horovod broadcasts these in place: contiguous ones
                for key, value in state.items():
                    if torch.is_tensor(value) and not value.is_contiguous():
                        state[key] = value.contiguous()
            self.hvd.broadcast_optimizer_state(self.optimizer, root_rank=0)


def build_adapter(cfg: DictConfig, ctx: WorkerContext, data: WorkerData) -> HorovodTorchAdapter:
    """The model (its initial weights differ per rank on purpose: the broadcast must align them), Horovod's
    optimizer over the recipe's, this rank's shard. Horovod is initialised (`run_worker`)."""
    hvd = import_horovod("torch")
    rank, device = ctx.rank, torch.device("cpu")
    torch.manual_seed(cfg.run.seed + rank)
    model = tc.place_model(build_model(cfg.model, data.inputs, seed=cfg.run.seed + rank), device)
    train, evaluation = data.shards(cfg.run.seed + 1000 * rank)
    compression = hvd.Compression.fp16 if cfg.trainer.compression == "fp16" else hvd.Compression.none

    def distributed(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        # Horovod all-reduces each gradient once per `backward_passes_per_step` backward passes (accumulation).
        return hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), backward_passes_per_step=cfg.trainer.grad_accum,
            compression=ContiguousCompression(compression))
    recipe = build_recipe(model, cfg.trainer, train.steps(), device, wrap_optimizer=distributed)
    tc.seed_dropout(cfg.run.seed, rank)  # as trainer=ddp: the same seed trains the same model
    return HorovodTorchAdapter(hvd, model, recipe, train, evaluation, device, rank,
                               reduce_later=hvd_reduce_later(hvd), sync_gradients=recipe.optimizer.synchronize)


def run_worker(cfg: DictConfig, ctx: WorkerContext, data: WorkerData) -> bool:
    """`hvd.init()`, then this worker's adapter on the shared loop. False: stopped on request."""
    hvd = import_horovod("torch")
    torch.set_num_threads(cfg.trainer.threads_per_worker)
    init_horovod(hvd, ctx.rank, ctx.world_size)
    record_init(cfg.run.dump_params_dir, ctx.rank)
    return tc.train_adapter(cfg, ctx, build_adapter(cfg, ctx, data))


def train_loop_per_worker(config: dict[str, Any]) -> None:
    tc.run_on_ray(config, run_worker)
