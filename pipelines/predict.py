"""Predict with a trained model on raw input:
`python -m pipelines.predict model=<model> input=<path> output=<file.parquet> [key=value ...]`.

`model`: as `pipelines.evaluate` takes it (a training run id, runs:/, models:/<name>/<version> or @<alias>); its
training run logged the manifest of its data, which says what the model takes. `input`: for image models an IDX
images file or a folder of image files (converted to the training images' size and colours), for text models a
.txt file (one text per line), a .csv/.parquet file with the training data's text column, or a folder of .txt files
(one text each; an aclImdb folder works), tokenised with the training data's tokenizer (logged with the training
run); for numeric features a .csv/.parquet file with the training data's feature columns. Ray Data tokenises and
scores the rows with `concurrency` actors that each load the model once (pipelines/scoring.py). `output`: a
Parquet file, one row per input row in input order: `source` (file, line or index), and for a classifier
`prediction` (class id), `label` (its name, as in the training data) and `probabilities`; for a regression
`prediction` (the predicted value). Uses the cluster at RAY_ADDRESS when set, else starts a local Ray.

Last stdout line: `predictions=<output>`.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from omegaconf import MISSING

from contract.console import one_line
from contract.data import DataSchema
from contract.registry import DATASETS, resolve
from pipelines.config import ConfigError
from pipelines.data.raw_inputs import read_images, read_numeric, read_texts
from pipelines.data import data_schema
from pipelines.help import dataclass_help, wants_help
from pipelines.ray_session import shutdown_ray
from pipelines.scoring_cli import USAGE_ERRORS, ScoringConfig, find_model, init_ray, parse_args, plan_before_start


EXIT_CODES = ("0 written; 1 scoring failed (nothing written); 2 bad arguments, model, input or tracking server "
              "(nothing was started)")


@dataclass
class PredictConfig(ScoringConfig):
    input: str = MISSING  # images: IDX file or folder; text: .txt/.csv/.parquet or folder; numeric: .csv/.parquet
    output: str = MISSING  # a .parquet file: one row per input row, in input order


@dataclass
class Plan:
    cfg: Any
    model_uri: str
    schema: DataSchema  # the training data's
    rows: pa.Table  # `row`, `source`, and the features as the training data stores them (`text` for text)
    tokenizer: tuple[str, int, int | None, str] | None  # `Tokenise`'s (tokenizer JSON, max_len, head_tokens, column)


def parse(argv: list[str]) -> Any:
    cfg = parse_args(PredictConfig, argv)
    output = Path(cfg.output).resolve()
    if output.suffix != ".parquet" or not output.parent.is_dir() or output.is_dir():
        raise ConfigError(f"output: {cfg.output} must be a .parquet file in an existing folder")
    source = Path(cfg.input).resolve()
    if output == source or source in output.parents:
        raise ConfigError(f"output: {cfg.output} is {'the input' if output == source else 'inside the input'} "
                          f"({cfg.input}); write the predictions elsewhere")
    return cfg


def training_data(run: Any, uri: str) -> tuple[str, dict, set[str]]:
    """(the run logging it, the manifest of the data the run trained on, that run's artifact names): logged with
    the run's data, or with its sweep's (the parent run's) for a sweep trial."""
    import mlflow

    for run_id in filter(None, (run.info.run_id, run.data.tags.get("mlflow.parentRunId"))):
        names = {artifact.path for artifact in mlflow.MlflowClient(uri).list_artifacts(run_id)}
        if "data_manifest.json" in names:
            return run_id, json.loads(mlflow.artifacts.load_text(f"runs:/{run_id}/data_manifest.json")), names
    raise ConfigError(f"model: training run {run.info.run_id} (or its sweep) logged no manifest of its data")


def training_tokenizer(run_id: str, manifest: dict, names: set[str], schema: DataSchema) -> tuple:
    """`Tokenise`'s arguments (tokenizer JSON, sequence length, head tokens, column) of the training data."""
    import mlflow

    tokenizer = Path(manifest.get("tokenizer") or "").name
    if tokenizer not in names:
        raise ConfigError(f"model: training run {run_id} logged no tokenizer with its data")
    return (mlflow.artifacts.load_text(f"runs:/{run_id}/{tokenizer}"), schema.max_len,
            manifest.get("head_tokens"), schema.features.column)  # head_tokens None: older data


def fixed_size(values: np.ndarray) -> pa.FixedSizeListArray:
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])


