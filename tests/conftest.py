"""Shared fixtures: small generated MNIST-format data, a real MLflow server, a real Ray head."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from pipelines.data.idx import write_idx
from tests.support.local_ray import started_ray_head

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent

_SESSION = pytest.StashKey["pytest.Session"]()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_SESSION] = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave with pytest's exit status once its reports are written, skipping the interpreter's teardown. This
    process holds TensorFlow, torch, Ray's driver and gloo together, and their native destructors can crash at exit
    (SIGSEGV, exit 139, after a summary of passed tests). Every test's own processes are checked by the tests; only
    this runner's teardown is skipped."""
    session = config.stash.get(_SESSION, None)
    if session is None:  # e.g. `pytest --help`: no session ran
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(session.exitstatus))


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """Loopback ports free right now, all different (held at once while picking)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()




def make_mnist_like(folder: Path, n_train: int, n_test: int, seed: int = 0) -> Path:
    """IDX files of learnable fake digits: one random template per class plus noise."""
    rng = np.random.default_rng(seed)
    templates = rng.integers(0, 256, size=(10, 28, 28))
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, count in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, size=count)
        noise = rng.normal(0, 40, size=(count, 28, 28))
        images = np.clip(templates[labels] + noise, 0, 255)
        write_idx(folder / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return folder


@pytest.fixture()
def one_torch_thread():
    """Torch on one thread for the test (two cores are shared with other jobs here); the setting restored after,
    so other tests are unaffected."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture()
def forget_plugins() -> Iterator[None]:
    """What the test's plugins register is forgotten afterwards: the registries, Hydra's config store and the
    plugin modules themselves (a model registered in one test would otherwise appear in another's choices, e.g. the
    generated config reference; a module left imported would not register again in the next test)."""
    from hydra.core.config_store import ConfigStore

    from contract.registry import BACKENDS, DATASETS, MODELS

    registered = [(registry, dict(registry.specs)) for registry in (MODELS, DATASETS, BACKENDS)]
    stored = {group: dict(ConfigStore.instance().repo.get(group, {})) for group in ("model", "data", "trainer")}
    yield
    for registry, specs in registered:
        added = [spec for name, spec in registry.specs.items() if name not in specs]
        for spec in added:
            source = getattr(spec, "config", None) or getattr(spec, "prepare", None)
            sys.modules.pop(getattr(source, "__module__", ""), None)
        registry.specs.clear()
        registry.specs.update(specs)
    for group, entries in stored.items():
        ConfigStore.instance().repo[group] = entries


