"""Evaluate a trained model on a prepared split: `python -m pipelines.evaluate model=<model> [key=value ...]`.

`model`: a training run id, `runs:/<run id>/model`, `models:/<name>/<version>`, `models:/<name>@<alias>` or
`models:/<model id>`. Keys (all optional): `data.path` and `data.split` (default: the training run's data and
evaluation split), `batch_size`, `concurrency` (scoring actors, one CPU each, or one GPU each with
`use_gpu=true`), `experiment` (default: the training run's).

Ray Data reads the split's Parquet shards and scores them with actors that each load the MLflow model once
(pipelines/scoring.py). A new MLflow run gets, for a classifier, `<split>_accuracy`, `<split>_loss` and
`<split>_rows` (also linked to the logged model), for two classes `<split>_roc_auc` and
`<split>_average_precision`, the confusion matrix (PNG and CSV, rows and columns in the order of the class names
on its first line) and, for two classes, the ROC and precision-recall curves; for a regression `<split>_mse`,
`<split>_mae`, `<split>_r2`, `<split>_rows` and a plot of the predictions against the targets. Tag and param
`training_run_id` link it to the run that trained the model. Uses the cluster at RAY_ADDRESS when set, else
starts a local Ray.

Last stdout line: `mlflow_run_id=<id>` (the evaluation run).
"""
from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
from omegaconf import OmegaConf

from contract import resume, tracking
from contract.data import DataSchema
from pipelines.config import ConfigError
from pipelines.help import dataclass_help, wants_help
from pipelines.data import data_schema
from pipelines.data.shards import dataset_refs, read_manifest, shard_paths
from pipelines.ray_session import shutdown_ray
from pipelines.scoring_cli import USAGE_ERRORS, ScoringConfig, find_model, init_ray, parse_args, plan_before_start
from pipelines.train import close_failed_run

EXIT_CODES = ("0 done; 1 scoring failed (the run is FAILED, or KILLED when interrupted); 2 bad arguments, model, "
              "data or tracking server (nothing was started)")


@dataclass
class EvalData:
    path: Optional[str] = None  # default: the training run's data.path
    split: Optional[str] = None  # default: the training run's data.eval_split


@dataclass
class EvaluateConfig(ScoringConfig):
    data: EvalData = field(default_factory=EvalData)  # the split scored
    experiment: Optional[str] = None  # MLflow experiment of the evaluation run; default: the training run's


@dataclass
class Plan:
    """What was resolved before anything starts."""
    cfg: Any
    model_uri: str
    model_id: Optional[str]
    training_run: Any  # mlflow Run, or None for a model logged outside a run
    schema: DataSchema
    data_path: str
    split: str
    shards: list[str]


def parse(argv: list[str]) -> Any:
    return parse_args(EvaluateConfig, argv)


def resolve(cfg: Any, uri: str) -> Plan:
    """The model, the run that trained it and the data to score, all checked; raises ConfigError/DataError."""
    model_uri, info, training_run = find_model(cfg.model, uri)
    trained_on = training_run.data.params if training_run else {}
    data_path = cfg.data.path or trained_on.get("data.path")
    split = cfg.data.split or trained_on.get("data.eval_split")
    if not data_path or not split:
        raise ConfigError(f"data.path, data.split: {model_uri} was not logged by a training run of ours (which "
                          "names its data); give both")
    manifest = read_manifest(data_path)
    shards = shard_paths(data_path, manifest, split)
    schema = data_schema(manifest)
    if trained_on.get("data.name", schema.dataset) != schema.dataset:
        raise ConfigError(f"data.path: {data_path} holds {schema.dataset}, the model was trained on "
                          f"{trained_on['data.name']}")
    width = schema.max_len or schema.features.width
    expected = info.signature.inputs.inputs[0].shape[-1]
    if expected != width:
        raise ConfigError(f"data.path: {data_path} has {width} features per row, the model takes {expected}")
    return Plan(cfg, model_uri, info.model_id, training_run, schema, data_path, split, shards)


