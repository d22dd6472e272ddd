"""Local Ray clusters for tests and benchmarks, started by the project's own script (cluster/local/ray-local.sh): a
head on a free port block, and nodes on other loopback addresses that join it and are lost (elastic runs)."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

SCRIPT = Path(__file__).resolve().parents[2] / "cluster" / "local" / "ray-local.sh"
LOOPBACK_NODES = {1: "127.0.0.2", 2: "127.0.0.3", 3: "127.0.0.4"}  # port slot -> a node's address


def free_port_block(size: int = 400) -> int:  # cluster/lib/ray-ports.sh RAY_PORT_BLOCK
    """A base port whose whole block [base, base+size) is free right now."""
    rng = np.random.default_rng()
    for _ in range(50):
        base = int(rng.integers(20000, 32768 - size))  # below the ephemeral range (outgoing connections)
        try:
            for port in range(base, base + size, 7):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port block")


@contextlib.contextmanager
def started_ray_head(state: Path, cpus: int, **settings: str) -> Iterator[dict[str, str]]:
    """A real Ray head started by the project's own script (own temp dir and ports; `settings`: more of its
    variables, e.g. RAY_OBJECT_STORE_MEMORY, or RAY_LOCAL_NODES=1 for a head nodes can join); the env to reach it.
    Stopped on exit, with the nodes that joined it."""
    env = {**os.environ, "RAY_BASE_PORT": str(free_port_block()), **settings}
    subprocess.run(["bash", str(SCRIPT), "start", str(state), str(cpus)], env=env, check=True, timeout=120)
    try:
        values = {}
        for line in (state / "ray.env").read_text().splitlines():
            if line.startswith("export "):
                key, value = line.removeprefix("export ").split("=", 1)
                values[key] = value
        yield values
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(state)], env=env, timeout=120)


def join_node(state: Path, values: dict[str, str], slot: int, cpus: int = 1) -> None:
    """Node `slot` (LOOPBACK_NODES) joins the head of `state` (`values`: its env), with `cpus` CPUs."""
    _node("join", state, values, str(slot), LOOPBACK_NODES[slot], str(cpus))


def lose_node(state: Path, values: dict[str, str], slot: int) -> None:
    """Node `slot` killed at once (SIGKILL to its Ray processes), as a lost machine."""
    _node("lose", state, values, str(slot))


def _node(action: str, state: Path, values: dict[str, str], *args: str) -> None:
    env = {**os.environ, **values, "RAY_BASE_PORT": values["RAY_ADDRESS"].rsplit(":", 1)[1],
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    subprocess.run(["bash", str(SCRIPT), action, str(state), *args], env=env, check=True, timeout=120,
                   capture_output=True)
