"""The data a run read: its manifest and tokenizer as artifacts, its splits as MLflow dataset inputs."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from contract.tracking.server import mlflow_client


def log_data_files(uri: str, run_id: str, data_dir: str, manifest: Mapping[str, Any]) -> None:
    """The dataset's manifest (lineage: sources, checksums, skips) and its tokenizer, if it has one."""
    import json

    client = mlflow_client(uri)
    client.log_text(run_id, json.dumps(manifest, indent=2, sort_keys=True), "data_manifest.json")
    if manifest.get("tokenizer"):
        client.log_artifact(run_id, str(Path(data_dir) / manifest["tokenizer"]))


@dataclass
class DatasetRef:
    """A split a run reads, as MLflow lists it among the run's inputs (the UI's "Datasets")."""
    name: str                # e.g. mnist-train
    uri: str                 # where it lives (the prepared folder)
    digest: str              # changes whenever the data does
    columns: dict[str, str]  # column -> MLflow type: integer, long, float, double, string, or array<integer> ...
    context: str             # training | eval | evaluation


def log_dataset_inputs(uri: str, run_id: str, datasets: Sequence[DatasetRef]) -> None:
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.types.schema import Array, ColSpec, DataType, Schema

    def spec(name: str, kind: str) -> ColSpec:
        inner = kind.removeprefix("array<").removesuffix(">")
        return ColSpec(Array(DataType[inner]) if kind.startswith("array<") else DataType[kind], name)

    inputs = []
    for ref in datasets:
        with warnings.catch_warnings():  # a file:// URI fits two of MLflow's local source types; either is right
            warnings.simplefilter("ignore")
            source = resolve_dataset_source(ref.uri)
        schema = Schema([spec(name, kind) for name, kind in ref.columns.items()])
        dataset = MetaDataset(source, name=ref.name, digest=ref.digest, schema=schema)._to_mlflow_entity()
        inputs.append(DatasetInput(dataset, tags=[InputTag("mlflow.data.context", ref.context)]))
    mlflow_client(uri).log_inputs(run_id, datasets=inputs)