def plan(cfg: Any, uri: str) -> Plan:
    """The model, the data it was trained on and the input rows, all checked; raises ConfigError/DataError."""
    model_uri, _, run = find_model(cfg.model, uri)
    if run is None:
        raise ConfigError(f"model: {model_uri} was not logged by a training run of ours (which logs its data)")
    run_id, manifest, names = training_data(run, uri)
    schema = data_schema(manifest)
    features, path, tokenizer = schema.features, Path(cfg.input).resolve(), None
    if features.kind == "image":
        sources, images = read_images(path, features.shape)
        column = fixed_size(images)
    elif features.kind == "numeric":
        sources, values = read_numeric(path, features.source_columns)
        column = fixed_size(values)
    else:
        cleaning = DATASETS.specs[schema.dataset].clean_text if schema.dataset in DATASETS else None
        sources, texts = read_texts(path, features.source_columns[0] if features.source_columns else "text",
                                    resolve(cleaning) if cleaning else str.strip)
        column, tokenizer = pa.array(texts), training_tokenizer(run_id, manifest, names, schema)
    rows = pa.table({"row": np.arange(len(sources)), "source": sources,
                     "text" if tokenizer else features.column: column})
    return Plan(cfg, model_uri, schema, rows, tokenizer)


def predict(plan: Plan, uri: str) -> pa.Table:
    """Score every input row on the connected Ray; the predictions in input order."""
    import ray.data
    from scipy.special import softmax

    from pipelines.data.tokenize import Tokenise
    from pipelines.scoring import map_batches_without_restarts, score

    ds = ray.data.from_arrow(plan.rows.drop_columns(["source"]))
    if plan.tokenizer is not None:  # actors as the scorers': `score` scores again if one dies
        ds = map_batches_without_restarts(ds, Tokenise, fn_constructor_args=plan.tokenizer, batch_format="pyarrow",
                                          batch_size=plan.cfg.batch_size, compute=ray.data.ActorPoolStrategy(size=1))
    cfg = plan.cfg
    rows, logits = score(ds, plan.model_uri, uri, plan.schema, cfg.batch_size, cfg.concurrency, cfg.use_gpu,
                         key="row")
    outputs = logits[np.argsort(rows)]
    target = plan.schema.target
    if target.task == "regression":
        return pa.table({"source": plan.rows.column("source"), "prediction": outputs.reshape(-1).astype(np.float32)})
    predicted = outputs.argmax(axis=1).astype(np.int64)
    names = np.asarray(target.classes or [str(c) for c in range(outputs.shape[1])], dtype=object)
    return pa.table({"source": plan.rows.column("source"), "prediction": predicted,
                     "label": pa.array(names[predicted].tolist(), type=pa.string()),
                     "probabilities": fixed_size(softmax(outputs, axis=1).astype(np.float32))})


def write(table: pa.Table, output: Path) -> None:
    """Write beside, then rename: a reader never sees half a file, and a failed run leaves the old one."""
    import pyarrow.parquet as pq

    partial = output.with_name(f".{output.name}.partial")
    try:
        pq.write_table(table, partial)
        partial.replace(output)
    finally:
        partial.unlink(missing_ok=True)  # a write that failed leaves no part behind


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(dataclass_help("rtp predict model=<model> input=<path> output=<file.parquet> [KEY=VALUE ...]",
                             __doc__.split("\n\n")[1].strip(), PredictConfig, EXIT_CODES,
                             ["rtp predict model=<run id> input=data/mnist/raw/t10k-images-idx3-ubyte.gz "
                              "output=predictions.parquet", "rtp predict model=models:/imdb@champion input=reviews.txt "
                              "output=out.parquet concurrency=2"]))
        return 0
    try:
        cfg, uri, work = plan_before_start(argv, parse, plan)
    except USAGE_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    output = Path(cfg.output).resolve()
    init_ray(cfg.concurrency, cfg.verbose)
    try:
        write(predict(work, uri), output)
    except BaseException as err:  # interrupts too: say what happened in one line
        print(f"error: prediction failed: {one_line(err)}; nothing written", file=sys.stderr)
        return 1
    finally:
        shutdown_ray()
    print(f"{work.rows.num_rows} predictions of {work.model_uri} written")
    sys.stdout.write(f"predictions={output}\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
