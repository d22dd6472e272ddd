"""The preflight's framework-free parts (trainers/preflight.py): real sockets for reachability, and the verdicts
on measured links. Its run on a process group is tested end to end (tests/integration/test_ddp_pipeline.py, and
across two nodes in tests/slurm)."""
from __future__ import annotations

import socket

import pytest

from trainers.preflight import (SLOW_FACTOR, PreflightConfig, PreflightFailed, fail, open_probe, reach_all,
                                read_left_out, record_left_out, slow_node_line, slow_nodes, unreachable_line)
from trainers.torch.preflight import node_labels


def test_a_worker_names_the_addresses_it_cannot_connect_to():
    listening = open_probe(lifetime_s=30)
    with socket.socket() as closed:  # a port nobody listens on: refused
        closed.bind(("127.0.0.1", 0))
        refused = f"127.0.0.1:{closed.getsockname()[1]}"
        addresses = ["127.0.0.1:1", listening, refused]  # rank 0 is the caller: its own entry is never tried
        failures = reach_all(0, addresses, timeout_s=5)
    assert [rank for rank, _ in failures] == [2]
    line = unreachable_line(addresses, [failures, [], []], timeout_s=5)
    assert line.startswith(f"preflight: workers cannot reach each other: rank 2 at {refused} from rank 0 (")
    assert unreachable_line(addresses, [[], [], []], timeout_s=5) is None


def test_a_node_is_slow_when_its_links_are_far_slower_than_those_between_the_other_nodes():
    fast, slow = (0.05, 10.0), (0.05 * SLOW_FACTOR * 2, 10.0)
    links = {("a", "b"): fast, ("a", "c"): fast, ("b", "c"): fast, ("a", "d"): slow, ("b", "d"): slow,
             ("c", "d"): slow}
    assert slow_node_line(links).startswith("preflight: slow node(s): d (")
    thin = {**links, ("a", "d"): (0.05, 1.0 / SLOW_FACTOR), ("b", "d"): (0.05, 1.0), ("c", "d"): (0.05, 1.0)}
    assert slow_node_line(thin).startswith("preflight: slow node(s): d (")  # bandwidth, a tenth of the median
    assert slow_node_line({**links, ("a", "d"): fast, ("b", "d"): fast, ("c", "d"): fast}) is None
    three = {("a", "b"): fast, ("a", "c"): slow, ("b", "c"): slow}
    assert slow_node_line(three).startswith("preflight: slow node(s): c (")
    assert slow_node_line({("a", "b"): slow}) is None  # two nodes: which end is slow cannot be told
    assert list(slow_nodes(links)) == ["d"] and slow_nodes({**links, ("a", "d"): fast, ("b", "d"): fast,
                                                             ("c", "d"): fast}) == {}


def test_left_out_nodes_are_recorded_with_why_and_only_where_the_cluster_is_the_runs(tmp_path):
    record_left_out(tmp_path, ["10.0.0.3", "10.0.0.3"], "preflight: slow node(s): 10.0.0.3 (...)")
    record_left_out(tmp_path, ["10.0.0.4"], "preflight: workers cannot reach each other: ...")
    assert read_left_out(tmp_path) == [{"node": "10.0.0.3", "why": "preflight: slow node(s): 10.0.0.3 (...)"},
                                       {"node": "10.0.0.4", "why": "preflight: workers cannot reach each other: ..."}]
    assert read_left_out(tmp_path / "other") == []
    # Not the run's own cluster (run.preflight_leave_out off): the verdict ends the run, no node is touched
    with pytest.raises(PreflightFailed, match="^preflight: slow"):
        fail("preflight: slow node(s): 10.0.0.5", {"abc": "10.0.0.5"}, PreflightConfig(5, str(tmp_path / "x")))
    assert read_left_out(tmp_path / "x") == []


def test_nodes_are_labelled_by_address_and_told_apart_when_they_share_one():
    assert node_labels(["n1", "n1", "n2"], ["10.0.0.1", "10.0.0.1", "10.0.0.2"]) == {
        0: "10.0.0.1", 1: "10.0.0.1", 2: "10.0.0.2"}
    assert node_labels(["n1", "n2"], ["127.0.0.1", "127.0.0.1"]) == {0: "127.0.0.1#0", 1: "127.0.0.1#1"}
