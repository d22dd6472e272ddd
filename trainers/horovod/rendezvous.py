"""Horovod's Gloo rendezvous as a Ray Train V2 backend (`RendezvousConfig`), for `DataParallelTrainer`.

Ray's own `HorovodTrainer` raises under Train V2, and its backend reads V1 worker-group internals. This backend
uses only the `BaseWorkerGroup` API (`execute`, `execute_single_async`, `len`), which V2 passes to backends, and
Horovod's own pieces for the protocol: its `RendezvousServer` (the HTTP key-value store `hvd.init()` talks to
in Gloo mode) and its `SlotInfo` host plan. What `horovodrun --gloo` does with ssh, Ray does with actors:

1. ask every worker which Ray node it runs on;
2. give each worker its Horovod slot: rank = Ray's world rank, local rank/size among the workers on its node,
   cross rank/size among the workers with the same local rank on other nodes;
3. start the rendezvous server in this process (Ray Train's controller) and initialise it with that plan;
4. set `HOROVOD_*` in every worker's environment; the training function then calls `hvd.init()`.

`on_shutdown` shuts Horovod down in the workers and stops the server. After a worker failure Ray Train starts a
new worker group and calls `on_start` again: a new server and a new plan, so the rendezvous is redone.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from ray.train.backend import Backend, BackendConfig

from trainers.preflight import PreflightConfig, check_workers_reachable
from trainers.worker import worker_place


@dataclass
class RendezvousConfig(BackendConfig):
    """Horovod over Gloo (CPU). `nics`: network interfaces for Gloo (default: loopback when all workers share
    one node, else the interface holding each worker's Ray node IP). `timeout_s`: how long `hvd.init()` waits
    for the other ranks at the rendezvous. `verbose`: the rendezvous server's logging (0 = quiet)."""

    nics: Optional[tuple[str, ...]] = None
    timeout_s: int = 120
    verbose: int = 0
    preflight: Optional[PreflightConfig] = None  # the workers' reachability, checked first (trainers/preflight.py)

    @property
    def backend_cls(self) -> type:
        return HorovodBackend


def slot_plan(node_ids: list[str]) -> list[Any]:
    """Horovod `SlotInfo` per worker, indexed by Ray world rank; `hostname` is the Ray node id.

    Local rank: order among the workers on the same node. Cross rank: order of the node among the nodes that
    have a worker with that local rank (what Horovod's `get_host_assignments` computes, but keeping Ray's rank
    order, so `hvd.rank()` is `ray.train.get_context().get_world_rank()` even when Ray's ranks are not grouped
    by node)."""
    from horovod.runner.common.util.hosts import SlotInfo

    local_ranks: list[int] = []
    per_node: dict[str, int] = {}
    for node in node_ids:
        local_ranks.append(per_node.get(node, 0))
        per_node[node] = local_ranks[-1] + 1
    nodes_by_local_rank: dict[int, list[str]] = {}
    for node, local_rank in zip(node_ids, local_ranks):
        nodes_by_local_rank.setdefault(local_rank, []).append(node)
    return [SlotInfo(hostname=node, rank=rank, local_rank=local_rank,
                     cross_rank=nodes_by_local_rank[local_rank].index(node), size=len(node_ids),
                     local_size=per_node[node], cross_size=len(nodes_by_local_rank[local_rank]))
            for rank, (node, local_rank) in enumerate(zip(node_ids, local_ranks))]


def slot_env(slot: Any) -> dict[str, str]:
    """The per-rank part of Horovod's environment; `HOROVOD_HOSTNAME` names the local rendezvous scope, so it
    must equal the plan's hostname."""
    return {"HOROVOD_RANK": str(slot.rank), "HOROVOD_SIZE": str(slot.size),
            "HOROVOD_LOCAL_RANK": str(slot.local_rank), "HOROVOD_LOCAL_SIZE": str(slot.local_size),
            "HOROVOD_CROSS_RANK": str(slot.cross_rank), "HOROVOD_CROSS_SIZE": str(slot.cross_size),
            "HOROVOD_HOSTNAME": slot.hostname}


def interface_of(ip: str) -> str:
    """The local network interface that holds `ip`, or else whose subnet contains it (runs on the worker).
    The subnet case: a node address such as 127.0.0.3 is served by `lo` (127.0.0.1/8) without being
    assigned to it, as with several Slurm nodes on one machine."""
    import ipaddress
    import socket

    import psutil

    inet = {name: [a for a in addresses if a.family == socket.AF_INET and a.netmask]
            for name, addresses in psutil.net_if_addrs().items()}
    for name, addresses in inet.items():
        if any(a.address == ip for a in addresses):
            return name
    for name, addresses in inet.items():
        if any(ipaddress.ip_address(ip) in ipaddress.ip_network(f"{a.address}/{a.netmask}", strict=False)
               for a in addresses):
            return name
    raise RuntimeError(f"horovod: no local network interface has the Ray node IP {ip}; set RendezvousConfig.nics")


def gloo_iface(nics: Optional[tuple[str, ...]], one_node: bool) -> str:
    """Runs on each worker: the interface Gloo uses (`HOROVOD_GLOO_IFACE`, read per process, so nodes may differ
    in interface names). Explicit `nics` win. All workers on one node: loopback, what horovodrun picks when
    every host is local. Several nodes: the interface of this worker's Ray node IP, through which Ray already
    connects the nodes. (horovodrun probes interfaces with a ring of task servers keyed by host hash instead;
    that collapses several Ray nodes on one machine, as in the local Slurm setup.)"""
    from horovod.runner.util.network import get_local_intfs

    if nics:
        return nics[0]
    if one_node:
        return sorted(get_local_intfs())[0]
    return interface_of(worker_place().node_ip)


def _set_env(env: dict[str, str], nics: Optional[tuple[str, ...]], one_node: bool) -> None:
    """Runs on each worker, before the training function (and so before `hvd.init()`)."""
    os.environ.update(env)
    os.environ["HOROVOD_GLOO_IFACE"] = gloo_iface(nics, one_node)


def _shutdown_horovod() -> None:
    """Runs on each worker: shut down whichever Horovod framework binding this process initialised."""
    import sys

    for name in ("horovod.torch", "horovod.tensorflow"):
        module = sys.modules.get(name)
        if module is not None and module.is_initialized():
            module.shutdown()


class HorovodBackend(Backend):
    """One per Ray Train controller process (Ray's `Backend` is a singleton): it owns the rendezvous server of
    the current worker group."""

    def __init__(self) -> None:
        self.server: Any = None

    def on_start(self, worker_group: Any, backend_config: RendezvousConfig) -> None:
        import ray
        from horovod.runner.http.http_server import RendezvousServer

        self._stop_server()  # a previous group's server, if its shutdown never ran (e.g. the controller retried)
        if backend_config.preflight is not None:
            check_workers_reachable(worker_group, backend_config.preflight)
        places = worker_group.execute(worker_place)
        plan = slot_plan([p.node_id for p in places])
        self.server = RendezvousServer(verbose=backend_config.verbose)
        port = self.server.start()  # binds all interfaces, a free port
        self.server.init(plan)
        common = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": ray.util.get_node_ip_address(),
                  "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
                  "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
                  "HOROVOD_GLOO_TIMEOUT_SECONDS": str(backend_config.timeout_s)}
        one_node = len({p.node_id for p in places}) == 1
        ray.get([worker_group.execute_single_async(rank, _set_env, {**common, **slot_env(slot)},
                                                   backend_config.nics, one_node)
                 for rank, slot in enumerate(plan)])

    def on_shutdown(self, worker_group: Any, backend_config: RendezvousConfig) -> None:
        try:
            worker_group.execute(_shutdown_horovod)
        finally:  # a dead worker makes the call above raise; the server must stop anyway
            self._stop_server()

    def _stop_server(self) -> None:
        if self.server is not None:
            server, self.server = self.server, None
            server.stop()
