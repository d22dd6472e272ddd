"""Predict with a trained model on raw input:
`python -m pipelines.predict model=<model> input=<path> output=<file.parquet> [key=value ...]`.

`model`: as `pipelines.evaluate` takes it (a training run id, runs:/, models:/<name>/<version> or @<alias>); its
training run says which dataset it was trained on. `input`: for MNIST models an IDX images file or a folder of
image files (28x28 grayscale after conversion), for IMDb models a .txt file (a review per line), a .csv/.parquet
file with a `text` column, or a folder of .txt files (a review each; an aclImdb folder works), tokenised with the
training data's tokenizer (logged with the training run). Ray Data tokenises and scores the rows with
`concurrency` actors that each load the model once (pipelines/scoring.py). `output`: a Parquet file, one row per
input row in input order: `source` (file, line or index), `prediction` (class id; IMDb: 1 = positive) and
`probabilities`. Uses the cluster at RAY_ADDRESS when set, else starts a local Ray.

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

from pipelines.config import ConfigError
from pipelines.data.raw_inputs import read_images, read_texts
from pipelines.help import dataclass_help, wants_help
from pipelines.ray_session import shutdown_ray
from pipelines.scoring_cli import USAGE_ERRORS, ScoringConfig, find_model, init_ray, parse_args, plan_before_start


EXIT_CODES = ("0 written; 1 scoring failed (nothing written); 2 bad arguments, model, input or tracking server "
              "(nothing was started)")


@dataclass
class PredictConfig(ScoringConfig):
    input: str = MISSING  # MNIST models: an IDX images file or a folder of images; IMDb: .txt/.csv/.parquet or a folder
    output: str = MISSING  # a .parquet file: one row per input row, in input order


@dataclass
class Plan:
    cfg: Any
    model_uri: str
    dataset: str
    rows: pa.Table  # `row`, `source`, and `image` (MNIST) or `text` (IMDb)
    tokenizer: tuple[str, int, int | None] | None  # `Tokenise`'s (tokenizer JSON, max_len, head_tokens) for text


def parse(argv: list[str]) -> Any:
    cfg = parse_args(PredictConfig, argv)
    if Path(cfg.output).suffix != ".parquet" or not Path(cfg.output).resolve().parent.is_dir():
        raise ConfigError(f"output: {cfg.output} must be a .parquet file in an existing folder")
    return cfg


def training_tokenizer(run: Any, uri: str) -> tuple[str, int, int | None]:
    """The tokenizer JSON, sequence length and head tokens (`Tokenise`'s arguments) of the data the run trained
    on: logged with the run's data, or with its sweep's (the parent run's) for a sweep trial."""
    import mlflow

    for run_id in filter(None, (run.info.run_id, run.data.tags.get("mlflow.parentRunId"))):
        names = {artifact.path for artifact in mlflow.MlflowClient(uri).list_artifacts(run_id)}
        if "data_manifest.json" not in names:
            continue
        manifest = json.loads(mlflow.artifacts.load_text(f"runs:/{run_id}/data_manifest.json"))
        tokenizer = Path(manifest.get("tokenizer") or "").name
        if tokenizer in names:
            return (mlflow.artifacts.load_text(f"runs:/{run_id}/{tokenizer}"),
                    manifest["model_inputs"]["max_len"], manifest.get("head_tokens"))  # None: older data
    raise ConfigError(f"model: training run {run.info.run_id} (or its sweep) logged no tokenizer with its data")


def plan(cfg: Any, uri: str) -> Plan:
    """The model, its dataset and the input rows, all checked; raises ConfigError/DataError."""
    model_uri, _, run = find_model(cfg.model, uri)
    dataset = run.data.params.get("data.name") if run else None
    if dataset not in ("mnist", "imdb"):
        raise ConfigError(f"model: {model_uri} was not logged by a training run of ours (which names its dataset)")
    path = Path(cfg.input).resolve()
    if dataset == "mnist":
        sources, images = read_images(path)
        column = pa.FixedSizeListArray.from_arrays(pa.array(images.reshape(-1)), 784)
        tokenizer = None
    else:
        sources, texts = read_texts(path)
        column, tokenizer = pa.array(texts), training_tokenizer(run, uri)
    rows = pa.table({"row": np.arange(len(sources)), "source": sources,
                     "image" if dataset == "mnist" else "text": column})
    return Plan(cfg, model_uri, dataset, rows, tokenizer)


def predict(plan: Plan, uri: str) -> pa.Table:
    """Score every input row on the connected Ray; the predictions in input order."""
    import ray.data
    from scipy.special import softmax

    from pipelines.data.tokenize import Tokenise
    from pipelines.scoring import score

    ds = ray.data.from_arrow(plan.rows.drop_columns(["source"]))
    if plan.tokenizer is not None:
        ds = ds.map_batches(Tokenise, fn_constructor_args=plan.tokenizer, batch_format="pyarrow",
                            batch_size=plan.cfg.batch_size, compute=ray.data.ActorPoolStrategy(size=1))
    cfg = plan.cfg
    rows, logits = score(ds, plan.model_uri, uri, plan.dataset, cfg.batch_size, cfg.concurrency, cfg.use_gpu,
                         key="row")
    order = np.argsort(rows)
    probabilities = softmax(logits[order], axis=1).astype(np.float32)
    return pa.table({"source": plan.rows.column("source"),
                     "prediction": logits[order].argmax(axis=1).astype(np.int64),
                     "probabilities": pa.FixedSizeListArray.from_arrays(pa.array(probabilities.reshape(-1)),
                                                                        probabilities.shape[1])})


def write(table: pa.Table, output: Path) -> None:
    """Write beside, then rename: a reader never sees half a file, and a failed run leaves the old one."""
    import pyarrow.parquet as pq

    partial = output.with_name(f".{output.name}.partial")
    pq.write_table(table, partial)
    partial.replace(output)


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
    init_ray(cfg.concurrency)
    try:
        write(predict(work, uri), output)
    except BaseException as err:  # interrupts too: say what happened in one line
        print(f"error: prediction failed: {type(err).__name__}: {err}; nothing written", file=sys.stderr)
        return 1
    finally:
        shutdown_ray()
    print(f"{work.rows.num_rows} predictions of {work.model_uri} written")
    sys.stdout.write(f"predictions={output}\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
