"""The preflight's measurement over a PyTorch process group (trainers/preflight.py): run on every worker by the
torch backend's `on_start` once the group exists. The whole group's all-reduce, then each pair of nodes'
ping-pong between their first ranks (send/recv on the same group: gloo on CPU, NCCL on GPU), one pair at a time."""
from __future__ import annotations

import json
import time
from itertools import combinations
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from trainers.preflight import PREFLIGHT_FILE, slow_node_line, slow_nodes
from trainers.torch.parallel.comm import collective_device

LATENCY_REPEATS, BANDWIDTH_REPEATS = 20, 5


def measure_links(world_rank: int, node_ids: list[str], node_ips: list[str],
                  run_folder: str) -> tuple[str | None, list[str]]:
    """Collective. Rank 0 writes the metrics into the run's folder (`PREFLIGHT_FILE`); every rank returns the
    slow-node line (or None) and the slow nodes' ids, the same on each."""
    rank = world_rank
    device = collective_device()
    big = (64 if device.type == "cuda" else 4) * 2 ** 20  # bytes
    world = dist.get_world_size()
    one, payload = torch.zeros(1, device=device), torch.zeros(big // 4, device=device)
    latency_s = timed(lambda: dist.all_reduce(one), LATENCY_REPEATS, device)
    busy_s = timed(lambda: dist.all_reduce(payload), BANDWIDTH_REPEATS, device)
    metrics = {"preflight.allreduce_latency_ms": latency_s * 1e3,
               "preflight.allreduce_bus_gb_per_s": big / busy_s * 2 * (world - 1) / world / 1e9}
    labels = node_labels(node_ids, node_ips)
    firsts = sorted({node: node_ids.index(node) for node in node_ids}.values())  # each node's first rank
    pairs = list(combinations(firsts, 2))
    results = torch.zeros(2 * len(pairs), dtype=torch.float64, device=device)
    for i, (a, b) in enumerate(pairs):
        if rank in (a, b):
            latency, bandwidth = ping_pong(b if rank == a else a, rank == a, big, device)
            if rank == a:
                results[2 * i], results[2 * i + 1] = latency * 1e3, bandwidth
        dist.barrier()  # one pair at a time: no two share the links while measured
    dist.all_reduce(results)
    # Named in sorted order: the same pair of nodes has the same metrics whichever holds the lower rank
    links = {tuple(sorted((labels[a], labels[b]))): (float(results[2 * i]), float(results[2 * i + 1]))
             for i, (a, b) in enumerate(pairs)}
    for (x, y), (latency_ms, gb_per_s) in links.items():
        metrics[f"preflight.{x}-{y}.latency_ms"], metrics[f"preflight.{x}-{y}.gb_per_s"] = latency_ms, gb_per_s
    slow, slow_labels = slow_node_line(links), slow_nodes(links)
    if rank == 0:
        Path(run_folder).mkdir(parents=True, exist_ok=True)
        (Path(run_folder) / PREFLIGHT_FILE).write_text(json.dumps({"metrics": metrics, "slow": slow}))
    return slow, sorted({node_ids[r] for r, label in labels.items() if label in slow_labels})


def node_labels(node_ids: list[str], node_ips: list[str]) -> dict[int, str]:
    """Rank -> its node's IP; nodes sharing an IP (several Ray nodes on one machine) get `#<n>` after it."""
    first_ip = {}
    for node, ip in zip(node_ids, node_ips):
        first_ip.setdefault(node, ip)
    shared = {ip for ip in first_ip.values() if list(first_ip.values()).count(ip) > 1}
    names = {node: f"{ip}#{i}" if ip in shared else ip for i, (node, ip) in enumerate(first_ip.items())}
    return {rank: names[node] for rank, node in enumerate(node_ids)}


def ping_pong(peer: int, leads: bool, size: int, device: torch.device) -> tuple[float, float]:
    """(one-way latency s, GB/s) between this rank and `peer`, as the leading end measures them (the other end
    answers each message)."""
    small, big = torch.zeros(1, device=device), torch.zeros(size // 4, device=device)

    def round_trip(message: torch.Tensor) -> Callable[[], None]:
        def go() -> None:
            if leads:
                dist.send(message, peer)
                dist.recv(small, peer)
            else:
                dist.recv(message, peer)
                dist.send(small, peer)
        return go
    latency = timed(round_trip(small), LATENCY_REPEATS, device) / 2
    transfer = timed(round_trip(big), BANDWIDTH_REPEATS, device) - latency  # the big message's way, less the answer
    return latency, size / max(transfer, 1e-9) / 1e9


def timed(step: Callable[[], None], repeats: int, device: torch.device) -> float:
    """Mean seconds of `step` after one warm-up (the first call sets up connections and buffers)."""
    step()
    synchronize(device)
    began = time.perf_counter()
    for _ in range(repeats):
        step()
    synchronize(device)
    return (time.perf_counter() - began) / repeats


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
