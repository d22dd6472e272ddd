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
from trainers.context import WorkerContext
from trainers.models import build_model
from trainers.torch.adapter import TorchAdapter, place_model, seed_dropout
from trainers.torch.backend import TorchBackend
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
    (`trainers.torch.adapter.place_model`) convolution weights and gradients are not: each such gradient is
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


class HorovodTorchAdapter(TorchAdapter):
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


class HorovodTorch(TorchBackend):
    """trainer=horovod, trainer.framework=torch: Horovod's Gloo rendezvous instead of a torch process group."""

    def ray_setup(self, cfg: DictConfig, run_id: str) -> Any:
        from trainers.horovod.rendezvous import RendezvousConfig
        from trainers.preflight import preflight_config

        return RendezvousConfig(preflight=preflight_config(cfg, run_id))

    def scaling_config(self, cfg: DictConfig) -> Any:
        from trainers.worker import scaling_config

        return scaling_config(cfg, use_gpu=False)  # Gloo CPU operations only

    def run_worker(self, cfg: DictConfig, ctx: WorkerContext, data: WorkerData) -> bool:
        """`hvd.init()`, then this worker's adapter on the shared loop. False: stopped on request."""
        hvd = import_horovod("torch")
        init_horovod(hvd, ctx.rank, ctx.world_size)
        record_init(cfg.run.dump_params_dir, ctx.rank)
        return super().run_worker(cfg, ctx, data)

    def build_adapter(self, cfg: DictConfig, ctx: WorkerContext, data: WorkerData) -> HorovodTorchAdapter:
        """The model (its initial weights differ per rank on purpose: the broadcast must align them), Horovod's
        optimizer over the recipe's, this rank's shard. Horovod is initialised (`run_worker`)."""
        hvd = import_horovod("torch")
        rank, device = ctx.rank, torch.device("cpu")
        torch.manual_seed(cfg.run.seed + rank)
        model = place_model(build_model(cfg.model, data.inputs, seed=cfg.run.seed + rank), device)
        train, evaluation = data.shards(cfg.run.seed + 1000 * rank)
        compression = hvd.Compression.fp16 if cfg.trainer.compression == "fp16" else hvd.Compression.none

        def distributed(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
            # Horovod all-reduces each gradient once per `backward_passes_per_step` backward passes (accumulation).
            return hvd.DistributedOptimizer(
                optimizer, named_parameters=model.named_parameters(), backward_passes_per_step=cfg.trainer.grad_accum,
                compression=ContiguousCompression(compression))
        recipe = build_recipe(model, cfg.trainer, train.steps(), device, wrap_optimizer=distributed)
        seed_dropout(cfg.run.seed, rank)  # as trainer=ddp: the same seed trains the same model
        return HorovodTorchAdapter(hvd, model, recipe, train, evaluation, device, rank,
                                   reduce_later=hvd_reduce_later(hvd), sync_gradients=recipe.optimizer.synchronize)
