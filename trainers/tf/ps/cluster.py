"""The cluster of `trainer=tf_ps` on Ray Train, around the chief's training (trainers/tf/tf_ps.py).

- A Ray Train V2 backend (`PSClusterConfig`) for `DataParallelTrainer`: what `TensorflowTrainer` does for
  MultiWorkerMirroredStrategy, done for a chief, parameter servers and workers. Roles by Ray world rank: rank 0 is
  the chief (the coordinator: it runs the training loop), ranks 1..num_ps the parameter servers, the rest the
  workers. Before the training function starts, every worker reports its Ray node IP and a free port there, and gets
  `TF_CONFIG` (the cluster spec and its own task) and the name of this attempt's `Board`. After a failure Ray Train
  starts a new worker group and calls `on_start` again: new ports, a new board, a new TensorFlow cluster.
- The `Board`, where the chief and the server roles talk: the workers publish their shards, the chief sends each
  report (Ray Train wants one from every rank), fault injections and the end. An actor rather than Ray Train's
  collectives: the server roles wait for whole epochs, and Ray Train warns every minute about a rank waiting in one.
- The servers: each parameter server's and worker's Ray worker runs its TensorFlow server in a child process
  (trainers/tf/ps/server.py) and watches it (`ServerProcess`): Ray Train ends the whole run when one of its workers
  dies, so a worker's server that dies is started again here while the coordinator gives its steps to the others.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass, replace
from itertools import count
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import ray
from omegaconf import DictConfig
from ray.train.backend import Backend, BackendConfig

from contract.data import DataSchema
from trainers.tf.data import ShardArrays
from contract.hang import Progress
from trainers.callbacks.base import LoopCallback
from trainers.callbacks.faults import FaultInjection
from trainers.callbacks.hang_marks import HangMarks
from trainers.context import WorkerContext
from trainers.preflight import PreflightConfig, check_workers_reachable
from trainers.worker import dataset_shards, free_addresses, set_worker_envs

BOARD_NAMESPACE = "tf_ps"
CHIEF, PS, WORKER = "chief", "ps", "worker"
SERVER = Path(__file__).with_name("server.py")
FEATURES, LABELS = "features", "labels"  # a worker's shard files (`write_shard`)


@dataclass
class PSClusterConfig(BackendConfig):
    num_ps: int = 1
    preflight: Optional[PreflightConfig] = None  # the servers' reachability, checked first (trainers/preflight.py)

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
    return ray.get_actor(os.environ["TF_PS_BOARD"], namespace=BOARD_NAMESPACE)


class TFPSBackend(Backend):
    def on_start(self, worker_group: Any, backend_config: PSClusterConfig) -> None:
        if backend_config.preflight is not None:
            check_workers_reachable(worker_group, backend_config.preflight)
        name = f"board-{uuid.uuid4().hex}"
        self.board = Board.options(name=name, namespace=BOARD_NAMESPACE).remote()
        addresses = free_addresses(worker_group)
        set_worker_envs(worker_group, [{"TF_CONFIG": tf_config(addresses, backend_config.num_ps, rank),
                                        "TF_PS_BOARD": name} for rank in range(len(addresses))])

    def on_shutdown(self, worker_group: Any, backend_config: PSClusterConfig) -> None:
        board = getattr(self, "board", None)
        if board is not None:
            ray.kill(board)
            self.board = None


def task_of_this_worker() -> tuple[str, int]:
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    return task["type"], int(task["index"])


def write_shard(train: ShardArrays, folder: str) -> dict[str, Any]:
    """This worker's train shard as raw arrays in `folder`, for the dataset function to read (no TensorFlow in
    this process: the server is the one that runs it)."""
    Path(folder, FEATURES).write_bytes(np.ascontiguousarray(train.features).tobytes())
    Path(folder, LABELS).write_bytes(np.ascontiguousarray(train.labels).tobytes())  # int64 ids, float32 targets
    return {"folder": folder, "rows": len(train.labels)}


class ServerProcess:
    """The TensorFlow server of task `kind:index` of the cluster `tf_config` (its TF_CONFIG) in a child process;
    a worker's is started again when it dies, a parameter server's death raises (the run restarts from its
    checkpoint)."""

    def __init__(self, kind: str, index: int, threads: int, tf_config: str):
        self.kind, self.index, self.threads, self.tf_config, self.restarts = kind, index, threads, tf_config, 0
        self.process = self._start()

    def _start(self) -> subprocess.Popen:
        env = {**os.environ, "TF_CONFIG": self.tf_config, "TF_PS_THREADS": str(self.threads),
               "TF_PS_PARENT": str(os.getpid()), "TF_CPP_MIN_LOG_LEVEL": "2"}
        return subprocess.Popen([sys.executable, str(SERVER)], env=env)

    def wait(self, ref: Any) -> Any:
        """The value of the Ray object `ref`, watching the server while it is not ready."""
        while True:
            self.check()
            if ray.wait([ref], timeout=1.0)[0]:
                return ray.get(ref)

    def check(self) -> None:
        code = self.process.poll()
        if code is None:
            return
        if self.kind != WORKER:
            raise RuntimeError(f"tf_ps: the {self.kind}:{self.index} server exited with code {code}")
        self.restarts += 1
        print(f"tf_ps: the {self.kind}:{self.index} server exited with code {code}; starting it again "
              f"(restart {self.restarts})", flush=True)
        self.process = self._start()

    def kill(self) -> None:
        """Fault injection (`fault.kill_servers`): the server dies as a crashed process does."""
        print(f"tf_ps: killing the {self.kind}:{self.index} server (fault.kill_servers)", flush=True)
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def serve(cfg: DictConfig, ctx: WorkerContext, inputs: DataSchema, kind: str, index: int) -> None:
    """A parameter server's or worker's Ray worker: publish the shard (workers), run the server, and follow the
    chief's messages (report along with it, kill the server on a fault injection) until it says done."""
    messages, folder = board(), None
    if kind == WORKER:
        (shard,), _ = dataset_shards("train")
        folder = tempfile.mkdtemp(prefix="tf_ps-")
        messages.put.remote(f"worker{index}", write_shard(ShardArrays(shard, inputs), folder))
    server = ServerProcess(kind, index, cfg.trainer.threads_per_worker, os.environ["TF_CONFIG"])
    try:
        for number in count():
            message = server.wait(messages.get.remote(f"message{number}"))
            if message["op"] == "report":
                ctx.report(message["metrics"], None)  # every rank reports (Ray Train syncs the checkpoint name)
            elif message["op"] == "kill" and message["task"] == f"{kind}:{index}":
                server.kill()
                messages.put.remote(f"killed {message['task']}", True)
            elif message["op"] == "done":
                return
    finally:
        server.stop()
        if folder:
            shutil.rmtree(folder, ignore_errors=True)


