"""Score a logged MLflow model over prepared Parquet shards with Ray Data, and sum up the scores.

`ModelScorer` is the `map_batches` callable: each actor loads the model once (pyfunc, so PyTorch and tf-keras
models alike) and returns the logits of every row. `summarise` turns labels and logits into the evaluation
metrics, and `save_plots` draws them (sklearn's displays, matplotlib files).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from contract.data import FEATURE_COLUMNS, model_input

# A scoring actor's environment: tf-keras models load only with TF_USE_LEGACY_KERAS=1 from process start
# (trainers/tf_common.py); harmless for PyTorch models.
SCORER_ENV = {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}


class ModelScorer:
    """Ray Data `map_batches` callable: rows with the dataset's feature column -> the other columns as they came
    (labels, row numbers) and `logits` [B, classes]."""

    def __init__(self, model_uri: str, tracking_uri: str, dataset: str, threads: int = 1):
        import mlflow

        mlflow.set_tracking_uri(tracking_uri)
        self.model = mlflow.pyfunc.load_model(model_uri)
        self.dataset = dataset
        # The model's own input dtype (token ids: int64 for PyTorch, int32 for Keras); pyfunc enforces it.
        self.dtype = self.model.metadata.get_input_schema().numpy_types()[0]
        flavors = self.model.metadata.flavors
        if "pytorch" in flavors:
            import torch

            torch.set_num_threads(threads)
        if "tensorflow" in flavors:
            import tf_keras

            tf_keras.utils.disable_interactive_logging()  # no progress bar per batch in the driver's log

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        column = FEATURE_COLUMNS[self.dataset]
        features = model_input(self.dataset, batch[column]).astype(self.dtype, copy=False)
        logits = np.asarray(self.model.predict(features), dtype=np.float64)
        return {**{name: values for name, values in batch.items() if name != column}, "logits": logits}


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


def save_plots(labels: np.ndarray, logits: np.ndarray, confusion: np.ndarray, folder: Path) -> list[Path]:
    """The confusion matrix, and for two classes the ROC and precision-recall curves, as PNG files."""
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

    paths = [save(skm.ConfusionMatrixDisplay(confusion).plot(colorbar=False), "confusion_matrix.png")]
    if logits.shape[1] == 2:
        positive = softmax(logits, axis=1)[:, 1]
        paths.append(save(skm.RocCurveDisplay.from_predictions(labels, positive), "roc_curve.png"))
        paths.append(save(skm.PrecisionRecallDisplay.from_predictions(labels, positive), "pr_curve.png"))
    return paths


def score(ds: Any, model_uri: str, tracking_uri: str, dataset: str, batch_size: int, concurrency: int,
          use_gpu: bool, key: str = "label") -> tuple[np.ndarray, np.ndarray]:
    """(`key` column, logits) of every row of the Ray Dataset `ds`, scored by `concurrency` model-holding
    actors."""
    from ray.data import ActorPoolStrategy

    scored = ds.map_batches(ModelScorer, fn_constructor_args=(model_uri, tracking_uri, dataset),
                            batch_size=batch_size, batch_format="numpy", compute=ActorPoolStrategy(size=concurrency),
                            num_cpus=1, num_gpus=1 if use_gpu else 0, runtime_env={"env_vars": SCORER_ENV})
    keys, logits = [], []
    for batch in scored.iter_batches(batch_size=None, batch_format="numpy"):
        keys.append(batch[key])
        logits.append(np.stack(batch["logits"]) if batch["logits"].dtype == object else batch["logits"])
    return np.concatenate(keys), np.concatenate(logits)
