"""Multi-client TensorFlow DTensor as a Ray Train V2 backend (`DTensorClientsConfig`), for `DataParallelTrainer`: what
`TensorflowTrainer` does for TF_CONFIG, done for DTensor's variables, the way trainers/horovod/rendezvous.py does
Horovod's rendezvous.

Before the training function starts, every worker reports its Ray node IP and a free port there; every worker then
gets `DTENSOR_CLIENT_ID` (its Ray world rank), `DTENSOR_NUM_CLIENTS`, `DTENSOR_JOB_NAME` and `DTENSOR_JOBS` (the
clients' addresses in rank order). `dtensor.initialize_accelerator_system` in the training function reads them,
serves on its address and connects to the others. One worker is a single client: no variables, no server. After
a worker failure Ray Train starts a new worker group and calls `on_start` again: new ports, a new DTensor cluster.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ray.train.backend import Backend, BackendConfig

from trainers.preflight import PreflightConfig, check_workers_reachable
from trainers.worker import free_addresses, set_worker_envs

JOB_NAME = "worker"


@dataclass
class DTensorClientsConfig(BackendConfig):
    preflight: Optional[PreflightConfig] = None  # the workers' reachability, checked first (trainers/preflight.py)

    @property
    def backend_cls(self) -> type:
        return DTensorBackend


def client_env(rank: int, addresses: list[str]) -> dict[str, str]:
    return {"DTENSOR_CLIENT_ID": str(rank), "DTENSOR_NUM_CLIENTS": str(len(addresses)),
            "DTENSOR_JOB_NAME": JOB_NAME, "DTENSOR_JOBS": ",".join(addresses)}


class DTensorBackend(Backend):
    def on_start(self, worker_group, backend_config: DTensorClientsConfig) -> None:
        if len(worker_group) == 1:
            return
        if backend_config.preflight is not None:
            check_workers_reachable(worker_group, backend_config.preflight)
        addresses = free_addresses(worker_group)
        set_worker_envs(worker_group, [client_env(rank, addresses) for rank in range(len(addresses))])
