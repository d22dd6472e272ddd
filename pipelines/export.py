"""Write a trained model in its framework's own format: `python -m pipelines.export model=<model> out=<folder>`.

`model`: as `pipelines.evaluate` takes it (a training run id, runs:/, models:/<name>/<version> or @<alias>). A run
whose model spec can `export` its model logged it so beside its MLflow model (`exported_model/`: the dense model of
the run's final checkpoint, whatever backend trained it, sharded and tensor-parallel checkpoints gathered, with
the tokenizer its training data was made with); this command writes that folder to `out`. For `model=hf`: a
Transformers folder (`config.json` with the class names in `id2label`, `model.safetensors`, the tokenizer) that
`AutoModelForSequenceClassification.from_pretrained(<folder>)` loads with no code of this project. `out`: a folder
that does not exist yet, or is empty. Starts no Ray.

Last stdout line: `exported=<folder>`.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from contract.console import one_line
from contract.registry import MODELS
from contract.tracking.models import EXPORTED_MODEL
from pipelines.config import ConfigError
from pipelines.help import dataclass_help, wants_help
from pipelines.scoring_cli import USAGE_ERRORS, checked_tracking_uri, find_model, parse_args

EXIT_CODES = "0 written; 1 writing failed (nothing left in out); 2 bad arguments, model or tracking server"


@dataclass
class ExportConfig:
    model: str = MISSING  # a run id, runs:/<run id>/model, models:/<name>/<version>, models:/<name>@<alias>
    out: str = MISSING  # the folder to write (new, or empty)


def parse(argv: list[str]) -> Any:
    cfg = parse_args(ExportConfig, argv)
    out = Path(cfg.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"out: {cfg.out} exists and is not an empty folder")
    if not out.resolve().parent.is_dir():
        raise ConfigError(f"out: {out.resolve().parent} (where {out.name} would go) is not a folder")
    return cfg


def exported_run(model: str, uri: str) -> str:
    """The run that logged `model` with its exported folder; ConfigError when it has none."""
    from contract.tracking.server import mlflow_client

    model_uri, _, run = find_model(model, uri)
    if run is None:
        raise ConfigError(f"model: {model_uri} was logged outside a training run, with no exported folder")
    if not mlflow_client(uri).list_artifacts(run.info.run_id, EXPORTED_MODEL):
        having = [name for name, spec in MODELS.specs.items() if spec.export is not None]
        raise ConfigError(f"model: run {run.info.run_id} (model '{run.data.params.get('model.name', '?')}') logged no "
                          f"{EXPORTED_MODEL}/; models whose spec exports one: {', '.join(having)}. Its MLflow model "
                          f"is {model_uri}")
    return run.info.run_id


def export(uri: str, run_id: str, out: Path) -> None:
    """The run's exported folder, downloaded into `out`."""
    import shutil
    import tempfile

    import mlflow

    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        folder = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=EXPORTED_MODEL, dst_path=scratch,
                                                     tracking_uri=uri)
        out.mkdir(exist_ok=True)
        for path in Path(folder).iterdir():
            shutil.move(str(path), out / path.name)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(dataclass_help("rtp export model=<model> out=<folder>", __doc__.split("\n\n")[1].strip(),
                             ExportConfig, EXIT_CODES,
                             ["rtp export model=<run id> out=exported/", "rtp export model=models:/imdb@champion "
                              "out=imdb-classifier/"]))
        return 0
    try:
        cfg = parse(argv)
        uri = checked_tracking_uri()
        run_id = exported_run(cfg.model, uri)
    except USAGE_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = Path(cfg.out).resolve()
    created = not out.exists()
    try:
        export(uri, run_id, out)
    except Exception as err:  # loading or writing: say what failed in one line, leave nothing half-written
        _remove_written(out, created)
        print(f"error: export failed: {one_line(err)}; nothing written", file=sys.stderr)
        return 1
    print(f"{cfg.model}: run {run_id}'s {EXPORTED_MODEL}/ written")
    sys.stdout.write(f"exported={out}\n")
    sys.stdout.flush()
    return 0


def _remove_written(out: Path, created: bool) -> None:
    import shutil

    if created:
        shutil.rmtree(out, ignore_errors=True)
    elif out.is_dir():
        for path in out.iterdir():
            shutil.rmtree(path) if path.is_dir() else path.unlink()


if __name__ == "__main__":
    sys.exit(main())
