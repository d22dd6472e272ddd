"""Run test functions on N local CPU processes joined by a gloo process group (no Ray).

Spawning ranks and importing torch costs 2-6 s per test on this 2-core machine, so a `RankPool` spawns its
ranks once (torch.multiprocessing.spawn, join=False) and then runs many test functions on them: each call sends
`fn` to every rank, which runs `fn(rank, world_size, *args)` and reports success or its traceback.

Failures: the first rank to report an error (an AssertionError or anything else) is the root cause; the pool is
then torn down at once (peers may be stuck in a collective with the failed rank) and RankFailure carrying that
traceback is raised in the test process. The next call spawns a fresh pool. A rank that dies without reporting
(a crash) or a call that exceeds its deadline fails the same way, so a broken test never hangs the suite.
`fn` must be a module-level (picklable) function.
"""
from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# A rank blocked in a collective whose peer died gives up after this long instead of gloo's 30 minutes.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
CALL_TIMEOUT_S = 120.0  # a whole test function on all ranks; the slowest here takes a few seconds


class RankFailure(Exception):
    """A rank raised, crashed or timed out; the message holds the root-cause traceback."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def seeded_float64(seed: int = 0) -> None:
    """Same seed and dtype on every rank: each rank builds the same dense reference and the same inputs."""
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.float64)


def _worker(rank: int, world_size: int, port: int, parent_pid: int, tasks: list, results: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)  # 2 cores shared by all ranks (and whatever else runs here)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)
    while os.getppid() == parent_pid:  # stop if the test process vanished without closing the pool
        try:
            task = tasks[rank].get(timeout=5.0)
        except queue.Empty:
            continue
        fn, args = task
        try:
            fn(rank, world_size, *args)
            dist.barrier()  # the next task's collectives must not interleave with a peer still on this one
            results.put((rank, None))
        except BaseException:  # noqa: BLE001 - everything goes back to the test process
            results.put((rank, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """`world_size` gloo ranks that stay alive between calls."""

    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        self.context = mp.spawn(_worker, args=(world_size, free_port(), os.getpid(), self.tasks, self.results),
                                nprocs=world_size, join=False, daemon=True)

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        for rank_queue in self.tasks:
            rank_queue.put((fn, args))
        done: set[int] = set()
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while len(done) < self.world_size:
            try:
                rank, error = self.results.get(timeout=0.5)
            except queue.Empty:
                dead = [p.pid for p in self.context.processes if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close()
                    raise RankFailure(f"{fn.__name__}: rank processes {dead} died" if dead
                                      else f"{fn.__name__}: no result after {CALL_TIMEOUT_S} s") from None
                continue
            if error is not None:
                self.close()
                raise RankFailure(f"{fn.__name__} failed first on rank {rank}:\n{error}")
            done.add(rank)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.context.processes)

    def close(self) -> None:
        """End the ranks at once: between calls they hold nothing worth an orderly exit, which cost 1-5 s per
        pool (interpreter and torch teardown; 11 s for the suite's pools on 2 cores), and after a failure some
        may be stuck in a collective with the failed peer."""
        for proc in self.context.processes:
            proc.terminate()
        for proc in self.context.processes:
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()


class RankPools:
    """One pool per world size, created on first use and re-created after a failure tore it down."""

    def __init__(self) -> None:
        self.pools: dict[int, RankPool] = {}

    def __call__(self, fn: Callable[..., Any], world_size: int, *args: Any) -> None:
        """Run fn(rank, world_size, *args) on every rank; raise RankFailure if any rank failed."""
        pool = self.pools.get(world_size)
        if pool is None or not pool.alive:
            pool = self.pools[world_size] = RankPool(world_size)
        pool.run(fn, *args)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
