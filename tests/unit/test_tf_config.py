"""Config validation of the TensorFlow backend: bad values fail before launch, naming the key. And tf_ps's
`fault.kill_servers` hook for the chief (its server kills run end to end in tests/integration/test_tf_ps.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from pipelines.config import ConfigError, load_config
from trainers.tf.ps.cluster import Chief, KillServers


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
    (["trainer.devices_per_worker=0"], r"^trainer\.devices_per_worker: must be > 0"),
    (["trainer.devices_per_worker=2", "trainer.num_workers=2"],
     r"^trainer\.devices_per_worker: several CPU replicas per worker"),
    (["trainer.tf_strategy=parameter_server"], r"^trainer\.tf_strategy: unknown 'parameter_server'"),
    (["trainer.tf_strategy=central_storage", "trainer.num_workers=2"], r"^trainer\.tf_strategy: central_storage "
                                                                        r"keeps the variables on one machine"),
    (["trainer.tf_strategy=central_storage", "trainer.num_workers=1", "trainer.grad_accum=2"],
     r"^trainer\.grad_accum: under CentralStorageStrategy our accumulators become one variable"),
    (["trainer.tf_strategy=central_storage", "trainer.num_workers=1", "trainer.lr_schedule=cosine"],
     r"^trainer\.lr_schedule: tf-keras 2\.21 fails to update a learning-rate schedule under CentralStorageStrategy"),
    (["trainer.tf_strategy=central_storage", "trainer.num_workers=1", "trainer.warmup_steps=2"],
     r"^trainer\.lr_schedule: tf-keras 2\.21 fails"),
    (["trainer.tf_cross_device_ops=ring"], r"^trainer\.tf_cross_device_ops: unknown 'ring'"),
    (["trainer.tf_cross_device_ops=reduce_to_one"], r"^trainer\.tf_cross_device_ops: how MirroredStrategy sums"),
    (["trainer.tf_cross_device_ops=reduce_to_one", "trainer.num_workers=1", "trainer.devices_per_worker=2",
      "trainer.tf_strategy=central_storage"], r"^trainer\.tf_cross_device_ops: how MirroredStrategy sums"),
    (["trainer.tf_cross_device_ops=nccl", "trainer.num_workers=1", "trainer.devices_per_worker=2"],
     r"^trainer\.tf_cross_device_ops: nccl needs GPUs"),
])
def test_bad_tf_config_names_the_key(data_override, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config([data_override, "trainer=tf_mwms", *overrides])


def test_nccl_with_gpu_passes_validation(data_override):
    cfg = load_config([data_override, "trainer=tf_mwms", "trainer.tf_communication=nccl", "trainer.use_gpu=true"])
    assert cfg.trainer.tf_communication == "nccl"
    cfg = load_config([data_override, "trainer=tf_mwms", "trainer.tf_cross_device_ops=nccl", "trainer.use_gpu=true",
                       "trainer.num_workers=1", "trainer.devices_per_worker=2"])
    assert (cfg.trainer.tf_cross_device_ops, cfg.trainer.tf_strategy) == ("nccl", "mirrored")


def test_devices_per_worker_is_tf_only_and_fine_with_one_worker(data_override):
    cfg = load_config([data_override, "trainer=tf_mwms", "trainer.devices_per_worker=2", "trainer.num_workers=1"])
    assert cfg.trainer.devices_per_worker == 2
    with pytest.raises(ConfigError, match=r"^trainer\.devices_per_worker: not a key of this config \(a key of "
                                          r"trainer=tf_dtensor, tf_mwms\)"):
        load_config([data_override, "trainer=ddp", "+trainer.devices_per_worker=2"])
    for renamed in ("trainer.tf_devices=2", "+trainer.tf_devices=2"):  # its name before it was shared with tf_dtensor
        with pytest.raises(ConfigError, match=r"^trainer\.tf_devices: renamed trainer\.devices_per_worker$"):
            load_config([data_override, "trainer=tf_mwms", renamed])


def test_tf_ps_defaults_and_resources(data_override):
    """tf_ps: the chief and the parameter servers are Ray Train workers too, sharing the workers' CPUs."""
    from contract.config import layout_of, worker_resources

    cfg = load_config([data_override, "trainer=tf_ps", "trainer.num_ps=2", "trainer.num_workers=3"])
    assert (cfg.trainer.tf_loop, cfg.trainer.num_ps) == ("custom", 2)
    assert layout_of(cfg.trainer).ray_workers == 6 and worker_resources(cfg.trainer) == (3, 0)
    cfg = load_config([data_override, "trainer=tf_mwms", "trainer.num_workers=3"])
    assert layout_of(cfg.trainer).ray_workers == 3


