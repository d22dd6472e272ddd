"""Port blocks for the Ray clusters of tests and benchmarks (cluster/lib/ray-ports.sh lays a cluster out in one)."""
from __future__ import annotations

import socket

import numpy as np


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
