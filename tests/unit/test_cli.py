"""The installed package and its one command line, `rtp` (pipelines/cli.py), run as a user runs it: the console
script of the suite's environment (`pip install -e .` by cluster/local/setup-env.sh), from a directory outside the
checkout. What answers at once imports no framework and no Ray; a backend whose framework is missing is one line
naming the extra; a ddp run needs no TensorFlow or Horovod. Both are made real in a child process whose imports of
the named packages fail: "forbidden" (installed, but importing one fails) or "blocked" (as if not installed),
tests/support/blocked_imports."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from contract.config import DataConfig, FaultConfig, PluginsConfig, RunSection
from contract.registry import BACKENDS, MODELS
from pipelines.config import group_choices
from pipelines.help import field_docs
from tests.conftest import ROOT, VENV_BIN

BLOCKER = ROOT / "tests" / "support" / "blocked_imports"
FRAMEWORKS_AND_RAY = "torch,tensorflow,tf_keras,keras,horovod,ray"


def rtp(args: list[str], cwd: Path, forbidden: str = "", blocked: str = "") -> subprocess.CompletedProcess:
    env = {"PATH": f"{VENV_BIN}:/usr/bin:/bin", "HOME": str(cwd), "RTP_FORBIDDEN_IMPORTS": forbidden,
           "RTP_BLOCKED_IMPORTS": blocked, "PYTHONPATH": str(BLOCKER)}
    return subprocess.run([str(VENV_BIN / "rtp"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_help_and_list_answer_from_anywhere_without_a_framework_or_ray(tmp_path):
    top = rtp(["--help"], tmp_path, FRAMEWORKS_AND_RAY)
    assert top.returncode == 0, top.stderr
    for command in ("prepare", "train", "sweep", "evaluate", "predict", "replay", "list", "config"):
        assert f"\n  {command} " in top.stdout

    listed = rtp(["list"], tmp_path, FRAMEWORKS_AND_RAY)
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line for line in listed.stdout.splitlines() if line.startswith("  ")}
    for group in ("trainer", "model", "data", "sweep"):
        for name in group_choices(group):
            assert len(rows[name].split()) > 1, name  # each with what it is
    assert "not installed" not in listed.stdout
    without_tf = rtp(["list"], tmp_path, blocked="tensorflow")
    assert "pip install 'ray-train-pipelines[tf]'" in without_tf.stdout.split("\n  tf_mwms ")[1].splitlines()[0]
    assert rtp(["list", "--help"], tmp_path).stdout.startswith("usage: rtp list [plugins=[your.module,...]]")
    stray = rtp(["list", "models"], tmp_path)
    assert stray.returncode == 2 and stray.stderr == "error: rtp list: takes plugins=[...] only, got models\n"


@pytest.mark.parametrize("command", ["train", "config"])
def test_train_help_shows_the_groups_and_every_key_of_the_chosen_ones(tmp_path, command):
    out = rtp([command, "trainer=fsdp", "--help"], tmp_path, FRAMEWORKS_AND_RAY)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith(f"usage: rtp {command} ")
    for group in ("trainer", "data", "model"):
        assert all(name in text for name in group_choices(group))
    for key in ("trainer.dp_replicate", "trainer.pp_schedule", "data.path", "model.hidden", "run.monitor",
                "fault.max_failures"):
        line = next(line for line in text.splitlines() if line.startswith(f"  {key} "))
        assert len(line.split()) >= 3, line  # key, default, what it means
    assert "trainer.tf_loop" not in text  # another backend's key
    assert "exit codes: 0 " in text and "examples:" in text


def test_every_key_of_every_schema_says_what_it_is():
    schemas = [*(spec.config for spec in BACKENDS.specs.values()), *(spec.config for spec in MODELS.specs.values()),
               DataConfig, RunSection, FaultConfig, PluginsConfig]
    undocumented = [f"{schema.__name__}.{key}" for schema in schemas for key, doc in field_docs(schema).items()
                    if not doc]
    assert undocumented == []
    assert set(field_docs(BACKENDS.get("tp").config)) >= {"lr", "tp", "tp_impl"}  # inherited keys too


def test_every_run_and_fault_key_can_be_overridden():
    """conf/config.yaml spells out the `run` and `fault` sections (Hydra overrides only keys it holds): each key of
    their schemas is there, or `run.<key>=...` would be refused as unknown."""
    from pipelines.config import compose

    raw = compose([])
    assert set(raw.run) == set(field_docs(RunSection)) and set(raw.fault) == set(field_docs(FaultConfig))


def test_config_prints_the_validated_config_or_one_line(tmp_path, tiny_mnist):
    valid = rtp(["config", "trainer=fsdp", "model=cnn", f"data.path={tiny_mnist}"], tmp_path, FRAMEWORKS_AND_RAY)
    assert valid.returncode == 0, valid.stderr
    assert "backend: fsdp" in valid.stdout and f"path: {tiny_mnist}" in valid.stdout
    invalid = rtp(["config", "trainer=tp", "trainer.tp=3"], tmp_path, FRAMEWORKS_AND_RAY)
    assert invalid.returncode == 2
    assert invalid.stderr.splitlines() == ["error: trainer.tp: tp=3 does not divide num_workers=2"]
    unknown = rtp(["config", "trainer=nope"], tmp_path)
    assert unknown.returncode == 2 and unknown.stderr.strip() == (
        f"error: trainer: unknown choice 'nope' (choices: {', '.join(group_choices('trainer'))})")


def test_a_backend_without_its_framework_is_one_line_naming_the_extra(tmp_path, tiny_mnist):
    out = rtp(["train", "trainer=tf_mwms", f"data.path={tiny_mnist}"], tmp_path, blocked="tensorflow")
    assert out.returncode == 2
    assert out.stderr.splitlines() == ["error: trainer.backend: tf_mwms needs tensorflow, not installed in this "
                                       "environment: pip install 'ray-train-pipelines[tf]'"]


# Validation, then a ddp worker on the shared loop (2 epochs of generated MNIST, in this process: the modules a Ray
# Train worker of trainer=ddp imports, and the driver's), TensorFlow, tf-keras and Horovod forbidden.
DDP_WITHOUT_TF = """
import sys, tempfile
from pathlib import Path
import torch
import pipelines.train, pipelines.fit, trainers.worker, trainers.torch.process_group
from pipelines.data.mnist import mnist_schema
from pipelines.config import load_config
from tests.support.loop_harness import mnist_columns, run_attempt
from trainers.adapter import WorkerData
from trainers.torch.data import ShardBatches
from trainers.torch.ddp import DDP