def wait_until(predicate, timeout_s: float, what: str) -> None:
    """Poll a condition (bounded); used to wait for servers to answer, never as a fixed sleep."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")


def prepared_mnist(base: Path, n_train: int, n_test: int = 256) -> Path:
    """Prepared Parquet shards (2 per split) of `n_train` train / `n_test` test generated images, without a
    validation split: the runs of the suite evaluate on the test split, which its expectations (steps per epoch,
    an evaluation of the test split against the run's own accuracy) are computed on. The default carve is tested
    in tests/unit/test_mnist_data.py, the validation-then-test path end to end in test_user_project.py."""
    from pipelines.prepare import main as prepare_main

    raw = make_mnist_like(base / "raw", n_train, n_test)
    assert prepare_main(["mnist", "--source", str(raw), "--out", str(base / "parquet"), "--shards", "2",
                         "--val-fraction", "0"]) == 0
    return base / "parquet"


@pytest.fixture(scope="session")
def tiny_mnist(tmp_path_factory) -> Path:
    """Prepared Parquet shards (2 per split) of 1024 train / 256 test generated images."""
    return prepared_mnist(tmp_path_factory.mktemp("tiny_mnist"), 1024)


@pytest.fixture(scope="session")
def tiny_imdb(tmp_path_factory, ray_head) -> Path:
    """Prepared IMDb-format shards: 320 generated reviews -> 256 train / 64 validation, max_len 48 (tokenised on
    the session's Ray head rather than a Ray of its own), with a fixed whole-word tokenizer: the same data in every
    session (a trained one differs from run to run on this tiny text, and the tiny models learnt differently)."""
    from tests.support.imdb_fixtures import fixed_tokenizer, make_aclimdb

    base = tmp_path_factory.mktemp("tiny_imdb")
    root = make_aclimdb(base / "src", per_label=160, bad_files=False)
    tokenizer = fixed_tokenizer(root, base / "tokenizer.json")
    cmd = [sys.executable, "-m", "pipelines.prepare", "imdb", "--source", str(root), "--out", str(base / "out"),
           "--shards", "2", "--tokenizer", str(tokenizer), "--max-len", "48", "--val-fraction", "0.2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=pipeline_env("unused", ray_head), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return base / "out"


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def start_mlflow_server(base: Path, port: int) -> subprocess.Popen:
    """A real `mlflow server` on loopback (sqlite backend in `base`, proxied artifact store), answering /health."""
    base.mkdir(parents=True, exist_ok=True)
    with open(base / "server.log", "a") as log:
        proc = subprocess.Popen(
            [str(VENV_BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{base}/mlflow.db", "--artifacts-destination", str(base / "artifacts")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})  # no job runner: 7 fewer processes
    try:
        wait_until(lambda: _http_ok(f"http://127.0.0.1:{port}/health") or proc.poll() is not None, 120,
                   "mlflow server")
        assert proc.poll() is None, (base / "server.log").read_text()
    except BaseException:
        stop_mlflow_server(proc)
        raise
    return proc


def stop_mlflow_server(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, 15)  # the server and its workers
    proc.wait(timeout=30)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> str:
    """The session's MLflow server (start_mlflow_server)."""
    port = free_port()
    proc = start_mlflow_server(tmp_path_factory.mktemp("mlflow"), port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_mlflow_server(proc)


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory) -> dict[str, str]:
    """The session's Ray head; 6 logical CPUs on 2 cores: 4 one-thread workers of the 2D test plus room for Ray
    Data tasks."""
    with started_ray_head(tmp_path_factory.mktemp("ray_state"), 6) as values:
        yield values


CLIENT_SETTINGS = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")  # ray.env's


def ray_init_on(ray_env: dict[str, str], **init_kwargs: Any) -> None:
    """`ray.init` in this (pytest's) process on a head of cluster/local/ray-local.sh, with the client settings its
    ray.env gives a shell (loopback, the head's token); they stay in this process's environment."""
    from pipelines.ray_session import use_ray_settings

    os.environ.pop("RAY_AUTH_TOKEN", None)
    use_ray_settings({key: ray_env[key] for key in CLIENT_SETTINGS})
    import ray

    ray.init(address=ray_env["RAY_ADDRESS"], **init_kwargs)


def pipeline_env(tracking_uri: str, ray_env: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri, "OMP_NUM_THREADS": "1",
           "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
           "PATH": f"{VENV_BIN}:{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    if ray_env:
        env.update(ray_env)
    return env


def fresh_tf_process(module: str, *args: str) -> Any:
    """What `python -m <module> ARGS` prints on its last line (JSON), run in a fresh process of one thread with
    tf-keras: TensorFlow fixes its threads and logical devices at its first op, and tf-keras needs
    TF_USE_LEGACY_KERAS=1 before TensorFlow is imported."""
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def interruptible(module: str, args: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen]:
    """`python -m <module> <args>` with pipes, taking SIGINT as in a terminal even when this suite runs in the
    background (which ignores it); killed on leaving the block if still running."""
    proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()


def ctrl_c(proc: subprocess.Popen, timeout_s: float) -> tuple[str, str]:
    """SIGINT to `proc`, then the rest of its (stdout, stderr) once it has exited."""
    proc.send_signal(signal.SIGINT)
    return proc.communicate(timeout=timeout_s)


def run_pipeline(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`python -m pipelines.train <args>` as `ray job submit` would run it (bounded: 10 min)."""
    return subprocess.run([sys.executable, "-m", "pipelines.train", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def run_id_from(stdout: str) -> str:
    """The MLflow run id from the pipeline's last `mlflow_run_id=` line."""
    lines = [line for line in stdout.strip().splitlines() if line.startswith("mlflow_run_id=")]
    assert lines, stdout[-3000:]
    return lines[-1].split("=", 1)[1]


def evaluate_ok(model: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, str]:
    """`python -m pipelines.evaluate model=<model>` (its data: the training run's), require exit 0; (the process,
    the evaluation's MLflow run id)."""
    proc = subprocess.run([sys.executable, "-m", "pipelines.evaluate", f"model={model}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc, run_id_from(proc.stdout)


def read_split(data_path: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(model inputs, labels) of a prepared split, read straight from its Parquet shards in manifest order."""
    import json

    import pyarrow.parquet as pq

    from contract.data import DataSchema

    manifest = json.loads((data_path / "manifest.json").read_text())
    schema = DataSchema.from_manifest(manifest)
    tables = [pq.read_table(data_path / shard["file"]) for shard in manifest["splits"][split]["shards"]]
    column = schema.features.column
    features = np.concatenate([np.stack(t.column(column).to_numpy(zero_copy_only=False)) for t in tables])
    labels = np.concatenate([t.column(schema.target.column).to_numpy() for t in tables])
    return schema.features.model_input(features), labels.astype(np.int64 if schema.target.classes else np.float64)


def train_ok(args: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, str]:
    """Run the pipeline, require exit 0; (the process, its MLflow run id)."""
    proc = run_pipeline(args, env)
    assert proc.returncode == 0, error_lines(proc.stdout + proc.stderr) + "\n---\n" + proc.stdout[-4000:] + \
        proc.stderr[-4000:]
    return proc, run_id_from(proc.stdout)


def error_lines(output: str) -> str:
    """Each distinct `<Name>Error: ...` line of a run's output (its workers' too), in order: every error of every
    attempt, where the output's tail shows only the last."""
    lines = (re.sub(r"\x1b\[[0-9;]*m|\(\w+ pid=\d+\)", "", line).strip() for line in output.splitlines()
             if re.search(r"\w+(Error|Exception): ", line))
    return "\n".join(list(dict.fromkeys(lines))[:40])


def check_finished_run(client: Any, run_id: str, backend: str, epochs: int) -> str:
    """The run contract every backend keeps: FINISHED, every epoch metric once per epoch, the loss going down,
    where the start-up went, one model logged, linked to the metrics of the epoch it holds. Returns the logged
    model's URI."""
    import mlflow

    from contract.metrics import EPOCH_METRICS
    from contract.startup import STARTUP_PARTS, STARTUP_TOTAL
    from contract.tracking import epoch_values

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["backend"] == backend
    parts = [run.data.metrics[name] for name in STARTUP_PARTS]  # logged once, by the first attempt's rank 0
    assert min(parts) >= 0 and sum(parts) == pytest.approx(run.data.metrics[STARTUP_TOTAL]), parts
    for name in EPOCH_METRICS:
        assert sorted(m.step for m in client.get_metric_history(run_id, name)) == list(range(1, epochs + 1)), name
    losses = [m.value for m in sorted(client.get_metric_history(run_id, "train_loss"), key=lambda m: m.step)]
    assert losses[-1] < losses[0], losses
    mlflow.set_tracking_uri(client.tracking_uri)
    models = mlflow.search_logged_models(experiment_ids=[run.info.experiment_id],
                                         filter_string=f"source_run_id = '{run_id}'", output_format="list")
    assert len(models) == 1
    epoch = int(run.data.tags["final_model_epoch"])
    linked = {m.key: m.value for m in models[0].metrics or []}  # what the logged model's page shows
    for name in EPOCH_METRICS:
        assert linked[name] == epoch_values(client.get_metric_history(run_id, name))[epoch - 1], name
    return models[0].model_uri


def metric_steps(client: Any, run_id: str, name: str) -> list[int]:
    """The steps (epochs) at which a metric was logged, sorted."""
    return sorted(m.step for m in client.get_metric_history(run_id, name))


def check_step_losses_are_global(client: Any, run_id: str, epochs: int) -> None:
    """A run logged with `trainer.log_every_n_steps=1` on workers that read different rows, epochs of equal batches:
    each step's loss is the global batch's mean, so an epoch's step losses average to its train_loss (the loss
    summed over every worker). A worker's own loss logged instead would not."""
    from contract.tracking import epoch_values

    steps = sorted(client.get_metric_history(run_id, "step_loss"), key=lambda m: m.step)
    per_epoch = len(steps) // epochs
    assert [m.step for m in steps] == list(range(1, epochs * per_epoch + 1))
    train_loss = epoch_values(client.get_metric_history(run_id, "train_loss"))
    for epoch in range(epochs):
        losses = [m.value for m in steps[epoch * per_epoch:(epoch + 1) * per_epoch]]
        assert np.mean(losses) == pytest.approx(train_loss[epoch], rel=1e-5), epoch + 1
