"""The torch process group Ray Train's workers join (trainers/torch/process_group.py): rank 0's store listens on
a port from the moment the port is chosen, and the ranks form a working gloo group over it."""
from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp


def _rank1(addr: str, port: int, results: "mp.Queue") -> None:
    import torch.distributed as dist

    from trainers.torch.process_group import join_group

    join_group("gloo", 1, 2, addr, port, timeout_s=60)
    value = torch.tensor([2.0])
    dist.all_reduce(value)
    results.put(value.item())
    dist.destroy_process_group()


def test_rank0s_store_holds_its_port_from_the_start_and_the_group_forms_over_it(monkeypatch):
    import ray.util
    import torch.distributed as dist

    from trainers.torch import process_group

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    addr, port = process_group.open_store(world_size=2, timeout_s=60)
    with socket.socket() as other, pytest.raises(OSError):  # nobody else can take the port meanwhile
        other.bind((addr, port))
    context = mp.get_context("spawn")
    results = context.Queue()
    rank1 = context.Process(target=_rank1, args=(addr, port, results))
    rank1.start()
    try:
        process_group.join_group("gloo", 0, 2, addr, port, timeout_s=60)
        value = torch.tensor([1.0])
        dist.all_reduce(value)
        assert value.item() == results.get(timeout=60) == 3.0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        rank1.join(timeout=60)
        process_group._store = None
