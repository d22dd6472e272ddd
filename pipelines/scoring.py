"""Score a logged MLflow model over prepared Parquet shards with Ray Data, and sum up the scores.

`ModelScorer` is the `map_batches` callable: each actor loads the model once (PyTorch models onto its device,
tf-keras models through pyfunc) and returns the outputs of every row (logits, or a regression's predictions).
`summarise` turns labels and outputs into the evaluation metrics of the task, and `save_plots` draws them
(sklearn's displays, matplotlib files).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from contract import tracking
from contract.console import import_tensorflow, quiet_keras_predict, say
from contract.data import DataSchema

# A scoring actor's environment: tf-keras models load only with TF_USE_LEGACY_KERAS=1 from process start
# (trainers/tf/adapter.py); harmless for PyTorch models.
SCORER_ENV = {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}

# Passes of `score` in all: one, and another for each actor that dies while scoring, within this bound (a batch
# that kills every actor that scores it fails the scoring instead of being retried forever).
SCORING_PASSES = 3


class ModelScorer:
    """Ray Data `map_batches` callable: rows with the dataset's feature column -> the other columns as they came
    (labels, row numbers) and `logits` [B, classes] (a regression's [B, 1] predictions). `schema`: the data's
    (`DataSchema.to_dict()`). PyTorch models run on `device` ("cuda" in a GPU actor)."""

    def __init__(self, model_uri: str, tracking_uri: str, schema: dict, device: str = "cpu", threads: int = 1):
        import mlflow

        mlflow.set_tracking_uri(tracking_uri)
        info = mlflow.models.get_model_info(model_uri)
        self.features = DataSchema.from_dict(schema).features
        # The model's own input dtype (token ids: int64 for PyTorch, int32 for Keras), as pyfunc enforces it.
        self.dtype = info.signature.inputs.numpy_types()[0]
        if "pytorch" in info.flavors:
            import torch

            torch.set_num_threads(threads)
            self.predict = torch_predictor(model_uri, info.flavors["pytorch"], device)
        elif "tensorflow" in info.flavors:
            self.predict = keras_predictor(model_uri)
        else:
            self.predict = mlflow.pyfunc.load_model(model_uri).predict

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        column = self.features.column
        features = self.features.model_input(batch[column]).astype(self.dtype, copy=False)
        logits = np.asarray(self.predict(features), dtype=np.float64).reshape(len(features), -1)
        return {**{name: values for name, values in batch.items() if name != column}, "logits": logits}


def keras_predictor(model_uri: str) -> Callable[[np.ndarray], np.ndarray]:
    """The logged tf-keras model's pyfunc `predict`, without a progress line per batch in the driver's log."""
    import mlflow

    import_tensorflow()  # with its start-up lines filtered
    import tf_keras

    model = mlflow.pyfunc.load_model(model_uri)

    def predict(features: np.ndarray) -> np.ndarray:
        quiet_keras_predict(tf_keras)  # in the thread that predicts: tf-keras keeps the setting per thread
        return model.predict(features)
    return predict


def torch_predictor(model_uri: str, flavor: dict[str, Any], device: str) -> Callable[[np.ndarray], np.ndarray]:
    """The logged PyTorch model (a `torch.export` program, MLflow's pt2 format) as features -> logits on `device`.
    Not through pyfunc: MLflow loads a pt2 model only on the device it was exported on (the driver's CPU) and
    refuses a GPU; torch's `move_to_device_pass` rewrites the program, weights and device constants alike."""
    import mlflow
    import torch
    from torch.export.passes import move_to_device_pass

    folder = Path(mlflow.artifacts.download_artifacts(model_uri)) / flavor["model_data"]
    module = move_to_device_pass(torch.export.load(folder / "model.pt2"), device).module()

    @torch.no_grad()
    def predict(features: np.ndarray) -> np.ndarray:
        return module(torch.from_numpy(features).to(device)).float().cpu().numpy()
    return predict


def summarise_regression(targets: np.ndarray, outputs: np.ndarray, split: str) -> dict[str, float]:
    """Metrics named `<split>_<metric>` of a regression's predictions ([N, 1]): mse, mae, r2, rows."""
    from sklearn import metrics as skm

    predicted = outputs.reshape(len(targets))
    scores = {"mse": skm.mean_squared_error(targets, predicted), "mae": skm.mean_absolute_error(targets, predicted),
              "r2": skm.r2_score(targets, predicted), "rows": len(targets)}
    return {f"{split}_{name}": float(value) for name, value in scores.items()}


def summarise(labels: np.ndarray, logits: np.ndarray, split: str) -> tuple[dict[str, float], np.ndarray]:
    """(metrics named `<split>_<metric>`, confusion matrix [true, predicted]) of the rows' labels and logits.
    Two classes add ROC AUC and average precision of the positive class (label 1)."""
    from scipy.special import softmax
    from sklearn import metrics as skm

    classes = np.arange(logits.shape[1])
    probs = softmax(logits, axis=1)
    predicted = logits.argmax(axis=1)
    scores = {"accuracy": skm.accuracy_score(labels, predicted),
              "loss": skm.log_loss(labels, probs, labels=classes),
              "rows": len(labels)}
    if len(classes) == 2:
        scores["roc_auc"] = skm.roc_auc_score(labels, probs[:, 1])
        scores["average_precision"] = skm.average_precision_score(labels, probs[:, 1])
    confusion = skm.confusion_matrix(labels, predicted, labels=classes)
    return {f"{split}_{name}": float(value) for name, value in scores.items()}, confusion


def save_plots(labels: np.ndarray, logits: np.ndarray, confusion: np.ndarray | None, folder: Path,
               class_names: tuple[str, ...] = ()) -> list[Path]:
    """The confusion matrix (its axes named by `class_names`), and for two classes the ROC and precision-recall
    curves, as PNG files; for a regression (`confusion` None) the predictions against the targets."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on cluster nodes
    import matplotlib.pyplot as plt
    from scipy.special import softmax
    from sklearn import metrics as skm

    def save(display: Any, name: str) -> Path:
        display.figure_.tight_layout()
        path = folder / name
        display.figure_.savefig(path, dpi=100)
        plt.close(display.figure_)
        return path

    if confusion is None:
        display = skm.PredictionErrorDisplay.from_predictions(labels, logits.reshape(len(labels)),
                                                              kind="actual_vs_predicted")
        return [save(display, "prediction_error.png")]
    names = list(class_names) if len(class_names) == len(confusion) else None
    paths = [save(skm.ConfusionMatrixDisplay(confusion, display_labels=names).plot(colorbar=False),
                  "confusion_matrix.png")]
    if logits.shape[1] == 2:
        positive = softmax(logits, axis=1)[:, 1]
        paths.append(save(skm.RocCurveDisplay.from_predictions(labels, positive), "roc_curve.png"))
        paths.append(save(skm.PrecisionRecallDisplay.from_predictions(labels, positive), "pr_curve.png"))
    return paths


def score(ds: Any, model_uri: str, tracking_uri: str, schema: DataSchema, batch_size: int, concurrency: int,
          use_gpu: bool, key: str = "label") -> tuple[np.ndarray, np.ndarray]:
    """(`key` column, logits) of every row of the Ray Dataset `ds`, scored by `concurrency` model-holding
    actors. An actor that dies while scoring (its process killed: out of memory, its node lost) fails the pass,
    and fresh actors score all the rows again, up to `SCORING_PASSES` passes: a row's scores do not depend on the
    pass. An error raised by a scorer's constructor (a model that cannot load) fails the scoring at once."""
    import ray
    from ray.data import ActorPoolStrategy

    device = "cuda" if use_gpu else "cpu"
    scored = map_batches_without_restarts(
        ds, ModelScorer, fn_constructor_args=(model_uri, tracking_uri, schema.to_dict(), device),
        batch_size=batch_size, batch_format="numpy", compute=ActorPoolStrategy(size=concurrency), num_cpus=1,
        num_gpus=1 if use_gpu else 0, runtime_env={"env_vars": SCORER_ENV})
    for scoring_pass in range(1, SCORING_PASSES):
        try:
            return scored_rows(scored, key)
        except ray.exceptions.RayActorError as err:
            if err.actor_init_failed:
                raise
            say(f"a Ray Data actor died while scoring ({type(err).__name__}); scoring the rows again, pass "
                f"{scoring_pass + 1} of at most {SCORING_PASSES}")
    return scored_rows(scored, key)


def map_batches_without_restarts(ds: Any, fn: type, **options: Any) -> Any:
    """`ds.map_batches(fn, **options)` (`fn` a callable class) with actors that Ray does not restart
    (`max_restarts` 0): `score` scores again instead. Ray Data's actors otherwise restart without end (its default
    max_restarts -1) and take their constructor arguments from the object store (the callable with its
    arguments, and the DataContext, which Ray Data puts there), and Ray Core then logs an error-level line when the
    driver creates the first ("... has constructor arguments in the object store and max_restarts > 0",
    ray-project/ray#57733). Ray 2.60 takes `max_restarts` only through map_batches' `**ray_remote_args`, which it
    deprecates with a warning (to be removed in Ray 2.64; the named options replacing them, ray-project/ray#65227,
    have none for it): that warning, about this call alone, is not shown."""
    import warnings

    from ray.util.annotations import RayDeprecationWarning

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated", category=RayDeprecationWarning)
        return ds.map_batches(fn, max_restarts=0, **options)


def scored_rows(scored: Any, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(`key` column, logits) of one pass over the scored Ray Dataset."""
    keys, logits = [], []
    for batch in scored.iter_batches(batch_size=None, batch_format="numpy"):
        keys.append(batch[key])
        logits.append(np.stack(batch["logits"]) if batch["logits"].dtype == object else batch["logits"])
    return np.concatenate(keys), np.concatenate(logits)


def held_out_test_metrics(uri: str, run_id: str, data_path: str, eval_split: str, schema: DataSchema,
                          batch_size: int = 256) -> dict[str, float]:
    """The run's logged model scored once on the data's `test` split, when its epochs were evaluated on another
    (validation): `final_test_accuracy`, `final_test_loss`, ... (`final_test_mse`, ... for regression), logged to
    the run and linked to its model. Nothing when the test split was the evaluation split, or there is none."""
    from pipelines.data.readers import read_parquet
    from pipelines.data.shards import read_manifest, shard_paths

    manifest = read_manifest(data_path)
    if eval_split == "test" or "test" not in manifest["splits"]:
        return {}
    models = tracking.logged_models(uri, run_id)
    if not models:
        return {}
    target = schema.target
    ds = read_parquet(shard_paths(data_path, manifest, "test"))
    labels, logits = score(ds, models[0].model_uri, uri, schema, batch_size, 1, False, key=target.column)
    if target.task == "regression":
        metrics = summarise_regression(labels.astype(np.float64), logits, "final_test")
    else:
        metrics = summarise(labels.astype(np.int64), logits, "final_test")[0]
    client = tracking.mlflow_client(uri)
    for name, value in metrics.items():
        client.log_metric(run_id, name, value, model_id=models[0].model_id)
    return metrics
