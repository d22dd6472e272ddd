"""Config composition and validation: every bad input is one ConfigError naming the key."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pipelines.config import ConfigError, flatten, load_config
from tests.conftest import ROOT


@pytest.fixture()
def data_override(tiny_mnist) -> str:
    return f"data.path={tiny_mnist}"


def test_defaults_compose_and_flatten(data_override):
    cfg = load_config([data_override, "model=cnn", "trainer.epochs=3"])
    assert cfg.model.name == "cnn" and cfg.trainer.epochs == 3 and cfg.trainer.backend == "ddp"
    flat = flatten(cfg)
    assert flat["trainer.epochs"] == 3 and flat["model.channels"] == [32, 64]


@pytest.mark.parametrize("override, message", [
    ("+trainer.bogus=1", r"^trainer\.bogus: Key 'bogus' not in 'TrainerConfig'"),
    ("trainer.batch_size=abc", r"^trainer\.batch_size: Value 'abc'.* could not be converted to Integer"),
    ("trainer.lr=-0.1", r"^trainer\.lr: must be > 0"),
    ("trainer.num_workers=0", r"^trainer\.num_workers: must be > 0"),
    ("trainer.backend=nope", r"^trainer\.backend: unknown backend 'nope'"),
    ("trainer=nope", r"^overrides: .*trainer.*nope"),
    ("model.name=resnet", r"^model\.name: unknown model 'resnet'"),
    ("data.path=/does/not/exist", r"^data\.path: no prepared dataset at '/does/not/exist'"),
    ("fault.max_failures=-1", r"^fault\.max_failures: must be >= 0"),
])
def test_bad_config_names_the_key(data_override, override, message):
    with pytest.raises(ConfigError, match=message):
        load_config([data_override, override])


def test_cli_exits_2_with_one_line_before_touching_ray_or_mlflow(tmp_path, data_override):
    env_uri = f"sqlite:///{tmp_path}/never.db"
    proc = subprocess.run([sys.executable, "-m", "pipelines.train", data_override, "+trainer.bogus=1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"MLFLOW_TRACKING_URI": env_uri, "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "trainer.bogus" in proc.stderr
    assert not (tmp_path / "never.db").exists()  # MLflow was never touched


def test_unreachable_mlflow_is_a_clear_error_before_ray(tmp_path, data_override):
    from tests.conftest import free_port

    proc = subprocess.run([sys.executable, "-m", "pipelines.train", data_override],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    assert "is unreachable" in proc.stderr and "mlflow_run_id" not in proc.stdout
