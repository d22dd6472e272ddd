"""Facts about the prepared datasets that training code needs (the preparation itself is pipelines/data/)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

PAD_ID = 0  # token shards: [PAD] is id 0, so a row's real tokens are its first `length` ids

FEATURE_KINDS = ("image", "numeric", "tokens")
TASKS = ("classification", "regression")
FEATURE_DTYPES = {"image": "uint8", "numeric": "float32", "tokens": "int32"}  # a shard's features in a worker
LABEL_DTYPES = {"classification": "int64", "regression": "float32"}


@dataclass(frozen=True)
class Features:
    """What a prepared dataset's rows hold as model input (its manifest's `features`), and how a worker turns the
    stored column into it. Every row is stored flat (a fixed-size list) and fed flat, [B, width]; `shape` tells a
    model its structure: an image is (H, W) or (H, W, C), channels last.
    `image`: uint8 pixels, fed as (pixel / 255 - mean) / std, float32;
    `numeric`: float values, fed as (value - mean) / std, float32 (`mean`, `std`: one per value, or one for all);
    `tokens`: int token ids, [PAD] = 0 after a row's `length` real ones, fed with a mask of the real ones."""
    column: str                       # the stored column: a fixed-size list per row
    kind: str                         # image | numeric | tokens
    shape: tuple[int, ...]            # one row's input: (28, 28), (13,), (max_len,)
    mean: tuple[float, ...] = (0.0,)  # image and numeric scaling (from the train split)
    std: tuple[float, ...] = (1.0,)
    vocab_size: int = 0               # tokens: ids are below this
    length_column: str | None = None  # tokens: real tokens per row
    id_column: str | None = None      # a row's identity (which rows a rank holds: checks)
    source_columns: tuple[str, ...] = ()  # the source's columns the values came from, in order (predict reads them)

    @property
    def width(self) -> int:
        """Values per row, flattened."""
        return int(np.prod(self.shape))

    def scaling(self) -> tuple[float, float | np.ndarray, float | np.ndarray]:
        """(divisor, mean, std): an input is (value / divisor - mean) / std (images: 255; a single mean or std as a
        Python float, per-value ones as float32 arrays [width])."""
        def one(values: tuple[float, ...]) -> float | np.ndarray:
            return float(values[0]) if len(values) == 1 else np.asarray(values, np.float32)

        return (255.0 if self.kind == "image" else 1.0), one(self.mean), one(self.std)

    def stored(self, column: np.ndarray) -> np.ndarray:
        """A stored column (fixed-size lists, as Ray Data gives them: [N, ...] or N arrays) as [N, width] of the
        dtype workers hold (FEATURE_DTYPES)."""
        values = np.stack(column) if column.dtype == object else np.asarray(column)
        return values.reshape(len(values), self.width).astype(FEATURE_DTYPES[self.kind], copy=False)

    def model_input(self, column: np.ndarray) -> np.ndarray:
        """A stored column as the model takes it (what a logged model is given): [N, width], images and numeric
        values scaled to float32, token ids as stored."""
        values = self.stored(column)
        if self.kind == "tokens":
            return values
        divisor, mean, std = self.scaling()
        return ((values.astype(np.float32) / divisor - mean) / std).astype(np.float32)


@dataclass(frozen=True)
class Target:
    """What a model predicts (its manifest's `target`): a class id in 0..len(classes)-1 (`classes` names each,
    as the source data did), or a float value (regression)."""
    column: str = "label"
    task: str = "classification"
    classes: tuple[str, ...] = ()

    @property
    def outputs(self) -> int:
        """The model's outputs per row: a logit per class, or the one predicted value."""
        return len(self.classes) if self.task == "classification" else 1


@dataclass(frozen=True)
class DataSchema:
    """A prepared dataset as a model sees it: its features and target, read from its manifest. What a model builder
    gets (`inputs`), shipped to the workers as plain data (`to_dict`)."""
    dataset: str
    features: Features
    target: Target

    @property
    def vocab_size(self) -> int:
        return self.features.vocab_size

    @property
    def max_len(self) -> int:
        """Token ids per row (0 for other features)."""
        return self.features.shape[0] if self.features.kind == "tokens" else 0

    def row_bytes(self) -> int:
        """A row's bytes as a worker holds it: its features (FEATURE_DTYPES), label and any length and id."""
        features = self.features.width * np.dtype(FEATURE_DTYPES[self.features.kind]).itemsize
        extras = sum(8 for column in (self.features.length_column, self.features.id_column) if column)
        return features + np.dtype(LABEL_DTYPES[self.target.task]).itemsize + extras

    def stored_columns(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A batch of stored columns (as Ray Data gives them) in the dtypes workers hold: features [N, width]
        (FEATURE_DTYPES), labels LABEL_DTYPES, lengths and ids int64."""
        features, target = self.features, self.target
        held = {features.column: features.stored(batch[features.column]),
                target.column: np.asarray(batch[target.column], dtype=LABEL_DTYPES[target.task])}
        return {**held, **{c: np.asarray(batch[c], dtype=np.int64) for c in batch if c not in held}}

    def to_dict(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "features": asdict(self.features), "target": asdict(self.target)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "DataSchema":
        features = Features(**{**raw["features"], **{key: tuple(raw["features"][key]) for key in
                                                     ("shape", "mean", "std", "source_columns")
                                                     if key in raw["features"]}})
        target = Target(**{**raw["target"], "classes": tuple(raw["target"].get("classes", ()))})
        return cls(raw["dataset"], features, target)

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> "DataSchema":
        """The manifest's `features` and `target` (KeyError where it records none: pipelines/data/shards.py
        `data_schema` reads an older manifest)."""
        return cls.from_dict({"dataset": manifest.get("dataset", "?"), "features": manifest["features"],
                              "target": manifest["target"]})


def shuffled_order(rows: int, seed: int) -> np.ndarray:
    """The row order of a shuffled epoch, the same in every framework for one seed (the loss-parity gate)."""
    return np.random.default_rng(seed).permutation(rows)


BUCKET_BATCHES = 50  # batches per run sorted by length (the "megabatch" of HF Trainer's group_by_length)


def bucketed_order(order: np.ndarray, lengths: np.ndarray, batch_size: int, seed: int) -> np.ndarray:
    """`order` (a shuffled epoch) regrouped so each batch of `batch_size` consecutive rows holds rows of similar
    length: each run of BUCKET_BATCHES batches is sorted by length, then the full batches are shuffled (a short
    last batch stays last). A batch cut to its longest row then pads little: IMDb's reviews average 258 of 512
    tokens, and nearly every random batch of 32 holds one of the 12% that fill all 512. Every framework orders a
    shard this way for one seed, as `shuffled_order`."""
    run = batch_size * BUCKET_BATCHES
    rows = np.concatenate([part[np.argsort(lengths[part], kind="stable")]
                           for part in np.split(order, range(run, len(order), run))])
    full = len(rows) // batch_size
    batches = rows[:full * batch_size].reshape(full, batch_size)
    shuffled = batches[np.random.default_rng([seed, 1]).permutation(full)]  # not the generator of `order`
    return np.concatenate([shuffled.ravel(), rows[full * batch_size:]])


MANIFEST = "manifest.json"  # in a prepared dataset's folder: its splits' files and row counts, schema, tokenizer


def manifest_json(data_dir: str | Path) -> dict[str, Any]:
    """The manifest of the dataset prepared in `data_dir`, as JSON; {} where there is none or it is no JSON object
    (the checks before training say what is wrong with it: pipelines/data/shards.py `read_manifest`)."""
    try:
        loaded = json.loads((Path(data_dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}
