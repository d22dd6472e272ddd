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

A node at fault (one the others cannot reach, or a slow one) is left out where the cluster is the run's own
(`run.preflight_leave_out`; on under Slurm, whose job starts a Ray cluster for itself): its Ray node is stopped
(Ray's GCS drains it, as Ray's autoscaler stops a node), it is recorded in the run's folder (`LEFT_OUT_FILE`), and
the attempt fails as a failed start of the worker group (`NodesLeftOut`), started again on the nodes left (not
counted against `fault.max_failures`): an elastic run at the size they hold, a fixed one where spare nodes can hold
it. Never the node of Ray's head or of the run's controller, which end the run with them; nor when every node is at
fault (nothing says which end of a link is broken).
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any, Iterable, NoReturn, Optional

from trainers.worker import WorkerPlace, worker_place

PREFLIGHT_FILE = "preflight.json"  # in the run's folder: {"metrics": {...}, "slow": "<line>" or null}
UNROUTABLE = "192.0.2.1"  # TEST-NET-1 (RFC 5737), routed nowhere: `fault.inject_unreachable_rank` advertises it
SLOW_FACTOR = 5.0  # a node whose links are this many times slower (latency or bandwidth) than the others' fails
LEFT_OUT_FILE = "left_out.json"  # in the run's folder: [{"node": ip, "why": line}, ...], the nodes left out


@dataclass(frozen=True)
class PreflightConfig:
    """What a backend's `on_start` checks: `timeout_s` per connection, the measurements into `run_folder`;
    `leave_out`: stop the nodes at fault and let Ray Train retry without them; `unreachable_rank` and
    `unreachable_node` (testing): the addresses of that rank, or of every rank on the node of that IP, that the
    others are given route nowhere."""
    timeout_s: float
    run_folder: str
    leave_out: bool = False
    unreachable_rank: Optional[int] = None
    unreachable_node: Optional[str] = None


class PreflightFailed(RuntimeError):
    """A worker cannot be reached, or a node's links are far slower than the others'."""


def preflight_config(cfg: Any, run_id: str) -> PreflightConfig | None:
    """The preflight of run `run_id`, or None: `run.preflight` (null: on under Slurm, where the nodes and their
    network are the cluster's), leaving nodes at fault out when `run.preflight_leave_out` (null: under Slurm)."""
    from contract.tracking import run_dir

    wanted = cfg.run.preflight if cfg.run.preflight is not None else "SLURM_JOB_ID" in os.environ
    if not wanted:
        return None
    leave_out = cfg.run.preflight_leave_out if cfg.run.preflight_leave_out is not None else \
        "SLURM_JOB_ID" in os.environ
    return PreflightConfig(cfg.run.preflight_timeout_s, str(run_dir(cfg.run.storage_path, run_id)), leave_out,
                           cfg.fault.inject_unreachable_rank, cfg.fault.inject_unreachable_node)


def check_workers_reachable(worker_group: Any, config: PreflightConfig) -> list[WorkerPlace]:
    """Step 1 (in a backend's `on_start`, before its process group, its servers or its rendezvous): raises
    (`fail`) naming the unreachable. Returns where the workers run (for step 2); nothing to check, and [], for a
    single worker."""
    import ray

    if len(worker_group) < 2:
        return []
    places = worker_group.execute(worker_place)
    probes = worker_group.execute(open_probe, 2 * config.timeout_s + 30)
    addresses = list(probes)
    for rank, address in enumerate(addresses):
        ip, port = address.rsplit(":", 1)
        if rank == config.unreachable_rank or ip == config.unreachable_node:
            addresses[rank] = f"{UNROUTABLE}:{port}"
    failures = ray.get([worker_group.execute_single_async(rank, reach_all, rank, addresses, config.timeout_s)
                        for rank in range(len(addresses))])
    line = unreachable_line(addresses, failures, config.timeout_s)
    if line:
        missed = {target for failed in failures for target, _ in failed}
        fail(line, {places[rank].node_id: places[rank].node_ip for rank in sorted(missed)}, config, worker_group)
    return places


