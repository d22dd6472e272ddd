"""Fit one backend's trainer on the prepared data and log its final model: the one path a training run
(`pipelines.train`) and every sweep trial (`pipelines.sweep`) take."""
from __future__ import annotations

from typing import Any, Mapping

from omegaconf import DictConfig

from contract.metrics import STOP_METRICS
from pipelines.data.shards import read_manifest


def fit_backend(cfg: DictConfig, run_id: str, uri: str, callbacks: list | None = None) -> str | None:
    """Build the backend's Ray Train trainer over the Parquet shards, fit it, and log the final model to the MLflow
    run. Returns where the run stopped ("epoch E step S") when it stopped on request (no model is logged then:
    the checkpoint holds a half-done epoch), else None. `callbacks`: e.g. Tune's TuneReportCallback."""
    from pipelines.data.readers import model_inputs, parquet_datasets
    from trainers import get_backend

    backend = get_backend(cfg.trainer.backend)
    datasets = parquet_datasets(cfg.data.path, {"train": "train", "eval": cfg.data.eval_split})
    inputs = model_inputs(read_manifest(cfg.data.path))
    result = backend.build_trainer(cfg, datasets, run_id, uri, inputs, callbacks=callbacks).fit()
    if result.checkpoint is None:
        raise RuntimeError("training ended without a checkpoint")
    stopped = stopped_at(result.metrics)
    if stopped is None:
        backend.log_final_model(uri, run_id, cfg, result.checkpoint, inputs)
    return stopped


def stopped_at(metrics: Mapping[str, Any] | None) -> str | None:
    """"epoch E step S" when a report carries the loop's stop metrics (contract/metrics.py), else None."""
    if not metrics or not metrics.get(STOP_METRICS[0]):
        return None
    epoch, step = (metrics[name] for name in STOP_METRICS)
    return f"epoch {epoch:g} step {step:g}"
