"""Preflight: before a run's first step, can every worker reach every other one, and are the links between its
nodes about equally fast? Framework-free; the measurement over a framework's own collectives is the backend's
(trainers/torch/preflight.py).

1. Reachability, before the process group exists (a worker whose address the others cannot reach would otherwise
   hold the group's set-up until its timeout, 30 minutes by default): each worker opens a listening socket on its
   Ray node's address for a short while, and every worker connects to every other one's, all at once, each
   connection bounded by `run.preflight_timeout_s`. Any that fails ends the run at once with one line naming the
   ranks and addresses (a firewall between the nodes, or a node whose Ray address is not on the network the
   others share).
2. Speed, over the run's process group: the whole group's all-reduce latency and bus bandwidth, and for each pair
   of nodes a ping-pong between their first ranks (latency, bandwidth). Written to the run's folder
   (`PREFLIGHT_FILE`); the driver logs them as the run's `preflight.*` metrics. With three nodes or more, a node
   whose links are `SLOW_FACTOR` times slower than the links among the other nodes fails the run, naming it.
"""
from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from statistics import median
from typing import Any, Optional

PREFLIGHT_FILE = "preflight.json"  # in the run's folder: {"metrics": {...}, "slow": "<line>" or null}
UNROUTABLE = "192.0.2.1"  # TEST-NET-1 (RFC 5737), routed nowhere: `fault.inject_unreachable_rank` advertises it
SLOW_FACTOR = 5.0  # a node whose links are this many times slower (latency or bandwidth) than the others' fails


@dataclass(frozen=True)
class PreflightConfig:
    """What a backend's `on_start` checks: `timeout_s` per connection, the measurements into `run_folder`;
    `unreachable_rank` (testing): the address of that rank that the others are given routes nowhere."""
    timeout_s: float
    run_folder: str
    unreachable_rank: Optional[int] = None


class PreflightFailed(RuntimeError):
    """A worker cannot be reached, or a node's links are far slower than the others'."""


def preflight_config(cfg: Any, run_id: str) -> PreflightConfig | None:
    """The preflight of run `run_id`, or None: `run.preflight` (null: on under Slurm, where the nodes and their
    network are the cluster's)."""
    import os

    from contract.tracking import run_dir

    wanted = cfg.run.preflight if cfg.run.preflight is not None else "SLURM_JOB_ID" in os.environ
    if not wanted:
        return None
    return PreflightConfig(cfg.run.preflight_timeout_s, str(run_dir(cfg.run.storage_path, run_id)),
                           cfg.fault.inject_unreachable_rank)


def check_workers_reachable(worker_group: Any, config: PreflightConfig) -> None:
    """Step 1 (in a backend's `on_start`, before its process group, its servers or its rendezvous):
    PreflightFailed naming the unreachable. Nothing to check for a single worker."""
    import ray

    if len(worker_group) < 2:
        return
    addresses = worker_group.execute(open_probe, 2 * config.timeout_s + 30)
    if config.unreachable_rank is not None and config.unreachable_rank < len(addresses):
        port = addresses[config.unreachable_rank].rsplit(":", 1)[1]
        addresses[config.unreachable_rank] = f"{UNROUTABLE}:{port}"
    failures = ray.get([worker_group.execute_single_async(rank, reach_all, rank, addresses, config.timeout_s)
                        for rank in range(len(addresses))])
    line = unreachable_line(addresses, failures, config.timeout_s)
    if line:
        raise PreflightFailed(line)


def open_probe(lifetime_s: float) -> str:
    """Runs on a worker: `ip:port` of a socket listening on its Ray node's address for `lifetime_s`, which
    accepts and closes every connection."""
    import ray.util

    ip = ray.util.get_node_ip_address()
    server = socket.create_server((ip, 0), backlog=256)
    server.settimeout(1.0)

    def serve() -> None:
        deadline = time.monotonic() + lifetime_s
        with server:
            while time.monotonic() < deadline:
                try:
                    connection, _ = server.accept()
                except OSError:  # the accept's timeout: look at the deadline again
                    continue
                connection.close()
    threading.Thread(target=serve, name="preflight-probe", daemon=True).start()
    return f"{ip}:{server.getsockname()[1]}"


def reach_all(rank: int, addresses: list[str], timeout_s: float) -> list[tuple[int, str]]:
    """Runs on a worker: (rank, why) for each other worker whose address it cannot connect to in `timeout_s`
    (all tried at once)."""
    others = [r for r in range(len(addresses)) if r != rank]
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(others)))) as pool:
        outcomes = list(pool.map(lambda r: (r, connect_error(addresses[r], timeout_s)), others))
    return [(r, why) for r, why in outcomes if why is not None]


def connect_error(address: str, timeout_s: float) -> str | None:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except TimeoutError:
        return f"no answer in {timeout_s:g} s"
    except OSError as err:
        return err.strerror or str(err)
    return None


def unreachable_line(addresses: list[str], failures: list[list[tuple[int, str]]], timeout_s: float) -> str | None:
    """One line naming each rank that some other could not reach, with its address and who failed, or None."""
    missed: dict[int, list[str]] = {}
    for source, failed in enumerate(failures):
        for target, why in failed:
            missed.setdefault(target, []).append(f"rank {source} ({why})")
    if not missed:
        return None
    parts = [f"rank {target} at {addresses[target]} from {', '.join(sources)}" for target, sources in
             sorted(missed.items())]
    return ("preflight: workers cannot reach each other: " + "; ".join(parts) +
            ". Check the firewall between the nodes, and that each node's Ray address (ray start --node-ip-address)"
            " is on the network they share (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME for the collectives)")


def slow_node_line(links: dict[tuple[str, str], tuple[float, float]]) -> str | None:
    """`links`: (node, node) -> (latency ms, GB/s). One line naming each node whose links are SLOW_FACTOR times
    slower (median latency or bandwidth) than the links among the other nodes; None with fewer than three nodes
    (a single link cannot tell which end is slow)."""
    nodes = sorted({node for pair in links for node in pair})
    if len(nodes) < 3:
        return None
    slow = []
    for node in nodes:
        mine = [v for pair, v in links.items() if node in pair]
        theirs = [v for pair, v in links.items() if node not in pair]
        own_latency, own_bandwidth = median(v[0] for v in mine), median(v[1] for v in mine)
        latency, bandwidth = median(v[0] for v in theirs), median(v[1] for v in theirs)
        if own_latency > SLOW_FACTOR * latency or own_bandwidth * SLOW_FACTOR < bandwidth:
            slow.append(f"{node} ({own_latency:.3g} ms, {own_bandwidth:.3g} GB/s against {latency:.3g} ms, "
                        f"{bandwidth:.3g} GB/s between the other nodes)")
    if not slow:
        return None
    return "preflight: slow node(s): " + "; ".join(slow) + f": more than {SLOW_FACTOR:g} times slower; drain it " \
           "or leave it out of the allocation (sbatch --exclude)"
