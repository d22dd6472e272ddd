"""A user's own model and data, through the registries (contract/registry.py) as the built-in ones go: a plugin
module in the user's folder registers a model, `rtp` loads it by import path (or an installed package's entry
point), and the config, the checks and the shared loop treat it as one of ours. A plugin that fails and a layout
the model has no plan for are one line and exit 2 before Ray starts."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from contract.config import monitor_of
from contract.data import DataSchema
from contract.metrics import eval_metric, metric_names
from contract.registry import MODELS, entry_point_plugins
from pipelines.config import ConfigError, load_config
from pipelines.data.table import prepare_table
from tests.support.loop_harness import run_attempt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PLUGIN = '''
from dataclasses import dataclass

from contract.registry import ModelSpec, register_model


@dataclass
class TinyConfig:
    name: str = "{name}"  # a user's model
    hidden: int = 8        # its width


def build(cfg, inputs, seed):
    from torch import nn

    return nn.Sequential(nn.Linear(inputs.features.width, cfg.hidden), nn.ReLU(),
                         nn.Linear(cfg.hidden, inputs.target.outputs))


register_model(ModelSpec("{name}", TinyConfig, "a user's model", inputs=("numeric",), torch=build))
'''


def write_plugin(folder: Path, module: str, name: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{module}.py").write_text(PLUGIN.format(name=name))


def table(folder: Path, task: str = "classification", rows: int = 120) -> Path:
    """A prepared table: 3 numeric features; 5 string classes, or a regression target linear in the features."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 3))
    if task == "regression":
        labels = [f"{v:.4f}" for v in x @ np.array([1.5, -2.0, 0.5]) + 3.0]
    else:
        labels = [["ash", "birch", "cedar", "elm", "fir"][i % 5] for i in range(rows)]
    lines = ["a,b,c,y", *(f"{a:.4f},{b:.4f},{c:.4f},{y}" for (a, b, c), y in zip(x, labels))]
    source = folder / "table.csv"
    folder.mkdir(parents=True, exist_ok=True)
    source.write_text("\n".join(lines) + "\n")
    out = folder / "prepared"
    prepare_table(source=[source], features=["a", "b", "c"], label="y", task=task, out=out, name=f"t_{task}",
                  shards=1)
    return out


@pytest.fixture()
def user_folder(tmp_path, monkeypatch, forget_plugins) -> Iterator[Path]:
    """The user's project folder, the working directory (where `rtp` finds plugin modules, as `python -m` does).
    What its plugins register is forgotten afterwards (`forget_plugins`), and so is the search path."""
    folder = tmp_path / "project"
    folder.mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield folder


def test_a_plugin_model_trains_with_the_built_in_keys(user_folder):
    write_plugin(user_folder, "my_models", "tiny_a")
    data = table(user_folder)
    cfg = load_config(["plugins=[my_models]", "model=tiny_a", "model.hidden=4", f"data.path={data}"])
    assert cfg.model.hidden == 4 and cfg.model.name == "tiny_a" and cfg.data.name == "t_classification"
    assert cfg.run.monitor == "test_accuracy" and "tiny_a" in MODELS
    with pytest.raises(ConfigError, match=r"^model\.width: not a key of this config"):
        load_config(["plugins=[my_models]", "model=tiny_a", "model.width=4", f"data.path={data}"])


def test_an_unknown_model_lists_the_registered_ones(user_folder):
    data = table(user_folder)
    with pytest.raises(ConfigError, match=r"^model: unknown choice 'nope' \(choices: .*cnn.*mlp"):
        load_config(["model=nope", f"data.path={data}"])
    with pytest.raises(ConfigError, match=r"^model\.name: unknown model 'nope' \(registered: bert, cnn, embed_pool, "
                                          r"hf, mlp, tfidf.*; a model of your own: plugins=\[your\.module\]\)$"):
        load_config(["model.name=nope", f"data.path={data}"])


