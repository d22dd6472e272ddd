"""Config composition and validation: every bad input is one ConfigError naming the key."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
import sys

import pytest

from omegaconf import OmegaConf

from pipelines.config import ConfigError, flatten, group_choices, load_config
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
    ("+trainer.bogus=1", r"^trainer\.bogus: not a key of this config \(each backend"),
    ("trainer.bogus=1", r"^trainer\.bogus: not a key of this config \(each backend"),
    ("trainer.epoch=3", r"^trainer\.epoch: not a key of this config \(did you mean trainer\.epochs\?\)"),
    ("trainer.tp=2", r"^trainer\.tp: not a key of this config \(a key of trainer=fsdp, tp\) \(each backend"),
    ("model.heads=2", r"^model\.heads: not a key of this config \(a key of model=bert\)"),
    ("trainer.batch_size=abc", r"^trainer\.batch_size: Value 'abc'.* could not be converted to Integer"),
    ("trainer.lr=-0.1", r"^trainer\.lr: must be > 0"),
    ("trainer.lr=inf", r"^trainer\.lr: must be a finite number, got inf"),
    ("trainer.grad_clip=nan", r"^trainer\.grad_clip: must be a finite number, got nan"),
    ("run.name=my run", r"^overrides: cannot read 'run': every argument is KEY=VALUE; quote"),
    ("run.name=café", r"^overrides: cannot read 'run\.name=café': every argument is KEY=VALUE; quote"),
    ("trainer.num_workers=0", r"^trainer\.num_workers: must be > 0"),
    ("trainer.backend=nope", r"^trainer\.backend: unknown backend 'nope'"),
    ("trainer.placement_strategy=ANYWHERE", r"^trainer\.placement_strategy: unknown strategy 'ANYWHERE'"),
    ("trainer=nope", r"^trainer: unknown choice .nope. \(choices: ddp, deepspeed, fsdp, horovod, lightning, "
                     r"tf_dtensor, tf_mwms, tf_ps, tp\)$"),
    ("model.name=resnet", r"^model\.name: unknown model 'resnet'"),
    ("data.path=/does/not/exist", r"^data\.path: no prepared dataset at '/does/not/exist'"),
    ("fault.max_failures=-1", r"^fault\.max_failures: must be >= 0"),
    ("run.system_metrics_interval_s=0.5", r"^run\.system_metrics_interval_s: must be >= 1"),
    # the recipe (contract/recipe.py); tiny_mnist: 512 rows per worker, 4 batches of 128 x 5 epochs = 20 updates
    ("trainer.optimizer=lamb", r"^trainer\.optimizer: unknown 'lamb' \(choices: adam, adamw, sgd\)"),
    ("trainer.lr_schedule=step", r"^trainer\.lr_schedule: unknown 'step'"),
    ("trainer.precision=fp8", r"^trainer\.precision: unknown 'fp8'"),
    ("trainer.precision=fp16", r"^trainer\.precision: fp16 needs GPUs"),
    ("trainer.grad_accum=0", r"^trainer\.grad_accum: must be > 0"),
    ("trainer.grad_clip=0", r"^trainer\.grad_clip: must be > 0"),
    ("trainer.weight_decay=0.1", r"^trainer\.weight_decay: only adamw decays weights"),
    ("trainer.warmup_steps=20", r"^trainer\.warmup_steps: 20 warmup steps is not shorter than the run \(20 optimizer"),
    ("trainer.warmup_fraction=1.0", r"^trainer\.warmup_fraction: must be in \[0, 1\)"),
    ("run.monitor=accuracy", r"^run\.monitor: unknown 'accuracy' \(choices: train_loss, test_accuracy"),
    ("run.final_model=first", r"^run\.final_model: unknown 'first'"),
    ("run.progress=yes", r"^run\.progress: unknown 'yes'"),
    ("run.register_model=team/mnist", r"^run\.register_model: 'team/mnist' is not a model name MLflow accepts"),
    ("run.patience=0", r"^run\.patience: must be >= 1"),
    ("data.cache_in_worker=sometimes", r"^data\.cache_in_worker: must be true, false or auto, got 'sometimes'"),
    ("data.shuffle_buffer=0", r"^data\.shuffle_buffer: must be >= 1"),
    ("run.checkpoint_every_n_steps=-1", r"^run\.checkpoint_every_n_steps: must be >= 0"),
    ("run.keep_checkpoints=0", r"^run\.keep_checkpoints: must be >= 1"),
    ("trainer=tf_mwms run.checkpoint_every_s=600", r"^run\.checkpoint_every_s: Keras fit checkpoints at epoch ends "
                                                  r"only; use trainer\.tf_loop=custom"),
    ("fault.inject_at_step=3", r"^fault\.inject_at_step: needs fault\.inject_marker"),
    ("trainer.profile_steps=-1", r"^trainer\.profile_steps: must be >= 0"),
    ("trainer=tf_mwms trainer.compile=true", r"^trainer\.compile: torch\.compile is for the PyTorch backends"),
    ("trainer=lightning trainer.strategy=fsdp", r"^trainer\.strategy: Lightning's fsdp strategy runs on GPUs only"),
    ("trainer=lightning trainer.strategy=deepspeed", r"^trainer\.strategy: unknown 'deepspeed' \(choices: ddp, fsdp\)"),
    ("trainer=lightning trainer.compile=true", r"^trainer\.compile: not supported with lightning"),
    ("trainer=lightning trainer.strategy=fsdp trainer.use_gpu=true trainer.grad_clip=1.0",
     r"^trainer\.grad_clip: Lightning's fsdp strategy does not clip by the global norm"),
    ("trainer=deepspeed trainer.zero_stage=4", r"^trainer\.zero_stage: must be one of \(1, 2, 3\), got 4"),
    ("trainer=deepspeed trainer.deepspeed_config=/no/ds.json",
     r"^trainer\.deepspeed_config: cannot read '/no/ds\.json'"),
    ("run.resume_from=/no/checkpoint", r"^run\.resume_from: no checkpoint at '/no/checkpoint' \(missing train_state"),
    ("data.bucket_by_length=true", r"^data\.bucket_by_length: only token data has lengths to group by; 'mnist'"),
    ("data.augment=true", r"^data\.augment: model 'mlp' has no augmentation \(a model spec's `augment`; models with "
                          r"one: cnn\)$"),
    ("trainer=tf_ps model=cnn data.augment=true", r"^data\.augment: tf_ps feeds its workers from its own input "
                                                  r"pipeline, which applies no augmentation"),
    ("trainer=tf_dtensor data.cache_in_worker=false", r"^data\.cache_in_worker: tf_dtensor holds each worker's part "
                                                      r"of the data in memory and cannot stream it; set "
                                                      r"data\.cache_in_worker=true"),
    ("trainer=tf_ps data.cache_max_bytes=1000", r"^data\.cache_in_worker: tf_ps holds each worker's part"),
    ("trainer.min_workers=2", r"^trainer\.min_workers: must be between 1 and num_workers - 1 = 1 \(0: not elastic\), "
                              r"got 2$"),
    ("trainer=tp model=bert_tiny trainer.min_workers=1",
     r"^trainer\.min_workers: trainer=tp keeps the number of workers it starts with .*; elastic runs: ddp, deepspeed, "
     r"fsdp, horovod, lightning$"),
    ("trainer=horovod trainer.framework=tf trainer.min_workers=1",
     r"^trainer\.min_workers: an elastic horovod run takes trainer\.framework=torch; the TensorFlow binding keeps "),
    ("trainer.num_workers=4 trainer.batch_size=5 trainer.min_workers=2", r"^trainer\.min_workers: the global batch "
                                                                         r"of 20 rows .* over 3 worker\(s\)"),
    ("trainer.min_workers=1 data.cache_in_worker=true", r"^data\.cache_in_worker: an elastic run streams its data"),
    ("trainer=fsdp trainer.num_workers=4 trainer.batch_size=6 trainer.dp_replicate=2 trainer.min_workers=2",
     r"^trainer\.min_workers: an elastic fsdp run shards the model over all its workers"),
    ("trainer=deepspeed trainer.optimizer=sgd trainer.min_workers=1",
     r"^trainer\.min_workers: an elastic deepspeed run resumes at another size through DeepSpeed's universal "
     r"checkpoint, which converts Adam's states only; trainer\.optimizer=sgd cannot resize"),
])
def test_bad_config_names_the_key(data_override, override, message):
    with pytest.raises(ConfigError, match=message):
        load_config([data_override, *override.split()])


@pytest.mark.parametrize("theirs, message", [
    ({"train_micro_batch_size_per_gpu": 64}, r"train_micro_batch_size_per_gpu=64 disagrees with trainer\.batch_size "
                                             r"\(train_micro_batch_size_per_gpu=128 here\)"),
    ({"zero_optimization": {"stage": 1}}, r"zero_optimization\.stage=1 disagrees with trainer\.zero_stage"),
    ({"gradient_clipping": 1.0}, r"gradient_clipping=1\.0 disagrees with trainer\.grad_clip"),
    ({"train_batch_size": 100}, r"train_batch_size=100 disagrees with trainer\.batch_size x grad_accum x num_workers "
                                r"\(train_batch_size=256 here\)"),
    ({"optimizer": {"type": "Adam"}}, r"its 'optimizer' section is the recipe's here"),
    ({"bf16": {"enabled": True}}, r"'bf16\.enabled' is trainer\.precision here"),
    ({"torch_autocast": {"enabled": True}},
     r"its 'torch_autocast' section is the recipe's here \(trainer\.precision\)"),
    ([1, 2], r"must hold a JSON object"),
])
def test_a_users_deepspeed_json_that_contradicts_the_recipe_is_one_line(tmp_path, data_override, theirs, message):
    """A DeepSpeed JSON of the user's own goes under the recipe's keys: what it says of them must agree."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(theirs))
    with pytest.raises(ConfigError, match=rf"^trainer\.deepspeed_config: .*{message}"):
        load_config([data_override, "trainer=deepspeed", f"trainer.deepspeed_config={path}"])


