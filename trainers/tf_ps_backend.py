"""TensorFlow ParameterServerStrategy's cluster as a Ray Train V2 backend (`TFPSConfig`), for `DataParallelTrainer`:
what `TensorflowTrainer` does for MultiWorkerMirroredStrategy, done for a chief, parameter servers and workers.

Roles by Ray world rank: rank 0 is the chief (the coordinator: it runs the training loop), ranks 1..num_ps the
parameter servers, the rest the workers. Before the training function starts, every worker reports its Ray node IP
and a free port there, and gets `TF_CONFIG` (the cluster spec and its own task) and the name of this attempt's
`Board`, where the chief and the servers talk (trainers/tf_ps.py). After a failure Ray Train starts a new worker
group and calls `on_start` again: new ports, a new board, a new TensorFlow cluster.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any

import ray
from ray.train.backend import Backend, BackendConfig

from trainers.worker import free_address, set_env

BOARD_NAMESPACE = "tf_ps"
CHIEF, PS, WORKER = "chief", "ps", "worker"


@dataclass
class TFPSConfig(BackendConfig):
    num_ps: int = 1

    @property
    def backend_cls(self) -> type:
        return TFPSBackend


def roles(world_size: int, num_ps: int) -> list[tuple[str, int]]:
    """(task type, index) of each Ray world rank: the chief, then the parameter servers, then the workers."""
    workers = world_size - 1 - num_ps
    return [(CHIEF, 0), *[(PS, i) for i in range(num_ps)], *[(WORKER, i) for i in range(workers)]]


def tf_config(addresses: list[str], num_ps: int, rank: int) -> str:
    """TF_CONFIG of rank `rank` in a cluster whose ranks listen on `addresses`."""
    cluster: dict[str, list[str]] = {CHIEF: [], PS: [], WORKER: []}
    for (kind, _), address in zip(roles(len(addresses), num_ps), addresses):
        cluster[kind].append(address)
    kind, index = roles(len(addresses), num_ps)[rank]
    return json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})


@ray.remote(num_cpus=0)
class Board:
    """What the chief and the server roles of one attempt tell each other: a value under each key, written once;
    a read of a key not written yet waits for it (an async actor: waiting reads do not block writes)."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.written = asyncio.Condition()

    async def put(self, key: str, value: Any) -> None:
        async with self.written:
            self.values[key] = value
            self.written.notify_all()

    async def get(self, key: str) -> Any:
        async with self.written:
            await self.written.wait_for(lambda: key in self.values)
            return self.values[key]


def board() -> Any:
    """This attempt's board (in a worker of the run)."""
    import os

    return ray.get_actor(os.environ["TF_PS_BOARD"], namespace=BOARD_NAMESPACE)


class TFPSBackend(Backend):
    def on_start(self, worker_group: Any, backend_config: TFPSConfig) -> None:
        name = f"board-{uuid.uuid4().hex}"
        self.board = Board.options(name=name, namespace=BOARD_NAMESPACE).remote()
        addresses = worker_group.execute(free_address)
        ray.get([worker_group.execute_single_async(
            rank, set_env, {"TF_CONFIG": tf_config(addresses, backend_config.num_ps, rank), "TF_PS_BOARD": name})
            for rank in range(len(addresses))])

    def on_shutdown(self, worker_group: Any, backend_config: TFPSConfig) -> None:
        board = getattr(self, "board", None)
        if board is not None:
            ray.kill(board)
            self.board = None