@pytest.mark.parametrize("overrides, message", [
    (["trainer.num_ps=0"], r"^trainer\.num_ps: must be > 0"),
    (["trainer.ps_min_shard_bytes=0"], r"^trainer\.ps_min_shard_bytes: must be > 0"),
    (["trainer.tf_loop=eager"], r"^trainer\.tf_loop: unknown 'eager'"),
    (["model=cnn", "model.channels=[8]"], r"^model\.channels: "),
    (["trainer.tf_loop=fit", "trainer.log_every_n_steps=5"], r"^trainer\.log_every_n_steps: Keras fit under "
                                                               r"ParameterServerStrategy calls no batch-level"),
    (["trainer.tf_loop=fit", "run.progress=on"], r"^run\.progress: Keras fit under ParameterServerStrategy"),
    (["trainer.use_gpu=true"], r"^trainer\.use_gpu: tf_ps runs on CPUs"),
    (["trainer.grad_accum=2"], r"^trainer\.grad_accum: tf_ps trains with grad_accum=1 and precision=fp32 only"),
    (["trainer.precision=bf16"], r"^trainer\.precision: tf_ps trains with grad_accum=1"),
    (["trainer.compile=true"], r"^trainer\.compile: torch\.compile is for the PyTorch backends"),
    (["+trainer.tp=2"], r"^trainer\.tp: "),
    (["fault.kill_servers=[worker:2@1]", "fault.inject_marker=/tmp/m"],
     r"^fault\.kill_servers: expected worker:<i>@<epoch> \(i < 2\), ps:<i>@<epoch> \(i < 1\) or chief:0@<epoch>, "
     r"epoch 1\.\.5; got 'worker:2@1'"),
    (["fault.kill_servers=[chief:1@1]", "fault.inject_marker=/tmp/m"], r"^fault\.kill_servers: expected worker:"),
    (["fault.kill_servers=[evaluator:0@1]", "fault.inject_marker=/tmp/m"], r"^fault\.kill_servers: expected worker:"),
    (["fault.kill_servers=[ps:0@6]", "fault.inject_marker=/tmp/m"], r"^fault\.kill_servers: expected worker:"),
    (["fault.kill_servers=[ps:0@1]"], r"^fault\.kill_servers: needs fault\.inject_marker"),
    (["fault.kill_servers=[worker:1@2,worker:1@3]", "fault.inject_marker=/tmp/m"],
     r"^fault\.kill_servers: each server \(or the chief\) at most once"),
    (["fault.kill_servers=[ps:0@1]", "fault.inject_marker=/tmp/m", "fault.inject_at_epoch=1"],
     r"^fault\.kill_servers: needs fault\.inject_marker \(which kills fired\) and no fault\.inject_at_epoch"),
    (["fault.kill_servers=[ps:0@1]", "fault.inject_marker=/tmp/m", "trainer.tf_loop=fit"],
     r"^fault\.kill_servers: fires halfway through an epoch, which Keras fit under ParameterServerStrategy has no "
     r"hook for"),
])
def test_bad_tf_ps_config_names_the_key(data_override, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config([data_override, "trainer=tf_ps", *overrides])


def test_tf_ps_needs_a_keras_model_and_the_custom_loop_for_tokens(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")  # the layout of the dataset the config names: IMDb's tokens
    imdb = ["data=imdb", f"data.path={tmp_path}", "trainer=tf_ps"]
    with pytest.raises(ConfigError, match=r"^model\.name: trainer=tf_ps builds the model with a Keras builder "
                                          r"\(keras=\); model 'bert' has none \(it has: torch\)$"):
        load_config([*imdb, "model=bert_tiny"])
    with pytest.raises(ConfigError, match=r"^trainer\.tf_loop: tf_ps trains token data with the custom loop only"):
        load_config([*imdb, "model=embed_pool", "trainer.tf_loop=fit"])


def test_kill_servers_is_tf_ps_only(data_override):
    with pytest.raises(ConfigError, match=r"^fault\.kill_servers: only trainer=tf_ps runs servers to kill"):
        load_config([data_override, "trainer=tf_mwms", "fault.kill_servers=[worker:0@1]",
                     "fault.inject_marker=/tmp/m"])
    cfg = load_config([data_override, "trainer=tf_ps", "fault.kill_servers=[worker:1@2,ps:0@3,chief:0@4]",
                       "fault.inject_marker=/tmp/m"])
    assert list(cfg.fault.kill_servers) == ["worker:1@2", "ps:0@3", "chief:0@4"]


def test_a_killed_chief_fails_its_epoch_once(tmp_path):
    """`chief:0@2`: halfway through epoch 2 the chief's loop raises (Ray Train then restarts the run, as after any
    failure) and the marker records it, so the restarted attempt trains epoch 2 through; an epoch resumed past its
    middle kills nothing."""
    marker = tmp_path / "killed"
    kill = KillServers(OmegaConf.create({"kill_servers": ["chief:0@2"], "inject_marker": str(marker)}),
                       Chief(messages=None))
    kill.on_start(SimpleNamespace(adapter=SimpleNamespace(steps_per_epoch=lambda: 4)))

    def epoch(number: int, done: int = 0) -> None:  # the loop's hooks over an epoch of 4 steps, `done` trained
        kill.on_epoch_start(number, done)
        for step in range(done + 1, 5):
            kill.on_step_start(number, (number - 1) * 4 + step)

    epoch(1)
    assert not marker.exists()
    epoch(2, done=3)  # resumed past its middle
    assert not marker.exists()
    with pytest.raises(RuntimeError, match=r"^tf_ps: the chief fails halfway through epoch 2 \(fault.kill_servers\)$"):
        epoch(2)
    assert marker.read_text().split() == ["chief:0@2"]
    epoch(2)  # the restarted attempt: fired already
    assert marker.read_text().split() == ["chief:0@2"]
