"""The Ray Train backend of the PyTorch backends (a torch process group), in a module that imports no torch. Ray
Train's controller unpickles the trainer's backend config as it starts, before its worker group, in a process that
never runs torch; Ray's own `ray.train.torch.TorchConfig` lives in a module that imports torch at the top (a second
of CPU in every controller: benchmarks/README.md, startup). This config sets up the same thing, each step a
function imported and run on the workers (`trainers.worker.on_worker`): Ray's own, and the process group made over a
store that rank 0 opens on a port it binds as it picks it (`open_store`, `join_group`). The controller only orders
them."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import ray
from ray._private.ray_constants import env_integer
from ray.train.backend import Backend, BackendConfig
from ray.train.constants import DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
from ray.train.v2._internal.util import TrainingFramework

from trainers.preflight import PreflightConfig, check_workers_reachable, fail
from trainers.worker import on_worker, set_env

logger = logging.getLogger(__name__)

TORCH = "ray.train.torch.config"
STORE = "trainers.torch.process_group"  # `open_store` and `join_group`, run on the workers
_store: Any = None  # on rank 0's worker: the group's TCPStore, kept as long as the process group uses it


class CudaDeviceContext:
    """The train function's context, as `TorchConfig`'s: a GPU worker's CUDA device made the current one."""

    def __enter__(self) -> None:
        from ray.train.torch.config import TorchConfigContextManager

        TorchConfigContextManager().__enter__()

    def __exit__(self, *exc_info: Any) -> bool:
        return False


@dataclass
class TorchGroupConfig(BackendConfig):
    """What `TorchConfig` sets up: a torch process group (gloo on CPU, NCCL on GPU, `env://` rendezvous at rank
    0). `backend`: "gloo" or "nccl"; `timeout_s`: the process group's collective timeout (`fault.collective_timeout_s`);
    `env`: set in every worker before the group is made (NCCL's Flight Recorder: `flight_recorder_env`);
    `preflight`: the workers' reachability checked before the group is made, its links measured after
    (trainers/preflight.py)."""

    backend: str = "gloo"
    timeout_s: int = 1800
    env: dict[str, str] = field(default_factory=dict)
    preflight: Optional[PreflightConfig] = None
    framework = TrainingFramework.TORCH  # what Ray Train records of the run
    train_func_context = CudaDeviceContext  # the train function runs in it

    @property
    def backend_cls(self) -> type:
        return TorchGroupBackend


def flight_recorder_env(hang_folder: str) -> dict[str, str]:
    """NCCL's Flight Recorder on (PyTorch's record of each rank's last collectives), its dump on a collective's
    timeout written into the run's hang/ folder (`nccl_trace_rank_<r>`), which the driver logs to MLflow."""
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": f"{hang_folder}/nccl_trace_rank_"}


class TorchGroupBackend(Backend):
    """`ray.train.torch.config._TorchBackend`'s steps for a CPU or GPU worker group (no TPU slices)."""

    share_cuda_visible_devices = True

    def on_start(self, worker_group: Any, backend_config: TorchGroupConfig) -> None:
        preflight = backend_config.preflight
        places = check_workers_reachable(worker_group, preflight) if preflight is not None else []
        self.make_group(worker_group, backend_config)
        if places:
            slow, nodes = ray.get([worker_group.execute_single_async(
                rank, on_worker, "trainers.torch.preflight", "measure_links", world_rank=rank,
                node_ids=[p.node_id for p in places], node_ips=[p.node_ip for p in places],
                run_folder=preflight.run_folder) for rank in range(len(places))])[0]
            if slow:
                fail(slow, {p.node_id: p.node_ip for p in places if p.node_id in nodes}, preflight, worker_group)

    def make_group(self, worker_group: Any, backend_config: TorchGroupConfig) -> None:
        """Rank 0 opens the group's store on a port it binds as it picks it (`open_store`); every rank joins the
        group over it (`join_group`). MASTER_ADDR and MASTER_PORT name the store for the libraries that read them."""
        size, timeout_s = len(worker_group), backend_config.timeout_s
        addr, port = worker_group.execute_single(0, on_worker, STORE, "open_store", world_size=size,
                                                 timeout_s=timeout_s)
        worker_group.execute(set_env, {"MASTER_ADDR": addr, "MASTER_PORT": str(port)})
        worker_group.execute(on_worker, TORCH, "_set_torch_distributed_env_vars")  # RANK, LOCAL_RANK, ... as torchrun's
        if backend_config.env:
            worker_group.execute(set_env, backend_config.env)
        ray.get([worker_group.execute_single_async(rank, on_worker, STORE, "join_group", backend=backend_config.backend,
                                                   world_rank=rank, world_size=size, addr=addr, port=port,
                                                   timeout_s=timeout_s)
                 for rank in range(size)])

    def on_shutdown(self, worker_group: Any, backend_config: TorchGroupConfig) -> None:
        futures = worker_group.execute_async(on_worker, TORCH, "_shutdown_torch",
                                             destroy_process_group=len(worker_group) > 1)
        timeout_s = env_integer(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)
        try:
            ray.get(futures, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            logger.warning("torch process group shutdown timed out after %d s", timeout_s)


def open_store(world_size: int, timeout_s: int) -> tuple[str, int]:
    """Runs on rank 0: the process group's TCPStore, listening on a port the kernel picks as the store binds it.
    Ray's own set-up picks a free port first and the store binds it later, which on a busy node another process can
    take in between (`DistNetworkError ... EADDRINUSE`: the run fails at its start). Returns where the
    store listens: this node's address and the port."""
    from datetime import timedelta

    import ray.util
    import torch.distributed as dist

    global _store
    addr = ray.util.get_node_ip_address()
    _store = dist.TCPStore(addr, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                           wait_for_workers=False)
    return addr, _store.port


def join_group(backend: str, world_rank: int, world_size: int, addr: str, port: int, timeout_s: int) -> None:
    """Runs on every rank: the torch process group over rank 0's store, as Ray's `_setup_torch_process_group` makes
    it over `env://` (NCCL: a collective that times out fails the process, unless the user chose otherwise)."""
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = _store if world_rank == 0 else dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
    if backend == "nccl" and not {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT"} & set(os.environ):
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
    dist.init_process_group(backend=backend, store=store, rank=world_rank, world_size=world_size, timeout=timeout)
