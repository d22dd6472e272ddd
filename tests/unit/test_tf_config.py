"""Config validation of the TensorFlow backend: bad values fail before launch, naming the key."""
from __future__ import annotations

import pytest

from pipelines.config import ConfigError, load_config


@pytest.fixture()
def data_override(tiny_mnist) -> str:
    return f"data.path={tiny_mnist}"


def test_tf_mwms_defaults(data_override):
    cfg = load_config([data_override, "trainer=tf_mwms"])
    assert cfg.trainer.backend == "tf_mwms" and cfg.trainer.tf_loop == "fit"
    assert cfg.trainer.tf_communication == "auto"
    assert load_config([data_override, "trainer=tf_mwms", "trainer.tf_loop=custom"]).trainer.tf_loop == "custom"


@pytest.mark.parametrize("overrides, message", [
    (["trainer.tf_loop=eager"], r"^trainer\.tf_loop: unknown 'eager'"),
    (["trainer.tf_communication=mpi"], r"^trainer\.tf_communication: unknown 'mpi'"),
    (["trainer.tf_communication=nccl"], r"^trainer\.tf_communication: nccl needs GPUs"),
    (["trainer.tf_communication=nccl", "trainer.use_gpu=false"], r"^trainer\.tf_communication: nccl needs GPUs"),
    (["model=bert_tiny"], r"^model\.name: "),
    (["+trainer.bogus=1"], r"^trainer\.bogus: "),
    (["trainer.tf_devices=0"], r"^trainer\.tf_devices: must be > 0"),
    (["trainer.tf_devices=2", "trainer.num_workers=2"], r"^trainer\.tf_devices: several CPU replicas per worker"),
])
def test_bad_tf_config_names_the_key(data_override, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config([data_override, "trainer=tf_mwms", *overrides])


def test_nccl_with_gpu_passes_validation(data_override):
    cfg = load_config([data_override, "trainer=tf_mwms", "trainer.tf_communication=nccl", "trainer.use_gpu=true"])
    assert cfg.trainer.tf_communication == "nccl"


def test_tf_devices_is_tf_only_and_fine_with_one_worker(data_override):
    cfg = load_config([data_override, "trainer=tf_mwms", "trainer.tf_devices=2", "trainer.num_workers=1"])
    assert cfg.trainer.tf_devices == 2
    with pytest.raises(ConfigError, match=r"^trainer\.tf_devices: Key 'tf_devices' not in 'DDPConfig'"):
        load_config([data_override, "trainer=ddp", "+trainer.tf_devices=2"])