def test_a_users_deepspeed_json_keeps_its_own_keys_under_the_recipes(tmp_path, data_override):
    from trainers.torch.deepspeed_config import engine_config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                                "wall_clock_breakdown": False, "gradient_clipping": 0.5}))
    cfg = load_config([data_override, "trainer=deepspeed", "trainer.zero_stage=3", "trainer.grad_clip=0.5",
                       "trainer.precision=bf16", f"trainer.deepspeed_config={path}"])
    config = engine_config(cfg.trainer)
    assert config["zero_optimization"] == {"stage": 3, "stage3_param_persistence_threshold": 0}
    assert config["wall_clock_breakdown"] is False and config["gradient_clipping"] == 0.5
    assert config["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert config["train_micro_batch_size_per_gpu"] == 128 and config["gradient_accumulation_steps"] == 1


def test_cli_exits_2_with_one_line_before_touching_ray_or_mlflow(tmp_path, data_override):
    env_uri = f"sqlite:///{tmp_path}/never.db"
    proc = subprocess.run([sys.executable, "-m", "pipelines.train", data_override, "+trainer.bogus=1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"MLFLOW_TRACKING_URI": env_uri, "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "trainer.bogus" in proc.stderr
    assert not (tmp_path / "never.db").exists()  # MLflow was never touched


def test_a_checkpoint_that_does_not_fit_the_run_is_refused_before_ray(tmp_path, data_override):
    """`run.resume_from` a checkpoint another backend or model wrote (the loop records which, and each file's size),
    or one whose copy was cut short: one line naming why. The one that fits passes."""
    from contract.checkpoint import TrainState, checkpoint_origin

    for name, backend, model in (("fsdp-cnn", "fsdp", "cnn"), ("ddp-mlp", "ddp", "mlp")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "state.pt").write_bytes(bytes(1000))
        TrainState(epoch=1).write(tmp_path / name, checkpoint_origin(backend, model))
    with pytest.raises(ConfigError, match=r"^run\.resume_from: \S+fsdp-cnn: written by trainer=fsdp model=cnn, this "
                                          r"run is trainer=ddp model=mlp"):
        load_config([data_override, f"run.resume_from={tmp_path / 'fsdp-cnn'}"])
    assert load_config([data_override, f"run.resume_from={tmp_path / 'ddp-mlp'}"]).run.resume_from
    (tmp_path / "ddp-mlp" / "state.pt").write_bytes(bytes(600))
    with pytest.raises(ConfigError, match=r"^run\.resume_from: \S+: state\.pt is 600 bytes, it was 1000 bytes"):
        load_config([data_override, f"run.resume_from={tmp_path / 'ddp-mlp'}"])


def test_a_resume_dir_of_a_run_this_store_lacks_is_one_line_before_ray(tmp_path, data_override, monkeypatch, capsys):
    """`run.resume_dir` records a run id the tracking store (a real sqlite one) does not hold: exit 2 naming both,
    before Ray starts, and no run is opened."""
    from contract.resume import RUN_ID_FILE
    from pipelines import train

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    (tmp_path / "resume").mkdir()
    (tmp_path / "resume" / RUN_ID_FILE).write_text("0123456789abcdef0123456789abcdef\n")
    assert train.main([data_override, f"run.resume_dir={tmp_path / 'resume'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: run.resume_dir: {tmp_path / 'resume'} continues MLflow run 0123456789abcdef0123456789abcdef"
                   f", which sqlite:///{tmp_path}/mlflow.db does not hold: point MLFLOW_TRACKING_URI at the server it "
                   f"was started on, or use a new run.resume_dir")
    assert "ray" not in sys.modules or not __import__("ray").is_initialized()


@pytest.mark.parametrize("case", ["resume_dir is a file", "storage_path under a file", "deleted experiment",
                                  "empty experiment"])
def test_run_folders_and_experiment_that_cannot_take_the_run_are_one_line_before_ray(
        case, tmp_path, data_override, monkeypatch, capsys):
    """`run.resume_dir`, `run.storage_path` that cannot be folders of this user, an experiment in the tracking
    server's trash or an empty name: exit 2 before Ray starts, no run opened, nothing created."""
    from contract import tracking
    from pipelines import train

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = tracking.mlflow_client(uri)
    client.delete_experiment(client.create_experiment("gone"))
    afile = tmp_path / "afile"
    afile.write_text("")
    override, expected = {
        "resume_dir is a file": (f"run.resume_dir={afile}", f"run.resume_dir: {afile} is not a folder"),
        "storage_path under a file": (f"run.storage_path={afile}/results",
                                      f"run.storage_path: {afile}/results cannot be created: {afile} is not a folder"),
        "deleted experiment": ("run.experiment=gone", "run.experiment: MLflow experiment 'gone' is deleted"),
        "empty experiment": ("run.experiment=''", "run.experiment: empty; name the MLflow experiment"),
    }[case]
    files = sorted(tmp_path.rglob("*"))
    assert train.main([data_override, override]) == 2
    (tmp_path / "mlflow.db.lock").unlink(missing_ok=True)  # the store check's (contract/tracking/store.py)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {expected}"), err
    assert "ray" not in sys.modules or not __import__("ray").is_initialized()
    experiments = [e.experiment_id for e in client.search_experiments(view_type=3)]  # active and deleted
    assert client.search_runs(experiments, run_view_type=3) == []
    assert sorted(tmp_path.rglob("*")) == files


@pytest.mark.parametrize("store", ["http", "file"])
def test_unreachable_mlflow_is_a_clear_error_before_ray(tmp_path, data_override, store):
    """A server that does not answer, or a local store MLflow refuses (MLflow 3: file stores): one line, exit 2,
    before Ray starts."""
    from tests.conftest import free_port

    uri, expected = {"http": (f"http://127.0.0.1:{free_port()}", "is unreachable"),
                     "file": (f"file://{tmp_path}/mlruns", "MLFLOW_ALLOW_FILE_STORE=true")}[store]
    proc = subprocess.run([sys.executable, "-m", "pipelines.train", data_override],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"MLFLOW_TRACKING_URI": uri, "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert expected in proc.stderr and "mlflow_run_id" not in proc.stdout


@pytest.fixture()
def fake_imdb(tmp_path) -> str:
    (tmp_path / "manifest.json").write_text("{}")  # config checks only that a prepared dataset is there
    return f"data.path={tmp_path}"


@pytest.mark.parametrize("overrides, message", [
    (["trainer.tp=3", "trainer.num_workers=3"], r"^trainer\.tp: tp=3 does not divide the model's heads=2"),
    (["trainer.tp=2", "trainer.num_workers=3"], r"^trainer\.tp: tp=2 does not divide num_workers=3"),
    (["trainer.tp=2", "trainer.dp=2", "trainer.num_workers=2"], r"^trainer\.dp: tp\*dp=2\*2=4 != num_workers=2"),
    (["trainer.tp_impl=fsdp"], r"^trainer\.tp_impl: unknown 'fsdp'"),
    (["model.hidden=30", "model.heads=4", "trainer.tp=4", "trainer.num_workers=4"], r"^model\.hidden: hidden=30"),
])
def test_impossible_parallelism_is_rejected(fake_imdb, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(["trainer=tp", "data=imdb", "model=bert_tiny", fake_imdb, *overrides])


def test_auto_holds_a_shard_under_cache_max_bytes_and_streams_a_larger_one(tmp_path):
    """`data.cache_in_worker=auto` weighs a worker's part of the train split (rows x a row's bytes as workers hold
    them / the ranks an epoch is divided among) against `data.cache_max_bytes`; the config carries the answer."""
    import json

    from pipelines.data.imdb import imdb_schema

    (tmp_path / "manifest.json").write_text(json.dumps({**imdb_schema(1000, 256).to_dict(),
                                                        "splits": {"train": {"rows": 1000}}}))
    row = 256 * 4 + 3 * 8  # 256 int32 token ids; the int64 label, length and id
    load = lambda *more: load_config(["data=imdb", "model=bert_tiny", f"data.path={tmp_path}", *more])  # noqa: E731
    assert load().data.cache_in_worker is True and load().data.bucket_by_length  # IMDb's default, streamed too
    assert load(f"data.cache_max_bytes={1000 * row // 2}").data.cache_in_worker is True  # 2 workers: half each
    assert load(f"data.cache_max_bytes={1000 * row // 2 - 1}").data.cache_in_worker is False
    assert load("trainer.num_workers=4", f"data.cache_max_bytes={1000 * row // 4}").data.cache_in_worker is True
    assert load("data.cache_in_worker=false").data.bucket_by_length  # grouped inside the stream's windows


@pytest.mark.parametrize("overrides, message", [
    (["trainer.dp_replicate=3"], r"^trainer\.dp_replicate: must be >= 1 and divide num_workers / \(pp x tp\) = 2, "
                                 r"got 3"),
    (["trainer.dp_replicate=0"], r"^trainer\.dp_replicate: must be >= 1"),
    (["trainer.num_workers=4", "trainer.tp=2", "trainer.dp_replicate=4"], r"num_workers / \(pp x tp\) = 2, got 4"),
    (["trainer.tp=3"], r"^trainer\.tp: must be >= 1 and divide num_workers / pp = 2, got 3"),
    (["trainer.pp=3"], r"^trainer\.pp: must be >= 1 and divide num_workers=2, got 3"),
    (["model=cnn", "trainer.pp=2"], r"^trainer\.pp: pp=2 splits the model into stages by its spec's "
                                    r"pipeline_split; model 'cnn' has none \(pipeline_split=, e\.g\. "),
    (["model.hidden=[16]", "trainer.pp=2", "trainer.pp_schedule=interleaved_1f1b"],
     r"^trainer\.pp: the MLP's 2 linear layers do not split into 4 pipeline stages"),
    (["trainer.dp_shard=4"], r"^trainer\.dp_shard: dp_replicate x dp_shard x pp x tp = 1 x 4 x 1 x 1 != num_workers=2"),
    (["trainer.tp=2"], r"^trainer\.tp: tp=2 shards the model by its spec's tensor-parallel plan; model 'mlp' has "
                       r"none \(tensor_parallel=, e\.g\. trainers\.torch\.parallel\.plans\.styles_plan\)$"),
    (["trainer.precision=fp16", "trainer.use_gpu=true"], r"^trainer\.precision: fp16 .* not supported with fsdp"),
])
def test_impossible_fsdp_layouts_are_rejected(data_override, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config([data_override, "trainer=fsdp", *overrides])


@pytest.mark.parametrize("overrides, message", [
    (["trainer.pp=4", "trainer.num_workers=4"], r"^trainer\.pp: 2 layers do not split into 4 equal pipeline stages"),
    (["trainer.pp_schedule=interleaved_1f1b"], r"^trainer\.pp: 2 layers do not split into 4 equal .*interleaved"),
    (["trainer.pp_schedule=zero_bubble"], r"^trainer\.pp_schedule: unknown 'zero_bubble'"),
    (["trainer.microbatches=1"], r"^trainer\.microbatches: 1 micro-batches leave stages of a 2-stage pipeline idle"),
    (["trainer.microbatches=3"], r"^trainer\.microbatches: 3 does not divide batch_size=128"),
    (["model.layers=4", "trainer.pp_schedule=interleaved_1f1b", "trainer.microbatches=8", "trainer.pp=4",
      "trainer.num_workers=4"], r"^trainer\.pp: 4 layers do not split into 8 equal"),
    (["model.layers=4", "trainer.pp_schedule=interleaved_1f1b", "trainer.microbatches=3", "trainer.batch_size=6"],
     r"^trainer\.microbatches: interleaved_1f1b needs a multiple of pp=2, got 3"),
    (["trainer.grad_accum=2"], r"^trainer\.grad_accum: with pp > 1 the micro-batches are the accumulation"),
    (["trainer.compile=true"], r"^trainer\.compile: not supported with pipeline stages"),
])
def test_impossible_pipelines_are_rejected(fake_imdb, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(["trainer=fsdp", "data=imdb", "model=bert_tiny", fake_imdb, "trainer.pp=2", *overrides])


@pytest.mark.parametrize("overrides, message", [
    (["trainer.mesh.model=2"], r"^trainer\.mesh: the mesh has batch x model = 2 x 2 = 4 devices, the workers hold "
                               r"num_workers x devices_per_worker = 2 x 1 = 2$"),
    (["trainer.mesh.batch=1", "trainer.mesh.model=2", "model.hidden=[33, 30]"],  # 33 -> 30: split on its input
     r"^trainer\.mesh\.model: 2 devices do not split the sharded layer widths \[33\]"),
    (["trainer.mesh.model=3", "trainer.num_workers=3", "trainer.devices_per_worker=2", "trainer.mesh.batch=2"],
     r"^trainer\.mesh: a model group of 3 devices must fill whole workers"),
    (["trainer.mesh.batch=0"], r"^trainer\.mesh: batch and model must be >= 1"),
    (["trainer.devices_per_worker=0"], r"^trainer\.devices_per_worker: must be > 0"),
    (["model=cnn"], r"^model\.name: trainer=tf_dtensor builds the model with a DTensor module builder \(dtensor=\); "
                    r"model 'cnn' has none \(it has: torch, keras\)$"),
    (["trainer.grad_accum=2"], r"^trainer\.grad_accum: tf_dtensor trains with grad_accum=1 and precision=fp32 only"),
    (["trainer.compile=true"], r"^trainer\.compile: torch\.compile is for the PyTorch backends"),
    (["+trainer.tf_devices=2"], r"^trainer\.tf_devices: renamed trainer\.devices_per_worker$"),
])
def test_impossible_dtensor_meshes_are_rejected(data_override, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config([data_override, "trainer=tf_dtensor", *overrides])


def test_dtensor_layouts_load(data_override, fake_imdb):
    """A model group inside a worker (2 x 2 on 2 workers of 2 devices) and one across workers (1 x 2 on 2 workers);
    the tfidf model is tf_dtensor's only."""
    cfg = load_config([data_override, "trainer=tf_dtensor", "trainer.devices_per_worker=2", "trainer.mesh.model=2"])
    assert (cfg.trainer.mesh.batch, cfg.trainer.mesh.model) == (2, 2)
    cfg = load_config(["trainer=tf_dtensor", "data=imdb", "model=tfidf", fake_imdb, "trainer.mesh.batch=1",
                       "trainer.mesh.model=2", "model.bigram_buckets=1024"])
    assert cfg.model.bigram_buckets == 1024
    with pytest.raises(ConfigError, match=r"^model\.bigram_buckets: must be >= 0 \(0: no token pairs\), got -1$"):
        load_config(["trainer=tf_dtensor", "data=imdb", "model=tfidf", fake_imdb, "model.bigram_buckets=-1"])
    with pytest.raises(ConfigError, match=r"^model\.name: trainer=ddp builds the model with a PyTorch builder "
                                          r"\(torch=\); model 'tfidf' has none \(it has: dtensor\)$"):
        load_config(["trainer=ddp", "data=imdb", "model=tfidf", fake_imdb])


def test_a_rank_without_a_batch_to_train_is_rejected(tmp_path):
    """100 training rows over 2 data-parallel ranks (4 workers, 2 pipeline stages) are 50 per rank: a pipeline
    trains full batches only, so a batch of 64 would train nothing; without a pipeline the short batch trains."""
    (tmp_path / "manifest.json").write_text(json.dumps({"splits": {"train": {"rows": 100}}}))
    base = ["trainer=fsdp", "data=imdb", "model=bert_tiny", f"data.path={tmp_path}", "trainer.num_workers=4",
            "trainer.microbatches=2"]
    with pytest.raises(ConfigError, match=r"^trainer\.batch_size: each of the 2 data-parallel rank\(s\) holds 50 "
                                          r"of the 100 training rows, and a pipeline trains full batches only: a "
                                          r"batch of 64 leaves it nothing to train$"):
        load_config([*base, "trainer.pp=2", "trainer.batch_size=64"])
    assert load_config([*base, "trainer.pp=2", "trainer.batch_size=50"]).trainer.batch_size == 50
    assert load_config([*base, "trainer.batch_size=64"]).trainer.batch_size == 64  # 4 ranks of 25 rows: 1 step
    with pytest.raises(ConfigError, match=r"^trainer\.batch_size: each of the 128 data-parallel rank\(s\) holds 0 "):
        load_config([*base, "trainer.num_workers=128"])


@pytest.mark.parametrize("backend", [["trainer=tf_mwms"], ["trainer=horovod", "trainer.framework=tf"],
                                     ["trainer=tf_dtensor", "trainer.mesh.batch=2"]])
def test_a_tensorflow_rank_needs_a_full_batch(tmp_path, backend):
    """The TensorFlow backends train full batches only: 50 rows a rank and a batch of 64 would train nothing
    (the PyTorch backends train the short batch)."""
    (tmp_path / "manifest.json").write_text(json.dumps({"splits": {"train": {"rows": 100}}}))
    base = ["data=mnist", "model=mlp", f"data.path={tmp_path}", "trainer.batch_size=64"]
    with pytest.raises(ConfigError, match=r"^trainer\.batch_size: each of the 2 data-parallel rank\(s\) holds 50 "
                                          r"of the 100 training rows, and TensorFlow trains full batches only"):
        load_config([*base, *backend])
    assert load_config([*base, "trainer=ddp"]).trainer.batch_size == 64


def test_a_pipeline_layout_loads(fake_imdb):
    cfg = load_config(["trainer=fsdp", "data=imdb", "model=bert_tiny", fake_imdb, "trainer.num_workers=8",
                       "trainer.pp=2", "trainer.tp=2", "trainer.dp_shard=2", "trainer.microbatches=8", "model.layers=4",
                       "trainer.pp_schedule=interleaved_1f1b"])
    assert (cfg.trainer.pp, cfg.trainer.tp, cfg.trainer.microbatches) == (2, 2, 8)


def test_each_backend_has_its_own_trainer_keys(data_override, fake_imdb):
    """Another backend's key is an unknown key (set or added), never silently ignored."""
    for overrides in (["trainer.tp=2"], ["+trainer.tp=2"], ["trainer=tf_mwms", "+trainer.compression=fp16"],
                      ["trainer=horovod", "trainer.tf_loop=custom"], ["trainer=tp", "+trainer.devices_per_worker=2"]):
        with pytest.raises(ConfigError, match=r"^trainer\.(tp|compression|tf_loop|devices_per_worker): "):
            load_config([data_override, *overrides])
    cfg = load_config(["trainer=tp", "data=imdb", "model=bert_tiny", fake_imdb, "trainer.num_workers=4"])
    assert (cfg.trainer.dp, cfg.trainer.tp) == (2, 2)
    assert "tp" not in load_config([data_override]).trainer


@pytest.mark.parametrize("backend", ["trainer=ddp", "trainer=tf_mwms", "trainer=horovod", "trainer=tf_dtensor"])
def test_every_backend_can_profile(data_override, backend):
    assert load_config([data_override, backend, "trainer.profile_steps=2"]).trainer.profile_steps == 2


def test_every_backend_is_a_trainer_choice_with_its_keys_defaults():
    """`trainer=<name>` is each registered backend, its keys and defaults its config's (stated once: no yaml)."""
    from pipelines.config import compose
    from trainers import BACKENDS

    assert set(BACKENDS.names()) <= set(group_choices("trainer"))
    assert not (ROOT / "conf" / "trainer").exists()
    for name, spec in BACKENDS.specs.items():
        assert spec.config().backend == name
        assert OmegaConf.to_container(compose([f"trainer={name}"]).trainer) == \
            OmegaConf.to_container(OmegaConf.structured(spec.config))


def test_an_elastic_run_streams_and_keeps_its_global_batch_at_every_size(data_override):
    """`trainer.min_workers`: the data streamed (a part held in memory is one size's), Ray Train's group between
    min_workers and num_workers, and a group of another size the same global batch in bigger or smaller parts."""
    from contract.config import at_world_size
    from trainers.worker import scaling_config

    cfg = load_config([data_override, "trainer.num_workers=3", "trainer.min_workers=2", "trainer.batch_size=16",
                       "trainer.resize_check_s=5"])
    assert cfg.data.cache_in_worker is False
    scaling = scaling_config(cfg)
    assert scaling.num_workers == (2, 3) and scaling.elastic_resize_monitor_interval_s == 5
    assert at_world_size(cfg, 3) is cfg
    smaller = at_world_size(cfg, 2)
    assert (smaller.trainer.num_workers, smaller.trainer.batch_size) == (2, 24) and OmegaConf.is_readonly(smaller)
    assert OmegaConf.get_type(smaller.trainer).__name__ == "DDPConfig" and smaller.model == cfg.model
    assert load_config([data_override]).data.cache_in_worker is True  # a fixed-size run holds MNIST


def test_a_worker_rebuilds_the_typed_read_only_config(data_override):
    from omegaconf import OmegaConf
    from omegaconf.errors import ReadonlyConfigError

    from contract.config import typed_config

    cfg = load_config([data_override, "trainer=tf_mwms", "trainer.tf_loop=custom"])
    rebuilt = typed_config(OmegaConf.to_container(cfg, resolve=True))
    assert rebuilt == cfg and OmegaConf.get_type(rebuilt.trainer).__name__ == "TFMWMSConfig"
    with pytest.raises(ReadonlyConfigError):
        rebuilt.trainer.lr = 1.0


def test_cluster_scripts_set_storage_and_resume_dir_through_the_environment(data_override, monkeypatch, tmp_path):
    monkeypatch.setenv("PIPELINE_STORAGE_PATH", str(tmp_path / "results"))
    monkeypatch.setenv("PIPELINE_RESUME_DIR", str(tmp_path / "resume"))
    cfg = load_config([data_override])
    assert (cfg.run.storage_path, cfg.run.resume_dir) == (str(tmp_path / "results"), str(tmp_path / "resume"))
    assert load_config([data_override, "run.resume_dir=rel"]).run.resume_dir == str(Path.cwd() / "rel")
    monkeypatch.delenv("PIPELINE_RESUME_DIR")
    assert load_config([data_override]).run.resume_dir is None


def test_without_a_cluster_more_threads_than_cpus_or_strict_spread_is_refused(data_override, monkeypatch, capsys):
    from pipelines.train import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cpus = len(os.sched_getaffinity(0))
    assert main([data_override, f"trainer.num_workers={cpus}", "trainer.threads_per_worker=2"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: trainer.num_workers: {cpus} workers x 2 thread(s) need {2 * cpus} CPUs, this machine has {cpus} "
        f"(at most {cpus // 2} such workers fit; set RAY_ADDRESS to train on a Ray cluster)")
    assert main([data_override, "trainer.num_workers=2", "trainer.placement_strategy=STRICT_SPREAD"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: trainer.placement_strategy: STRICT_SPREAD puts each of the 2 Ray workers on its own node; a Ray of "
        "this machine's own has one (set RAY_ADDRESS to train on a Ray cluster)")


def test_a_ray_address_where_nothing_answers_is_one_line_before_ray(data_override, monkeypatch, capsys):
    """RAY_ADDRESS naming a port where no Ray listens (a stopped cluster, a typo): one line, exit 2, instead of
    `ray.init` retrying for minutes."""
    from pipelines.train import main
    from tests.conftest import free_port

    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    assert main([data_override]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: RAY_ADDRESS={address}: no Ray cluster answers there (Connection refused); start it, or unset "
        f"RAY_ADDRESS to run on a Ray of this machine's own")
    assert "ray" not in sys.modules or not __import__("ray").is_initialized()


def test_a_folder_without_a_manifest_names_the_command_that_prepares_it(tmp_path, monkeypatch):
    """A dataset's default folder names its own `rtp prepare`; any other folder, a table of the user's first."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^data\.path: no prepared dataset at 'data/imdb/parquet' \(missing "
                                          r"manifest\.json\); run `rtp prepare imdb --out data/imdb/parquet`$"):
        load_config(["data=imdb"])
    with pytest.raises(ConfigError, match=r"^data\.path: .*; prepare your own table there with `rtp prepare table "
                                          r"--source <CSV, Parquet or dataset folder> --label <column> --out "
                                          r"my_rows`, or `rtp prepare mnist --out my_rows`$"):
        load_config(["data.path=my_rows"])