def test_a_plugin_that_fails_to_import_is_one_line_and_exit_2_before_ray(user_folder, capsys):
    import ray

    from pipelines import train

    (user_folder / "broken.py").write_text("import numpy\nraise RuntimeError('no GPU driver here')\n")
    data = table(user_folder)
    assert train.main(["plugins=[broken]", f"data.path={data}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: plugins: broken failed to load (RuntimeError: no GPU driver here)"
    assert train.main(["plugins=[not_there]", f"data.path={data}"]) == 2
    assert capsys.readouterr().err.strip() == ("error: plugins: not_there failed to load (ModuleNotFoundError: No "
                                               "module named 'not_there')")
    assert not ray.is_initialized()


def test_tensor_parallelism_needs_the_models_plan(user_folder, capsys):
    from pipelines import train

    write_plugin(user_folder, "my_models_b", "tiny_b")  # a module name of its own: imported modules are cached
    data = table(user_folder)
    base = ["plugins=[my_models_b]", "model=tiny_b", f"data.path={data}"]
    assert train.main([*base, "trainer=tp", "trainer.tp=2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: trainer.tp: tp=2 shards the model by its spec's tensor-parallel plan; model 'tiny_b' has none "
        "(tensor_parallel=, e.g. trainers.torch.parallel.plans.styles_plan)")
    with pytest.raises(ConfigError, match=r"^model\.name: trainer=tf_mwms builds the model with a Keras builder "
                                          r"\(keras=\); model 'tiny_b' has none \(it has: torch\)$"):
        load_config([*base, "trainer=tf_mwms"])
    with pytest.raises(ConfigError, match=r"^model\.name: model 'cnn' takes image features; 't_classification' has "
                                          r"numeric features \(models for it: .*mlp.*tiny_b"):
        load_config([f"data.path={data}", "model=cnn"])


@pytest.mark.parametrize("spec, message", [
    ('ModelSpec("m1", object, torch=build)', r"config=<class 'object'> is not a dataclass"),
    ('ModelSpec("m2", NoName, torch=build)', r"config NoName has no `name` field"),
    ('ModelSpec("m3", TinyConfig, inputs=("tabular",), torch=build)',
     r"inputs=\('tabular',\); each must be one of image, numeric, tokens"),
    ('ModelSpec("m4", TinyConfig, mutable=("lr",), torch=build)', r"mutable=\('lr',\); each must be one of hidden"),
])
def test_a_spec_no_command_could_use_is_refused_as_its_plugin_loads(spec, message, user_folder):
    """What registration checks (contract/registry.py `register_model`): a plugin registering such a spec fails to
    load, in one line, as any failing plugin does; `rtp list` and every other command say so instead of a traceback."""
    module = f"bad_{spec[11:13]}"
    source = PLUGIN.format(name="unused").split("register_model(")[0]
    (user_folder / f"{module}.py").write_text(source + f"\n@dataclass\nclass NoName:\n    hidden: int = 8\n\n\n"
                                                       f"register_model({spec})\n")
    with pytest.raises(ConfigError, match=rf"^plugins: {module} failed to load \(RegistryError: model 'm\d': "
                                          rf"{message}"):
        load_config([f"plugins=[{module}]"])


def test_a_spec_naming_what_is_not_there_is_one_line_before_ray(user_folder):
    """A builder named by a misspelt `"module:attribute"`, or in a module not on the path, and a DTensor model with
    no Keras twin to log: refused by the config's checks, before Ray (the workers would fail on them)."""
    (user_folder / "my_refs.py").write_text(PLUGIN.format(name="tiny_r").replace(
        'torch=build))', 'torch="my_refs:biuld"))\nregister_model(ModelSpec("tiny_m", TinyConfig, inputs=("numeric",), '
        'torch="not_a_module:build"))\nregister_model(ModelSpec("tiny_d", TinyConfig, inputs=("numeric",), '
        'dtensor="my_refs:build"))'))
    data = table(user_folder)
    base = ["plugins=[my_refs]", f"data.path={data}"]
    with pytest.raises(ConfigError, match=r"^model\.name: model 'tiny_r' names torch='my_refs:biuld': module "
                                          r"'my_refs' has no 'biuld'$"):
        load_config([*base, "model=tiny_r"])
    with pytest.raises(ConfigError, match=r"^model\.name: model 'tiny_m' names torch='not_a_module:build': no module "
                                          r"'not_a_module' on the path$"):
        load_config([*base, "model=tiny_m"])
    with pytest.raises(ConfigError, match=r"^model\.name: tf_dtensor logs the trained model as a Keras twin; model "
                                          r"'tiny_d' has none \(keras_twin=, or keras=\)$"):
        load_config([*base, "model=tiny_d", "trainer=tf_dtensor"])


def test_an_installed_packages_entry_point_is_a_plugin(user_folder, tmp_path, monkeypatch):
    """A package's `rtp.plugins` entry point, found by importlib.metadata in a site folder, as pip installs it."""
    site = tmp_path / "site"
    write_plugin(site, "their_models", "tiny_c")
    info = site / "their_models-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: their-models\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[rtp.plugins]\ntheir = their_models\n")
    monkeypatch.syspath_prepend(str(site))
    assert "their_models" in entry_point_plugins()
    cfg = load_config(["model=tiny_c", f"data.path={table(user_folder)}"])
    assert cfg.model.name == "tiny_c" and cfg.plugins == ["their_models"]  # what the workers load too


def test_a_regression_trains_on_the_loop_and_keeps_the_epoch_of_least_test_mse(user_folder, tmp_path):
    """A regression dataset through the shared loop (ddp's adapter, in process): MSE loss, `test_mse` in the metric
    set in place of `test_accuracy`, monitored by default with mode min: the best epoch is the one of least
    test_mse."""
    import pyarrow.parquet as pq

    from trainers.adapter import WorkerData
    from trainers.torch.data import ShardBatches
    from trainers.torch.ddp import DDP

    data = table(user_folder, "regression", rows=400)
    cfg = load_config([f"data.path={data}", "model.hidden=[16]", "model.dropout=0", "trainer.epochs=4",
                       "trainer.batch_size=32", "trainer.num_workers=1", "trainer.lr=0.01",
                       f"run.storage_path={tmp_path / 'ray'}"])
    assert (cfg.run.monitor, monitor_of(cfg.run).mode) == ("test_mse", "min")
    schema = DataSchema.from_manifest(__import__("json").loads((data / "manifest.json").read_text()))

    def columns(split: str) -> dict[str, torch.Tensor]:
        frame = pq.read_table(next(data.glob(f"{split}-*.parquet")))
        return {"features": torch.from_numpy(np.stack(frame.column("features").to_numpy(zero_copy_only=False))),
                "label": torch.from_numpy(frame.column("label").to_numpy().copy())}

    train, evaluation = columns("train"), columns("validation")
    assert train["label"].dtype == torch.float32

    def shards(seed):
        return (ShardBatches.from_columns(train, schema, 32, seed), ShardBatches.from_columns(evaluation, schema, 64,
                                                                                              seed))

    def run(ctx):
        ctx = replace(ctx, monitor=monitor_of(cfg.run), evaluated=eval_metric(schema.target.task))
        return DDP().run_worker(cfg, ctx, WorkerData(schema, shards))

    attempt = run_attempt(run, 0, 1, cfg.trainer.epochs, tmp_path / "attempt")
    epochs = attempt.recorder.epochs
    assert set(epochs[1]) == set(metric_names("regression")) | {"data_load_s"}
    mse = {epoch: metrics["test_mse"] for epoch, metrics in epochs.items()}
    assert mse[4] < mse[1]  # it learns the linear target
    from contract.checkpoint import TrainState

    state = TrainState.read(str(attempt.checkpoint))
    assert state.best_epoch == min(mse, key=lambda epoch: (mse[epoch], -epoch))
    assert state.best_value == pytest.approx(min(mse.values()))


def test_a_plugin_backend_has_its_own_keys_checks_and_trains_on_the_loop(user_folder, capsys):
    """docs/architecture.md's backend of a user's, as written there: `trainer=allreduce` is a choice with its own
    key and its default, its check refuses a value in one line (exit 2, before Ray), and its `Backend` trains on
    the shared loop with the contract's metrics."""
    import json

    import pyarrow.parquet as pq
    import ray

    from pipelines import train
    from tests.conftest import ROOT
    from tests.support.doc_commands import module_blocks
    from trainers import get_backend
    from trainers.adapter import WorkerData
    from trainers.torch.data import ShardBatches

    for module, source in module_blocks((ROOT / "docs" / "architecture.md").read_text()).items():
        (user_folder / f"{module}.py").write_text(source)
    data = table(user_folder)
    base = ["plugins=[my_backends]", "trainer=allreduce", f"data.path={data}", "model.hidden=[8]",
            "trainer.num_workers=1", "trainer.epochs=2", "trainer.batch_size=16"]
    cfg = load_config([*base, "trainer.grad_dtype=bfloat16"])
    assert (cfg.trainer.backend, cfg.trainer.grad_dtype, cfg.trainer.lr) == ("allreduce", "bfloat16", 1e-3)
    assert train.main([*base, "trainer.grad_dtype=float16"]) == 2
    assert capsys.readouterr().err.strip() == ("error: trainer.grad_dtype: one of float32, bfloat16, got "
                                               "'float16'")
    assert not ray.is_initialized()

    schema = DataSchema.from_manifest(json.loads((data / "manifest.json").read_text()))
    rows = pq.read_table(next(data.glob("train-*.parquet")))  # the prepared train split, as a worker holds it
    columns = {"features": torch.from_numpy(np.stack(rows.column("features").to_numpy(zero_copy_only=False))),
               "label": torch.from_numpy(rows.column("label").to_numpy().copy())}
    backend = get_backend(cfg.trainer)
    assert type(backend).__name__ == "AllReduce"
    shards = lambda seed: (ShardBatches.from_columns(columns, schema, 16, seed),  # noqa: E731
                           ShardBatches.from_columns(columns, schema, 64, seed))
    attempt = run_attempt(lambda ctx: backend.run_worker(cfg, ctx, WorkerData(schema, shards)), 0, 1, 2,
                          user_folder / "attempt")
    assert attempt.finished and set(attempt.recorder.epochs) == {1, 2}
    assert set(attempt.recorder.epochs[1]) == set(metric_names("classification")) | {"data_load_s"}