class PublishedShards:
    """The workers' train shards as the chief knows them (it holds none): each worker's folder and rows."""

    def __init__(self, published: list[dict[str, Any]]):
        self.folders = [shard["folder"] for shard in published]
        self.rows = [shard["rows"] for shard in published]
        self.load_s = 0.0  # the workers pull their shards; the chief's own wait is its evaluation shard's

    def steps(self, batch_size: int, max_steps: int | None) -> int:
        """Steps an epoch: as many as the train split has batches (each step is one worker's batch)."""
        steps = sum(self.rows) // batch_size
        return min(steps, max_steps) if max_steps else steps


class Chief:
    """Rank 0's side of the board: numbered messages to every server role."""

    def __init__(self, messages: Any):
        self.messages, self.sent = messages, 0

    def post(self, op: str, **fields: Any) -> None:
        self.messages.put.remote(f"message{self.sent}", {"op": op, **fields})
        self.sent += 1

    def kill(self, task: str) -> None:
        """Have `task`'s server killed, and wait until it is: the epoch's steps then find it dead."""
        self.post("kill", task=task)
        ray.get(self.messages.get.remote(f"killed {task}"))

    def shards(self, workers: int) -> PublishedShards:
        """What each worker published (it pulls and writes its shard first)."""
        return PublishedShards(ray.get([self.messages.get.remote(f"worker{i}") for i in range(workers)]))

    def context(self, ctx: WorkerContext, fault: DictConfig, progress: Progress) -> WorkerContext:
        """The loop's context on the chief: its only rank, watched for hangs (`progress`); each report goes to the
        server roles too (Ray Train wants one from every rank); `fault.inject_at_epoch` fails the chief,
        `fault.kill_servers` fire halfway through an epoch (`KillServers`)."""
        def report(metrics: dict[str, float], directory: str | None, background: bool = False,
                   written: Callable[[], Any] | None = None) -> None:
            self.post("report", metrics=metrics)
            ctx.report(metrics, directory, background, written)

        callbacks = [HangMarks(progress), FaultInjection(fault, 0, 1), KillServers(fault, self), *ctx.callbacks]
        return replace(ctx, world_size=1, report=report, callbacks=callbacks)


class KillServers(LoopCallback):
    """`fault.kill_servers` halfway through an epoch of the custom loop (steps in flight): kill the server of each
    `worker:<i>` or `ps:<i>` due then, or fail the chief (`chief:0`); each once, recorded in `fault.inject_marker`
    (which a restarted attempt reads). A resumed epoch already past its middle kills nothing."""

    def __init__(self, fault: DictConfig, chief: Chief):
        self.fault, self.chief, self.due = fault, chief, False

    def on_start(self, loop: Any) -> None:
        self.steps = loop.adapter.steps_per_epoch()

    def on_epoch_start(self, epoch: int, done: int) -> None:
        self.due = bool(self.fault.kill_servers) and done <= self.steps // 2

    def on_step_start(self, epoch: int, step: int) -> None:
        if self.due and step - 1 - (epoch - 1) * self.steps >= self.steps // 2:
            self.due = False
            self.kill_due(epoch)

    def kill_due(self, epoch: int) -> None:
        marker = Path(self.fault.inject_marker or "")
        fired = marker.read_text().split() if marker.exists() else []
        for item in self.fault.kill_servers:
            task, at = item.split("@")
            if int(at) != epoch or item in fired:
                continue
            with marker.open("a") as record:
                record.write(f"{item}\n")
            if task.startswith(CHIEF):
                raise RuntimeError(f"tf_ps: the chief fails halfway through epoch {epoch} (fault.kill_servers)")
            self.chief.kill(task)
