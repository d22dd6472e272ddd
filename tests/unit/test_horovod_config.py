"""Horovod backend without a cluster: config validation, and the rank plan the rendezvous server is given."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pipelines.config import ConfigError, load_config
from tests.conftest import ROOT


@pytest.fixture()
def data_override(tiny_mnist) -> str:
    return f"data.path={tiny_mnist}"


def test_horovod_is_installed():
    """Not a skip: CI builds horovod (tests/run.sh -> cluster/local/build-horovod.sh); without it every
    horovod test must fail, and this one says why."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        assert version("horovod") == "0.28.1"
    except PackageNotFoundError:
        pytest.fail("horovod is not installed: run `bash cluster/local/build-horovod.sh`")


def test_horovod_defaults_and_options(data_override):
    cfg = load_config([data_override, "trainer=horovod"])
    assert (cfg.trainer.backend, cfg.trainer.framework, cfg.trainer.compression) == ("horovod", "torch", "none")
    assert cfg.trainer.grad_accum == 1 and cfg.trainer.num_workers == 2
    cfg = load_config([data_override, "trainer=horovod", "trainer.framework=tf", "trainer.compression=fp16",
                       "trainer.grad_accum=4", "model=cnn"])
    assert (cfg.trainer.framework, cfg.trainer.compression, cfg.trainer.grad_accum) == ("tf", "fp16", 4)


@pytest.mark.parametrize("overrides, message", [
    (["trainer=horovod", "trainer.framework=jax"], r"^trainer\.framework: unknown 'jax'"),
    (["trainer=horovod", "trainer.compression=int8"], r"^trainer\.compression: unknown 'int8'"),
    (["trainer=horovod", "trainer.grad_accum=0"], r"^trainer\.grad_accum: must be > 0"),
    (["trainer=horovod", "trainer.use_gpu=true"], r"^trainer\.use_gpu: our horovod build has Gloo CPU"),
    (["trainer=horovod", "trainer.tp=2"], r"^trainer\.tp: not a key of this config"),
    (["trainer=ddp", "+trainer.compression=fp16"],
     r"^trainer\.compression: not a key of this config \(a key of trainer=horovod\)"),
    (["trainer=tf_mwms", "+trainer.compression=fp16"],
     r"^trainer\.compression: not a key of this config \(a key of trainer=horovod\)"),
])
def test_bad_horovod_config_names_the_key(data_override, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config([data_override, *overrides])


def test_tf_framework_needs_a_keras_model(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")  # config checks only that a prepared dataset is there
    with pytest.raises(ConfigError, match=r"^model\.name: trainer=horovod builds the model with a Keras builder "
                                          r"\(keras=\); model 'bert' has none \(it has: torch\)$"):
        load_config(["data=imdb", f"data.path={tmp_path}", "model=bert_tiny", "trainer=horovod",
                     "trainer.framework=tf"])


def test_missing_horovod_is_a_config_error_naming_the_build_script(tmp_path, data_override):
    """Simulated by hiding the package from the import system (a `horovod` path entry that finds nothing would
    not do: find_spec must return None), in a subprocess so this process keeps its horovod."""
    code = ("import sys, importlib.machinery as m\n"
            "class Hide(m.PathFinder):\n"
            "    @classmethod\n"
            "    def find_spec(cls, name, path=None, target=None):\n"
            "        return None if name == 'horovod' else super().find_spec(name, path, target)\n"
            "sys.meta_path[:] = [f for f in sys.meta_path if f is not m.PathFinder] + [Hide]\n"
            "from pipelines.config import ConfigError, load_config\n"
            "try:\n"
            f"    load_config([{data_override!r}, 'trainer=horovod'])\n"
            "except ConfigError as err:\n"
            "    print(err)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == ("trainer.backend: horovod is not installed; build it with "
                                   "`bash cluster/local/build-horovod.sh`"), proc.stdout + proc.stderr[-2000:]


def test_slot_plan_one_node():
    from trainers.horovod.rendezvous import slot_plan

    plan = slot_plan(["a", "a"])
    assert [(s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size, s.size) for s in plan] == [
        (0, 0, 2, 0, 1, 2), (1, 1, 2, 0, 1, 2)]


def test_slot_plan_keeps_ray_ranks_when_nodes_interleave():
    """Ray rank order is kept (hvd.rank() == Ray's world rank); local ranks count within a node, cross ranks
    count nodes among the workers with the same local rank; sizes are per node / per local rank."""
    from trainers.horovod.rendezvous import slot_plan

    plan = slot_plan(["n1", "n2", "n1", "n3"])
    got = [(s.hostname, s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in plan]
    assert got == [("n1", 0, 0, 2, 0, 3), ("n2", 1, 0, 1, 1, 3), ("n1", 2, 1, 2, 0, 1), ("n3", 3, 0, 1, 2, 3)]


def test_slot_plan_matches_horovods_own_assignment_for_grouped_nodes():
    """When Ray's ranks are grouped by node (what Train V2 does), the plan is exactly Horovod's
    `get_host_assignments` for the same hosts, i.e. what horovodrun would compute."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

    from trainers.horovod.rendezvous import slot_plan

    nodes = ["x", "x", "x", "y", "y", "z"]
    assert slot_plan(nodes) == get_host_assignments(parse_hosts("x:3,y:2,z:1"), len(nodes))


def test_gloo_interface_choice():
    """Explicit nics win; one node -> loopback (horovodrun's choice for local hosts); several nodes -> the
    interface holding the node IP (checked here through `interface_of`, which that branch calls)."""
    from trainers.horovod.rendezvous import gloo_iface, interface_of

    assert gloo_iface(("eth7",), one_node=True) == "eth7"
    assert gloo_iface(None, one_node=True) == "lo"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("127.0.0.3") == "lo"  # in lo's 127.0.0.0/8 without being assigned (local Slurm nodes)
    with pytest.raises(RuntimeError, match="no local network interface has the Ray node IP 203.0.113.9"):
        interface_of("203.0.113.9")
