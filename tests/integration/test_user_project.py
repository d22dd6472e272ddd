"""The example user projects (examples/wine, examples/shapes) end to end, as a user runs them from their own
folder with `rtp`: a plugin module registers a model and a dataset, which the Ray workers import too.
The shapes project's pictures and CNN through ddp, submitted with `ray job submit`: selected on the validation
split, scored once on the test split, evaluated and used to predict; the wine project's dataset prepared by its
plugin, and its model through tf_mwms on a 5-class table prepared by `rtp prepare table`, whose predictions
carry the class names."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import ROOT, VENV_BIN, check_finished_run, error_lines, pipeline_env, run_id_from

pytestmark = pytest.mark.slow
PLUGIN = "plugins=[wine_project]"
SMALL = ["trainer.epochs=4", "trainer.batch_size=16", "trainer.lr=0.01", "model.hidden=16", "run.system_metrics=false"]


def rtp(args: list[str], cwd, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    """`rtp ARGS` in `cwd`; with `check`, it must exit 0."""
    proc = subprocess.run([str(VENV_BIN / "rtp"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)
    assert not check or proc.returncode == 0, error_lines(proc.stdout + proc.stderr) + "\n---\n" + \
        proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The example project copied where a user keeps theirs: outside the package."""
    return copied_example("wine", tmp_path_factory)


def copied_example(name: str, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("user") / name
    shutil.copytree(ROOT / "examples" / name, folder, ignore=shutil.ignore_patterns("data", "images", "__pycache__"))
    return folder


def five_classes(folder) -> None:
    """A CSV of 5 tree species (string labels) from 4 numeric measurements."""
    rng = np.random.default_rng(3)
    species = np.array(["ash", "birch", "cedar", "elm", "fir"])
    labels = rng.integers(0, 5, 400)
    x = rng.normal(size=(400, 4)) + labels[:, None] * np.array([1.0, -1.0, 0.5, 0.0])
    rows = [f"{a:.3f},{b:.3f},{c:.3f},{d:.3f},{species[y]}" for (a, b, c, d), y in zip(x, labels)]
    (folder / "trees.csv").write_text("\n".join(["girth,height,bark,leaf,species", *rows]) + "\n")


def test_a_five_class_table_trains_with_tf_mwms_and_predicts_names(project, tmp_path, mlflow_server, ray_head):
    """The wine project's own dataset prepared by its plugin (3 cultivars named by strings, validation and test
    carved); then its model through tf_mwms on a 5-class table prepared by `rtp prepare table`."""
    env = pipeline_env(mlflow_server, ray_head)
    rtp(["prepare", "--plugin", "wine_project", "wine"], project, env)
    wine = json.loads((project / "data" / "wine" / "manifest.json").read_text())
    assert {split: info["rows"] for split, info in wine["splits"].items()} == {"train": 106, "validation": 36,
                                                                               "test": 36}
    assert wine["target"]["classes"] == ["barbera", "barolo", "grignolino"]  # the label strings, sorted
    five_classes(project)
    out = project / "data" / "trees"
    rtp(["prepare", "table", "--source", "trees.csv", "--features", "girth", "height", "bark", "leaf", "--label",
         "species", "--out", str(out)], project, env)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"]["classes"] == ["ash", "birch", "cedar", "elm", "fir"]
    proc = rtp(["train", PLUGIN, f"data.path={out}", "model=wine_net", "trainer=tf_mwms", "trainer.tf_loop=custom",
                "trainer.tf_communication=ring", *SMALL, f"run.storage_path={tmp_path / 'ray'}"],
               project, env)
    run_id = run_id_from(proc.stdout)
    client = MlflowClient(mlflow_server)
    check_finished_run(client, run_id, "tf_mwms", 4)
    assert client.get_run(run_id).data.metrics["test_accuracy"] > 0.4  # 5 classes: a fifth by chance

    output = tmp_path / "trees.parquet"
    rtp(["predict", f"model={run_id}", "input=trees.csv", f"output={output}"], project, env)
    predictions = pq.read_table(output).to_pydict()
    species = np.array(manifest["target"]["classes"])
    assert list(species[predictions["prediction"]]) == predictions["label"]
    truth = [line.rsplit(",", 1)[1] for line in (project / "trees.csv").read_text().splitlines()[1:]]
    assert np.mean(np.array(predictions["label"]) == np.array(truth)) > 0.4


def test_an_image_project_submitted_as_a_ray_job_trains_and_predicts_names(tmp_path_factory, tmp_path,
                                                                          mlflow_server, ray_head):
    """examples/shapes: its plugin draws PNG pictures and prepares them through `prepare_table`'s image column; the
    job is submitted from the project's folder (`ray job submit --working-dir .`), so the driver and every Ray
    worker import the plugin from the uploaded copy, which holds the prepared data too."""
    project, env = copied_example("shapes", tmp_path_factory), pipeline_env(mlflow_server, ray_head)
    rtp(["prepare", "--plugin", "shapes_project", "shapes", "--per-shape", "60"], project, env)
    runtime_env = {"env_vars": {k: env[k] for k in ("MLFLOW_TRACKING_URI", "OMP_NUM_THREADS",
                                                    "RAY_DATA_DISABLE_PROGRESS_BARS")}}
    cmd = ["ray", "job", "submit", "--address", ray_head["RAY_DASHBOARD_ADDRESS"], "--working-dir", ".",
           "--runtime-env-json", json.dumps(runtime_env), "--", "rtp", "train", "plugins=[shapes_project]",
           "data=shapes", "model=shape_net", "trainer=ddp", "trainer.epochs=4", "trainer.batch_size=16",
           "trainer.lr=0.01", "run.system_metrics=false", f"run.storage_path={tmp_path / 'ray'}"]
    proc = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, error_lines(proc.stdout + proc.stderr) + "\n---\n" + proc.stdout[-3000:]
    run_id = run_id_from(proc.stdout)
    client = MlflowClient(mlflow_server)
    check_finished_run(client, run_id, "ddp", 4)
    run = client.get_run(run_id)
    assert run.data.params["data.name"] == "shapes" and run.data.params["model.name"] == "shape_net"
    assert run.data.metrics["test_accuracy"] > 0.6  # 3 shapes: a third by chance

    assert run.data.params["data.eval_split"] == "validation"  # model selection never saw the test split ...
    assert run.data.metrics["final_test_rows"] == 36  # ... which scored the chosen model once, at the end
    final = run.data.metrics["final_model.log_s"] + run.data.metrics["final_model.test_s"]  # in the run's goodput
    assert run.data.metrics["final_model.test_s"] > 0 and run.data.metrics["goodput.final_s"] == pytest.approx(final)
    evaluation = client.get_run(run_id_from(rtp(["evaluate", f"model={run_id}", "data.split=test"], project,
                                                env).stdout))
    assert evaluation.data.metrics["test_rows"] == 36
    assert evaluation.data.metrics["test_accuracy"] == pytest.approx(run.data.metrics["final_test_accuracy"])
    header = client.download_artifacts(evaluation.info.run_id, "confusion_matrix.csv", str(tmp_path))
    assert open(header).readline().strip() == "# box,cross,disc"  # the manifest's class names, sorted

    output = tmp_path / "discs.parquet"
    rtp(["predict", f"model={run_id}", "input=images/disc", f"output={output}"], project, env)
    labels = pq.read_table(output).to_pydict()["label"]
    assert len(labels) == 60 and set(labels) <= {"box", "cross", "disc"}
    assert labels.count("disc") > 30
