"""cluster/slurm/ray_slurm.py wait-nodes on a fake clock and a fake State API: the head's start is waited for
on its own limit, and the join timeout of the other nodes counts from the head being up, however slowly the head
starts. (tests/slurm/test_ray_cluster.py runs it on a real Slurm.)"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tests.slurm.conftest import REPO

EXPECTED = {"n1": "10.0.0.1", "n2": "10.0.0.2", "n3": "10.0.0.3"}


@pytest.fixture
def ray_slurm():
    spec = importlib.util.spec_from_file_location("ray_slurm_under_test", REPO / "cluster" / "slurm" / "ray_slurm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeCluster:
    """The State API of a head whose dashboard answers at `head_at` (fake seconds) and whose nodes are alive
    from their time in `alive_at`; the clock advances only by the wait's own sleeps and by each call's cost."""

    def __init__(self, module, monkeypatch, alive_at: dict[str, float], head_at: float, call_s: float = 0.2):
        self.now, self.alive_at, self.head_at, self.call_s = 0.0, alive_at, head_at, call_s
        monkeypatch.setattr(module.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(module.time, "time", lambda: 1000.0 + self.now)
        monkeypatch.setattr(module.time, "sleep", self.sleep)
        monkeypatch.setattr(module, "alive_node_addresses", self.alive)

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def alive(self, dashboard: str, timeout_s: int = 30) -> set[str]:
        assert timeout_s >= 1
        self.now += self.call_s
        if self.now < self.head_at:
            raise ConnectionError("Failed to connect to API server.\nIs the dashboard up?")
        return {addr for addr, at in self.alive_at.items() if self.now >= at}


def test_a_slow_head_is_not_reported_as_nodes_that_did_not_join(ray_slurm, monkeypatch, capsys):
    """The head's dashboard answers after 70 s (a loaded node), far beyond a 20 s join timeout; n2 joins 5 s
    later, n3 never: only n3 is named, after 20 s counted from the head being up."""
    cluster = FakeCluster(ray_slurm, monkeypatch, {"10.0.0.1": 70, "10.0.0.2": 75}, head_at=70)
    assert ray_slurm.wait_nodes("http://10.0.0.1:20001", EXPECTED, 20, 300, job_start=1000.0) == 1
    out, err = capsys.readouterr()
    up = re.fullmatch(r"ray-cluster: Ray head up after ([\d.]+) s; waiting up to 20 s for the other 2 node\(s\)\n", out)
    assert up and 70 <= float(up[1]) < 72, out  # one poll (1 s and the call) after it answered
    assert err == "ray-cluster: error: 1 of 3 nodes did not join the Ray cluster within 20 s: n3 (10.0.0.3)\n"
    assert float(up[1]) + 20 <= cluster.now < float(up[1]) + 22  # the join timeout ran from the head being up


def test_all_nodes_joining_after_a_slow_head_succeed(ray_slurm, monkeypatch, capsys):
    FakeCluster(ray_slurm, monkeypatch, {"10.0.0.1": 100, "10.0.0.2": 110, "10.0.0.3": 118}, head_at=95)
    assert ray_slurm.wait_nodes("http://10.0.0.1:20001", EXPECTED, 20, 300) == 0
    assert capsys.readouterr().err == ""


def test_a_head_that_is_never_up_fails_on_its_own_limit_naming_it(ray_slurm, monkeypatch, capsys):
    """The dashboard never answers: the head is named, with the last error on the same line, after the head's own
    limit (not the join timeout), and no node is reported as not joining."""
    cluster = FakeCluster(ray_slurm, monkeypatch, {}, head_at=float("inf"))
    assert ray_slurm.wait_nodes("http://10.0.0.1:20001", EXPECTED, 20, 120) == 2
    err = capsys.readouterr().err
    assert err == ("ray-cluster: error: the Ray head on n1 (10.0.0.1) was not up within 120 s (last error: "
                   "ConnectionError: Failed to connect to API server. Is the dashboard up?); give it longer with "
                   "RAY_SLURM_HEAD_TIMEOUT\n")
    assert 120 <= cluster.now < 122


def test_a_head_that_exits_fails_the_wait_at_once(ray_slurm, monkeypatch, capsys):
    """The head's process (its srun in the batch script) ends before its dashboard answers: no waiting out the limit."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid is free (and not reused within this test in practice)
    cluster = FakeCluster(ray_slurm, monkeypatch, {}, head_at=float("inf"))
    assert ray_slurm.wait_nodes("http://10.0.0.1:20001", EXPECTED, 20, 300, head_pid=dead.pid) == 2
    assert capsys.readouterr().err == "ray-cluster: error: the Ray head on n1 (10.0.0.1) exited before it was up\n"
    assert cluster.now < 2


def test_process_exited_sees_a_zombie_as_ended(ray_slurm):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        while open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            os.sched_yield()  # not reaped by us yet: a zombie once it has exited
        assert ray_slurm.process_exited(child.pid)
    finally:
        child.wait()
    assert not ray_slurm.process_exited(os.getpid())