def open_run(plan: Plan, uri: str) -> str:
    import mlflow

    client = mlflow.MlflowClient(uri)
    run = plan.training_run
    experiment = plan.cfg.experiment or (client.get_experiment(run.info.experiment_id).name if run
                                         else "evaluate")
    trained = {"training_run_id": run.info.run_id} if run else {}
    name = f"evaluate-{run.info.run_name if run else plan.schema.dataset}-{plan.split}"
    params = {"model_uri": plan.model_uri, "model_id": plan.model_id or "", "data.path": plan.data_path,
              "data.split": plan.split, "data.name": plan.schema.dataset, "batch_size": plan.cfg.batch_size,
              "concurrency": plan.cfg.concurrency, "use_gpu": plan.cfg.use_gpu, **trained}
    run_id = tracking.start_run(uri, experiment, name, params, OmegaConf.to_yaml(plan.cfg),
                                tags={"model_uri": plan.model_uri, **trained})
    with tracking.ended_on_error(uri, run_id):
        tracking.log_dataset_inputs(uri, run_id, dataset_refs(plan.data_path, read_manifest(plan.data_path),
                                                              {"evaluation": plan.split}))
    return run_id


def evaluate_into_run(plan: Plan, uri: str, run_id: str) -> dict[str, float]:
    """Score the split on the connected Ray and log metrics and plots to the run; returns the metrics."""
    import mlflow

    from pipelines.data.readers import read_parquet
    from pipelines.scoring import save_plots, score, summarise, summarise_regression

    ds = read_parquet(plan.shards)
    target = plan.schema.target
    labels, logits = score(ds, plan.model_uri, uri, plan.schema, plan.cfg.batch_size, plan.cfg.concurrency,
                           plan.cfg.use_gpu, key=target.column)
    if target.task == "regression":
        metrics, confusion = summarise_regression(labels.astype(np.float64), logits, plan.split), None
    else:
        labels = labels.astype(np.int64)
        metrics, confusion = summarise(labels, logits, plan.split)
    client = mlflow.MlflowClient(uri)
    for name, value in metrics.items():  # linked to the logged model too: its page in the UI lists them
        client.log_metric(run_id, name, value, model_id=plan.model_id)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        files = save_plots(labels, logits, confusion, folder, target.classes)
        if confusion is not None:
            np.savetxt(folder / "confusion_matrix.csv", confusion, fmt="%d", delimiter=",",
                       header=",".join(target.classes))  # "# <class names>": a comment to np.loadtxt
            files.insert(0, folder / "confusion_matrix.csv")
        for path in files:
            client.log_artifact(run_id, str(path))
    return metrics


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(dataclass_help("rtp evaluate model=<model> [KEY=VALUE ...]", __doc__.split("\n\n")[1].strip(),
                             EvaluateConfig, EXIT_CODES,
                             ["rtp evaluate model=<training run id>", "rtp evaluate model=models:/mnist-cnn@champion "
                              "data.split=test concurrency=2"]))
        return 0
    try:
        cfg, uri, plan = plan_before_start(argv, parse, resolve)
    except USAGE_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    run_id = open_run(plan, uri)
    print(f"MLflow run {run_id} ({uri}): scoring {plan.model_uri} on {plan.data_path} split {plan.split}",
          flush=True)
    code = 0
    try:
        init_ray(cfg.concurrency, cfg.verbose)
        # `ray job stop`, `kill`: the run ends KILLED, as after Ctrl-C. After Ray's start, whose own SIGTERM handler
        # would end the process at once.
        resume.raise_on_sigterm()
        metrics = evaluate_into_run(plan, uri, run_id)
        tracking.end_run(uri, run_id)
        print(" ".join(f"{name}={value:.6g}" for name, value in metrics.items()), flush=True)
    except BaseException as err:  # interrupts too: the run must not stay RUNNING
        print(close_failed_run(uri, run_id, err, "evaluation"), file=sys.stderr)
        code = 1
    finally:
        shutdown_ray()
    sys.stdout.write(f"mlflow_run_id={run_id}\n")  # after the shutdown: no worker log line inside it
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
