"""TensorFlow MultiWorkerMirroredStrategy backend end to end: a real Ray head, a real MLflow server, 2 CPU
workers over RING collectives, for both loops (tf-keras `fit` and the custom `strategy.run` loop)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import ROOT, check_finished_run, pipeline_env, train_ok

pytestmark = pytest.mark.slow
TINY = ["trainer=tf_mwms", "trainer.tf_communication=ring", "trainer.batch_size=32", "model.hidden=[32]",
        "trainer.threads_per_worker=1", "trainer.epochs=3"]


def train(args: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, str]:
    return train_ok([*TINY, *args], env)


def check_run(client: MlflowClient, run_id: str, epochs: int = 3) -> str:
    """The shared run contract (a Keras model logged), plus data_load_s."""
    model_uri = check_finished_run(client, run_id, "tf_mwms", epochs)
    assert len(client.get_metric_history(run_id, "data_load_s")) >= 1
    return model_uri


def check_replicas_identical(params_dir) -> list[np.ndarray]:
    """The all-reduce keeps replicas in step. Exact equality: both workers apply the same summed gradient
    to the same weights with the same ops, so their float32 results are bitwise identical."""
    rank0, rank1 = (np.load(params_dir / f"rank{r}.npz") for r in (0, 1))
    assert rank0.files == rank1.files and rank0.files
    for key in rank0.files:
        np.testing.assert_array_equal(rank0[key], rank1[key])
    return [rank0[key] for key in rank0.files]


def test_fit_loop_syncs_trains_and_logs(tmp_path, tiny_mnist, mlflow_server, ray_head):
    proc, run_id = train([f"data.path={tiny_mnist}", "trainer.tf_loop=fit", "fault.max_failures=0",
                          f"run.storage_path={tmp_path / 'ray'}",
                          f"run.dump_params_dir={tmp_path / 'params'}"], pipeline_env(mlflow_server, ray_head))
    model_uri = check_run(MlflowClient(mlflow_server), run_id)
    weights = check_replicas_identical(tmp_path / "params")
    # The logged model loads (tf-keras: with TF_USE_LEGACY_KERAS=1) and holds the trained weights.
    np.savez(tmp_path / "expected.npz", *weights)
    code = ("import sys, numpy as np, mlflow; mlflow.set_tracking_uri(sys.argv[1]);"
            "import mlflow.tensorflow as mt;"
            "m = mt.load_model(sys.argv[2]); e = np.load(sys.argv[3]);"
            "w = m.get_weights(); assert len(w) == len(e.files);"
            "assert all(np.array_equal(a, e[k]) for a, k in zip(w, e.files));"
            "assert m.predict(np.zeros((4, 784), np.float32), verbose=0).shape == (4, 10); print('ok')")
    env = {**pipeline_env(mlflow_server), "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    load = subprocess.run([sys.executable, "-c", code, mlflow_server, model_uri, str(tmp_path / "expected.npz")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert load.returncode == 0 and load.stdout.strip().endswith("ok"), load.stderr[-3000:]


def test_custom_loop_resumes_after_failure(tmp_path, tiny_mnist, mlflow_server, ray_head):
    """The custom loop, with one worker failing at epoch 2: the run resumes from epoch 1's checkpoint
    (weights, optimizer state, epoch) and the MLflow run still holds each epoch once."""
    marker = tmp_path / "failed-once"
    proc, run_id = train([f"data.path={tiny_mnist}", "trainer.tf_loop=custom",
                          f"run.storage_path={tmp_path / 'ray'}", f"run.dump_params_dir={tmp_path / 'params'}",
                          "fault.max_failures=1", "fault.inject_at_epoch=2", f"fault.inject_marker={marker}"],
                         pipeline_env(mlflow_server, ray_head))
    assert marker.read_text().startswith("failed at epoch 2 in rank 1")
    client = MlflowClient(mlflow_server)
    check_run(client, run_id)
    assert client.get_run(run_id).data.tags["resumed_from_epoch"] == "1"
    check_replicas_identical(tmp_path / "params")


def test_checkpoint_round_trip_restores_weights_and_optimizer(tmp_path):
    """What a resumed worker loads: the weights, every optimizer variable (Adam moments, iteration count),
    the epoch and a stopped epoch's totals, bit for bit. In a subprocess: tf-keras wants TF_USE_LEGACY_KERAS=1 before TF is imported."""
    code = """
import sys, numpy as np, tensorflow as tf, tf_keras as keras
from omegaconf import OmegaConf
from ray.train import Checkpoint
from trainers.tf_mwms import build_compiled_model, restore_checkpoint, save_checkpoint
cfg = OmegaConf.create({"model": {"name": "mlp", "hidden": [8], "dropout": 0.0},
                        "trainer": {"lr": 0.01, "optimizer": "adam", "tf_steps_per_execution": 1}})
strategy = tf.distribute.get_strategy()
model = build_compiled_model(keras, cfg, {})
x, y = np.random.default_rng(0).normal(size=(64, 784)).astype("float32"), np.arange(64) % 10
model.fit(x, y, batch_size=16, epochs=1, verbose=0)
partial = {"epoch": 5, "done": 10, "loss_sum": 2.5, "train_s": 0.5}  # a stopped epoch 5 (custom loop)
save_checkpoint(sys.argv[1], model, 4, {"train_loss": 1.0}, partial)
fresh = build_compiled_model(keras, cfg, {})
state = restore_checkpoint(Checkpoint.from_directory(sys.argv[1]), fresh, strategy)
assert state == {"epoch": 4, "metrics": {"train_loss": 1.0}, "partial": partial}, state
assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), fresh.get_weights()))
old, new = [v.numpy() for v in model.optimizer.variables], [v.numpy() for v in fresh.optimizer.variables]
assert len(old) == len(new) == 1 + 2 * len(model.trainable_variables), (len(old), len(new))
assert all(np.array_equal(a, b) for a, b in zip(old, new)) and int(new[0]) == 4
print("ok")
"""
    env = {**pipeline_env("unused"), "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def step_losses(client: MlflowClient, run_id: str) -> tuple[list[int], np.ndarray]:
    history = sorted(client.get_metric_history(run_id, "step_loss"), key=lambda m: m.step)
    return [m.step for m in history], np.array([m.value for m in history])


def test_one_worker_with_two_devices_equals_one_device_with_the_double_batch(tmp_path, tiny_mnist, mlflow_server,
                                                                              ray_head):
    """`trainer.tf_devices=2` (MirroredStrategy over two logical CPU devices in one worker) with 16 rows per
    replica takes the same steps as one device with 32 rows: same rows per step, gradients averaged over the
    global batch. Also: step_loss from both loops (fit: the mean over each tf_steps_per_execution window)."""
    env = pipeline_env(mlflow_server, ray_head)
    common = [f"data.path={tiny_mnist}", "trainer.num_workers=1", "trainer.epochs=1", "trainer.optimizer=sgd",
              "trainer.lr=0.05", "model.dropout=0", f"run.storage_path={tmp_path / 'ray'}", "fault.max_failures=0"]
    runs = {}
    for name, args in {"one": ["trainer.tf_devices=1", "trainer.batch_size=32", "trainer.tf_loop=custom",
                               "trainer.log_every_n_steps=1"],
                       "two": ["trainer.tf_devices=2", "trainer.batch_size=16", "trainer.tf_loop=custom",
                               "trainer.log_every_n_steps=1"],
                       "fit": ["trainer.tf_devices=2", "trainer.batch_size=16", "trainer.tf_loop=fit",
                               "trainer.log_every_n_steps=8", "trainer.tf_steps_per_execution=8"]}.items():
        _, runs[name] = train([*common, *args, f"run.dump_params_dir={tmp_path / name}"], env)
    client = MlflowClient(mlflow_server)
    steps_one, curve_one = step_losses(client, runs["one"])
    steps_two, curve_two = step_losses(client, runs["two"])
    assert steps_one == steps_two == list(range(1, 33))  # 1024 rows / 32 per step
    np.testing.assert_allclose(curve_two, curve_one, rtol=1e-4, atol=1e-5)
    one, two = (np.load(tmp_path / name / "rank0.npz") for name in ("one", "two"))
    for key in one.files:
        np.testing.assert_allclose(two[key], one[key], rtol=1e-4, atol=1e-5)
    samples = [client.get_metric_history(runs[n], "samples_per_s")[0].value for n in ("one", "two")]
    assert all(s > 0 for s in samples)

    fit_steps, fit_curve = step_losses(client, runs["fit"])
    assert fit_steps == [8, 16, 24, 32]
    # Each logged value is the mean loss of its 8 steps: the custom loop's per-step losses, window by window.
    np.testing.assert_allclose(fit_curve, curve_two.reshape(4, 8).mean(axis=1), rtol=1e-3, atol=1e-4)


def test_imdb_embed_pool_on_two_workers(tmp_path, tiny_imdb, mlflow_server, ray_head):
    """IMDb token shards through tf.data into the Keras text model (masked mean of embeddings), 2 workers."""
    _, run_id = train([f"data.path={tiny_imdb}", "data=imdb", "model=embed_pool", "model.embed_dim=16",
                       "model.hidden=16", "trainer.lr=0.01", "trainer.tf_loop=fit", "fault.max_failures=0",
                       f"run.storage_path={tmp_path / 'ray'}", f"run.dump_params_dir={tmp_path / 'params'}"],
                      pipeline_env(mlflow_server, ray_head))
    check_run(MlflowClient(mlflow_server), run_id)
    embedding = check_replicas_identical(tmp_path / "params")[0]
    vocab = json.loads((tiny_imdb / "manifest.json").read_text())["model_inputs"]["vocab_size"]
    assert embedding.shape == (vocab, 16)  # the tokenizer's vocabulary x embed_dim