cfg = load_config([f"data.path={sys.argv[1]}", "trainer=ddp", "model.hidden=[16]", "trainer.epochs=2"])
columns = {k: torch.from_numpy(v) for k, v in mnist_columns(64).items()}
data = WorkerData(mnist_schema(), lambda seed: (ShardBatches.from_columns(columns, mnist_schema(), 16, seed),
                                                ShardBatches.from_columns(columns, mnist_schema(), 32, seed)))
attempt = run_attempt(lambda ctx: DDP().run_worker(cfg, ctx, data), 0, 1, 2, Path(tempfile.mkdtemp()))
print(attempt.finished, sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "tf_keras", "horovod")))
"""


def test_a_ddp_run_needs_no_tensorflow_or_horovod(tiny_mnist):
    env = {"PATH": f"{VENV_BIN}:/usr/bin:/bin", "RTP_FORBIDDEN_IMPORTS": "tensorflow,tf_keras,keras,horovod",
           "PYTHONPATH": f"{BLOCKER}:{ROOT}", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", DDP_WITHOUT_TF, str(tiny_mnist)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "True []"


def test_neither_the_base_install_nor_the_torch_extra_pulls_tensorflow_or_horovod():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {req.split("[")[0].split("=")[0].strip().lower().replace("-", "_") for req in requirements}
    base, torch_extra = names(project["dependencies"]), names(project["optional-dependencies"]["torch"])
    assert not (base | torch_extra) & {"tensorflow", "tf_keras", "keras", "horovod"}
    assert "torch" not in base and torch_extra == {"torch"}
    assert project["scripts"]["rtp"] == "pipelines.cli:main"
