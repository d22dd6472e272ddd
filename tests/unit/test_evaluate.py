"""Evaluation without Ray: the metrics against direct computations, the scoring actor's callable on real logged
PyTorch models (a local sqlite MLflow store) against the models themselves, the options of the scoring actors and
the passes over the rows when one dies, and bad input: one line, exit 2, no evaluation run. The whole path through
Ray Data and a tracking server is end to end (tests/integration/test_ddp_pipeline.py for PyTorch, test_tf_mwms.py
for tf-keras)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from contract.data import PAD_ID
from pipelines.data.imdb import imdb_schema
from pipelines.data.mnist import mnist_schema
from contract.tracking.models import mlflow_pytorch
from pipelines import evaluate
from pipelines.scoring import SCORING_PASSES, ModelScorer, save_plots, score, summarise, summarise_regression
from trainers.models.bert import BertClassifier, BertConfig
from trainers.models.mlp_cnn import MLP
from trainers.torch.backend import example_input, logged_form
from trainers.torch.data import BatchInputs


pytestmark = pytest.mark.usefixtures("one_torch_thread")
REPO = Path(__file__).resolve().parents[2]


def test_metrics_match_direct_computation(tmp_path):
    rng = np.random.default_rng(0)
    logits, labels = rng.normal(size=(200, 10)) * 3, rng.integers(0, 10, size=200)
    metrics, confusion = summarise(labels, logits, "test")
    predicted = logits.argmax(axis=1)
    assert metrics["test_accuracy"] == pytest.approx(np.mean(predicted == labels))
    expected_loss = F.cross_entropy(torch.from_numpy(logits), torch.from_numpy(labels)).item()
    assert metrics["test_loss"] == pytest.approx(expected_loss, rel=1e-9)
    assert metrics["test_rows"] == 200 and "test_roc_auc" not in metrics
    for true in range(10):
        for guess in range(10):
            assert confusion[true, guess] == np.sum((labels == true) & (predicted == guess))
    assert [p.name for p in save_plots(labels, logits, confusion, tmp_path)] == ["confusion_matrix.png"]

    # Two classes: ranking metrics of the positive class. Positives scored above every negative: AUC 1; the
    # reverse order: 0.
    labels = np.array([0, 0, 1, 1, 1])
    separable = np.stack([np.zeros(5), np.array([-2.0, -1.0, 1.0, 2.0, 3.0])], axis=1)
    metrics, _ = summarise(labels, separable, "validation")
    assert metrics["validation_roc_auc"] == 1.0 and metrics["validation_average_precision"] == 1.0
    assert summarise(labels, -separable, "validation")[0]["validation_roc_auc"] == 0.0
    plots = save_plots(labels, separable, np.eye(2, dtype=int), tmp_path)
    assert [p.name for p in plots] == ["confusion_matrix.png", "roc_curve.png", "pr_curve.png"]
    assert all(p.stat().st_size > 1000 for p in plots)


def test_regression_metrics_match_direct_computation(tmp_path):
    rng = np.random.default_rng(0)
    targets = rng.normal(size=50) * 3 + 5
    outputs = (targets + rng.normal(size=50))[:, None]  # [N, 1], as a regression model gives them
    metrics = summarise_regression(targets, outputs, "test")
    errors = outputs[:, 0] - targets
    assert metrics["test_mse"] == pytest.approx(np.mean(errors ** 2))
    assert metrics["test_mae"] == pytest.approx(np.mean(np.abs(errors)))
    assert metrics["test_r2"] == pytest.approx(1 - np.sum(errors ** 2) / np.sum((targets - targets.mean()) ** 2))
    assert metrics["test_rows"] == 50
    assert [p.name for p in save_plots(targets, outputs, None, tmp_path)] == ["prediction_error.png"]


def test_features_are_scaled_as_the_workers_do():
    """What a logged model is given (contract/data.py) is what the PyTorch workers feed: MNIST's normalised
    pixels, and numeric values standardised with one mean and std per column."""
    images = np.random.default_rng(0).integers(0, 256, size=(4, 784)).astype(np.uint8)
    (fed,), _, _ = BatchInputs(mnist_schema())({"image": torch.from_numpy(images), "label": torch.zeros(4)})
    torch.testing.assert_close(torch.from_numpy(mnist_schema().features.model_input(images)), fed)
    from dataclasses import replace

    schema = mnist_schema()
    numeric = replace(schema, features=replace(schema.features, kind="numeric", shape=(3,), mean=(1.0, 2.0, 3.0),
                                                std=(2.0, 4.0, 8.0)))
    values = np.random.default_rng(1).normal(size=(5, 3)).astype(np.float32)
    (fed,), _, _ = BatchInputs(numeric)({"image": torch.from_numpy(values), "label": torch.zeros(5)})
    expected = (values - np.array([1.0, 2.0, 3.0])) / np.array([2.0, 4.0, 8.0])
    torch.testing.assert_close(fed, torch.from_numpy(expected.astype(np.float32)))
    torch.testing.assert_close(torch.from_numpy(numeric.features.model_input(values)), fed)


def log_model(uri: str, model: torch.nn.Module, example: np.ndarray, params: dict) -> str:
    import mlflow

    mlflow.set_tracking_uri(uri)
    with mlflow.start_run() as run:
        mlflow.log_params(params)
        mlflow_pytorch().log_model(model, name="model", input_example=example,
                                   pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"])
    return run.info.run_id


def test_logging_a_pytorch_model_leaves_lightning_unimported_and_importable():
    """MLflow's PyTorch flavour, as the driver imports it, skips MLflow's Lightning autologging (seconds of imports
    for nothing), and Lightning still imports afterwards."""
    pytest.importorskip("pytorch_lightning")
    check = ("import sys; from contract.tracking.models import mlflow_pytorch; flavour = mlflow_pytorch(); "
             "print('pytorch_lightning' in sys.modules, callable(flavour.log_model)); "
             "import pytorch_lightning; print(hasattr(pytorch_lightning, 'Trainer'))")
    proc = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "True", "True"], proc.stdout


class MaskRequired(torch.nn.Module):
    """A token model whose `forward` needs the mask training passes (a user's may): the BERT with it."""

    def __init__(self, bert: BertClassifier):
        super().__init__()
        self.bert = bert

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.bert(ids, mask)


def log_unsigned_model(uri: str) -> str:
    """A pyfunc model logged without an input example: no signature."""
    import mlflow

    class Doubles(mlflow.pyfunc.PythonModel):
        def predict(self, context, model_input):
            return model_input * 2

    mlflow.set_tracking_uri(uri)
    with mlflow.start_run() as run:
        mlflow.pyfunc.log_model(name="model", python_model=Doubles(), pip_requirements=[])
    return run.info.run_id


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> dict:
    """A local sqlite store holding two runs, each with a logged model in the form the backends log it
    (`logged_form`): an MNIST MLP and an IMDb BERT that needs its mask; and a third model, without a signature."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('evaluate')}/mlflow.db"
    torch.manual_seed(0)
    mlp = MLP(hidden=[16]).eval()
    bert = BertClassifier(BertConfig(vocab_size=40, max_len=8, hidden=16, layers=1, heads=2, dropout=0.0)).eval()
    imdb = imdb_schema(40, 8)
    return {"uri": uri,
            "mnist": (log_model(uri, logged_form(mlp, mnist_schema()), example_input(mnist_schema()),
                                {"data.name": "mnist"}), mlp),
            "imdb": (log_model(uri, logged_form(MaskRequired(bert), imdb), example_input(imdb),
                               {"data.name": "imdb"}), bert),
            "unsigned": log_unsigned_model(uri)}


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_scorer_gives_the_models_logits(logged, device):
    """The MNIST MLP scores shard rows (uint8 images) as the workers' normalised input; the BERT, called with
    the ids alone, scores padded token ids as training's explicit mask does. In a GPU actor (`use_gpu=true`) the
    models, logged from the CPU, run on the GPU and give the same logits up to float32 rounding (other kernels)."""
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if device == "cuda" else {}
    run_id, mlp = logged["mnist"]
    images = np.random.default_rng(1).integers(0, 256, size=(8, 784)).astype(np.uint8)
    scorer = ModelScorer(f"runs:/{run_id}/model", logged["uri"], mnist_schema().to_dict(), device)
    scored = scorer({"image": images, "label": np.arange(8)})
    with torch.no_grad():
        expected = mlp(torch.from_numpy(mnist_schema().features.model_input(images)))
    torch.testing.assert_close(torch.from_numpy(scored["logits"]), expected.double(), **tolerance)
    assert scored["label"].tolist() == list(range(8))

    run_id, bert = logged["imdb"]
    lengths = torch.tensor([8, 3, 5])
    mask = torch.arange(8) < lengths[:, None]
    ids = torch.randint(1, 40, (3, 8)).masked_fill(~mask, PAD_ID).int()  # as stored: int32
    column = np.empty(3, dtype=object)
    column[:] = list(ids.numpy())  # fixed-size lists arrive as an object array of rows
    scorer = ModelScorer(f"runs:/{run_id}/model", logged["uri"], imdb_schema(40, 8).to_dict(), device)
    scored = scorer({"input_ids": column, "label": np.zeros(3)})
    with torch.no_grad():
        expected = bert(ids.long(), mask)
    torch.testing.assert_close(torch.from_numpy(scored["logits"]), expected.double(), **tolerance)


class ScoredRows:
    """A Ray Dataset as `score` uses it, without Ray: `map_batches` is Ray Data's own (its checks and warnings on
    the options), recording what it would build; each pass of `iter_batches` yields the batches `passes` gives it,
    or raises the error there."""

    def __init__(self, passes: list):
        import ray.data

        self.passes, self.options = list(passes), {}
        self.map_batches = ray.data.Dataset.map_batches.__get__(self)

    def map_batches_internal(self, fn: type, **options) -> "ScoredRows":
        self.options = {"fn": fn, **options}
        return self

    def iter_batches(self, **kwargs):
        outcome = self.passes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        yield from outcome


def test_scoring_actors_are_not_restarted_and_a_lost_pass_is_scored_again(capsys):
    """Ray Data's actors restart by default, and Ray Core then logs an error-level line naming the scorer when the
    first is made ("... has constructor arguments in the object store and max_restarts > 0",
    ray-project/ray#57733): the scorers are made with max_restarts 0, and without Ray's deprecation warning for
    the option. An actor that dies fails the pass, and the rows are scored again, up to SCORING_PASSES passes; a
    scorer whose constructor raised (a model that cannot load) fails the scoring at once."""
    import warnings

    from ray.data import ActorPoolStrategy
    from ray.exceptions import ActorDiedError, RayActorError

    batches = [{"label": np.arange(3), "logits": np.eye(3, 2)}, {"label": np.arange(3, 5), "logits": np.ones((2, 2))}]
    ds = ScoredRows([ActorDiedError(), batches])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Ray's deprecation warning for `max_restarts` would fail here
        labels, logits = score(ds, "runs:/r/model", "sqlite:///m.db", mnist_schema(), 16, 2, False)
    assert ds.options["fn"] is ModelScorer and ds.options["max_restarts"] == 0
    assert isinstance(ds.options["compute"], ActorPoolStrategy) and ds.options["compute"].max_size == 2
    assert labels.tolist() == [0, 1, 2, 3, 4] and logits.shape == (5, 2) and not ds.passes
    assert "scoring the rows again, pass 2 of at most 3" in capsys.readouterr().out

    ds = ScoredRows([ActorDiedError()] * SCORING_PASSES)
    with pytest.raises(ActorDiedError):
        score(ds, "runs:/r/model", "sqlite:///m.db", mnist_schema(), 16, 1, False)
    assert not ds.passes
    ds = ScoredRows([RayActorError(actor_init_failed=True), batches])
    with pytest.raises(RayActorError):
        score(ds, "runs:/r/model", "sqlite:///m.db", mnist_schema(), 16, 1, False)
    assert ds.passes == [batches]


@pytest.mark.parametrize("args, message", [
    (["model=abc", "bogus=1"], r"^error: bogus: Key 'bogus' not in 'EvaluateConfig'"),
    (["model='; DROP TABLE runs;--"], r"^error: model: not a readable value \(ScannerError\); quote it"),
    ([], r"^error: model: Missing mandatory value"),
    (["model=0123456789abcdef0123456789abcdef"],
     r"^error: model: runs:/0123456789abcdef0123456789abcdef/model: Run with id=\S+ not found"),
    (["model=models:/nope/1"], r"^error: model: models:/nope/1: Registered Model with name=nope not found"),
    (["model=MNIST_RUN", "data.path=MISSING", "data.split=test"], r"^error: \S+/missing/manifest.json: no manifest"),
    (["model=MNIST_RUN", "data.path=MNIST", "data.split=validation"], r"^error: \S+: no split 'validation'"),
    (["model=IMDB_RUN", "data.path=MNIST", "data.split=test"],
     r"^error: data.path: \S+ holds mnist, the model was trained on imdb"),
    (["model=MNIST_RUN", "data.path=MNIST", "data.split=test", "concurrency=64"],
     r"^error: concurrency: 64 scoring actors need"),
    (["model=MNIST_RUN"], r"^error: data.path, data.split: runs:/\S+ was not logged by a training run of ours"),
    (["model=UNSIGNED_RUN", "data.path=MNIST", "data.split=test"],
     r"^error: model: runs:/\S+ was logged without a signature \(log it with an input example"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, logged, tiny_mnist, tmp_path, monkeypatch, capsys):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", logged["uri"])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    names = {"MNIST_RUN": logged["mnist"][0], "IMDB_RUN": logged["imdb"][0], "UNSIGNED_RUN": logged["unsigned"],
             "MNIST": str(tiny_mnist), "MISSING": str(tmp_path / "missing")}
    args = [f"{key}={names.get(value, value)}" for key, value in (arg.split("=", 1) for arg in args)]
    mlflow.set_tracking_uri(logged["uri"])
    before = len(mlflow.search_runs(experiment_ids=["0"], output_format="list"))
    assert evaluate.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.match(message, err), err
    assert len(mlflow.search_runs(experiment_ids=["0"], output_format="list")) == before  # no evaluation run
