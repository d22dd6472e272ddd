"""Ray Train's PyTorch process group (what `ray.train.torch.TorchConfig` sets up: gloo on CPU, NCCL on GPU, `env://`
rendezvous at rank 0), behind a config whose module imports no torch.

Why not `TorchConfig` itself: Ray Train's controller unpickles the trainer's backend config as it starts, and
`ray.train.torch.config` imports torch at its top, so every run's controller spent 1.0-1.2 CPU-s importing torch
(measured: an interpreter with Ray Train imported), on the path from the driver's `fit` to the workers' start,
in a process that never runs torch (benchmarks/README.md, startup). Here the controller only orders the steps;
each one is Ray's own function from `ray.train.torch.config`, imported and run on the workers."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray._private.ray_constants import env_integer
from ray.train._internal.utils import get_address_and_port
from ray.train.backend import Backend, BackendConfig
from ray.train.constants import DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
from ray.train.v2._internal.util import TrainingFramework

logger = logging.getLogger(__name__)


def on_worker(name: str, **kwargs: Any) -> Any:
    """Runs on a worker: `ray.train.torch.config.<name>(**kwargs)`, importing torch there."""
    from ray.train.torch import config

    return getattr(config, name)(**kwargs)


def set_rendezvous(addr: str, port: int) -> None:
    """Runs on a worker: where `env://` finds rank 0."""
    import os

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)


class CudaDeviceContext:
    """The train function's context, as `TorchConfig`'s: a GPU worker's CUDA device made the current one."""

    def __enter__(self) -> None:
        from ray.train.torch.config import TorchConfigContextManager

        TorchConfigContextManager().__enter__()

    def __exit__(self, *exc_info: Any) -> bool:
        return False


@dataclass
class TorchGroupConfig(BackendConfig):
    """`backend`: "gloo" or "nccl"; `timeout_s`: the process group's collective timeout."""

    backend: str = "gloo"
    timeout_s: int = 1800

    @property
    def backend_cls(self) -> type:
        return TorchGroupBackend

    @property
    def train_func_context(self) -> type:
        return CudaDeviceContext

    @property
    def framework(self) -> TrainingFramework:
        return TrainingFramework.TORCH


class TorchGroupBackend(Backend):
    """`ray.train.torch.config._TorchBackend`'s steps for a CPU or GPU worker group (no TPU slices)."""

    share_cuda_visible_devices = True

    def on_start(self, worker_group: Any, backend_config: TorchGroupConfig) -> None:
        addr, port = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(set_rendezvous, addr=addr, port=port)
        worker_group.execute(on_worker, "_set_torch_distributed_env_vars")  # RANK, LOCAL_RANK, ... as torchrun's
        size = len(worker_group)
        ray.get([worker_group.execute_single_async(rank, on_worker, "_setup_torch_process_group",
                                                   backend=backend_config.backend, world_rank=rank, world_size=size,
                                                   init_method="env://", timeout_s=backend_config.timeout_s)
                 for rank in range(size)])

    def on_shutdown(self, worker_group: Any, backend_config: TorchGroupConfig) -> None:
        futures = worker_group.execute_async(on_worker, "_shutdown_torch", destroy_process_group=len(worker_group) > 1)
        timeout_s = env_integer(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)
        try:
            ray.get(futures, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            logger.warning("torch process group shutdown timed out after %d s", timeout_s)