def fail(line: str, at_fault: dict[str, str], config: PreflightConfig, worker_group: Any = None) -> NoReturn:
    """The preflight's verdict `line` on the nodes `at_fault` (Ray node id -> IP): once they are stopped and
    recorded (`config.leave_out`, and none of them is the head's or the controller's node, the caller's) and
    `worker_group` released, NodesLeftOut (a failed start, started again); else PreflightFailed, which ends the
    run."""
    import ray

    from trainers.nodes_left_out import NodesLeftOut

    if not config.leave_out or not at_fault:
        raise PreflightFailed(line)
    alive = [node for node in ray.nodes() if node["Alive"]]
    keep = {ray.get_runtime_context().get_node_id()} | {
        node["NodeID"] for node in alive if "node:__internal_head__" in node["Resources"]}
    if keep & at_fault.keys() or len(at_fault) >= len(alive):
        raise PreflightFailed(line)
    record_left_out(Path(config.run_folder), at_fault.values(), line)
    stop_nodes(list(at_fault))
    release(worker_group)
    ips = ", ".join(sorted(set(at_fault.values())))
    raise NodesLeftOut(f"{line}; left out node(s) {ips} (their Ray stopped), starting again without them")


def record_left_out(run_folder: Path, ips: Iterable[str], why: str) -> None:
    """Add the nodes `ips` to the run's LEFT_OUT_FILE, with the verdict that left them out."""
    recorded = read_left_out(run_folder) + [{"node": ip, "why": why} for ip in sorted(set(ips))]
    run_folder.mkdir(parents=True, exist_ok=True)
    (run_folder / LEFT_OUT_FILE).write_text(json.dumps(recorded, indent=1))


def read_left_out(run_folder: Path) -> list[dict[str, str]]:
    path = run_folder / LEFT_OUT_FILE
    return json.loads(path.read_text()) if path.is_file() else []


def stop_nodes(node_ids: list[str]) -> None:
    """Stop these Ray nodes: the GCS tells their raylets to shut down (what Ray's autoscaler does to the nodes it
    scales down; the node's `ray start --block`, a Slurm step here, then ends). Their workers die with them."""
    import ray

    gcs = ray._private.worker.global_worker.gcs_client
    gcs.drain_nodes(node_ids=[ray.NodeID.from_hex(node).binary() for node in node_ids])


def release(worker_group: Any) -> None:
    """Ray Train (2.60) releases the workers and the placement group of a start that fails before its worker group
    is built, but not of one whose backend's `on_start` fails: after it, the workers left and their placement group
    would hold the nodes' CPUs, and the retry could not place its own group. Released here as Ray releases the
    earlier failures (its `WorkerGroupStateBuilder.shutdown`, no callbacks)."""
    state = getattr(worker_group, "_worker_group_state", None)
    if state is not None:
        state.shutdown()
        worker_group._clear_state()


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


def slow_nodes(links: dict[tuple[str, str], tuple[float, float]]) -> dict[str, str]:
    """`links`: (node, node) -> (latency ms, GB/s). Each node whose links are SLOW_FACTOR times slower (median
    latency or bandwidth) than the links among the other nodes, with its figures; none with fewer than three nodes
    (a single link cannot tell which end is slow)."""
    nodes = sorted({node for pair in links for node in pair})
    if len(nodes) < 3:
        return {}
    slow = {}
    for node in nodes:
        mine = [v for pair, v in links.items() if node in pair]
        theirs = [v for pair, v in links.items() if node not in pair]
        own_latency, own_bandwidth = median(v[0] for v in mine), median(v[1] for v in mine)
        latency, bandwidth = median(v[0] for v in theirs), median(v[1] for v in theirs)
        if own_latency > SLOW_FACTOR * latency or own_bandwidth * SLOW_FACTOR < bandwidth:
            slow[node] = (f"{own_latency:.3g} ms, {own_bandwidth:.3g} GB/s against {latency:.3g} ms, "
                          f"{bandwidth:.3g} GB/s between the other nodes")
    return slow


def slow_node_line(links: dict[tuple[str, str], tuple[float, float]]) -> str | None:
    """One line naming each of the `slow_nodes`, or None."""
    slow = slow_nodes(links)
    if not slow:
        return None
    return "preflight: slow node(s): " + "; ".join(f"{node} ({figures})" for node, figures in slow.items()) + \
        f": more than {SLOW_FACTOR:g} times slower; drain it or leave it out of the allocation (sbatch --exclude)"
