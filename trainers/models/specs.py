"""The built-in models, registered as specs exactly as a user's own are (contract/registry.py): each one's config
keys (`model.*`), the features and tasks it takes, its builders per framework, its parallel plans, and its config
checks. Framework-free: builders are named by "module:attribute", imported only when a model is built."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from contract.checks import installed
from contract.data import DataSchema
from contract.registry import ModelSpec, register_model
from trainers.models.flavours import BERT_FLAVOURS


@dataclass
class MLPConfig:
    name: str = "mlp"               # multi-layer perceptron on the flattened features
    hidden: list[int] = field(default_factory=lambda: [512, 256])  # hidden layer widths
    dropout: float = 0.1            # after each hidden layer


@dataclass
class CNNConfig:
    name: str = "cnn"               # two conv blocks and a dense layer, on images
    channels: list[int] = field(default_factory=lambda: [32, 64])  # output channels of the two conv blocks
    hidden: int = 128               # width of the dense layer
    dropout: float = 0.25           # before the classifier


@dataclass
class BertModelConfig:
    name: str = "bert"              # BERT-style encoder classifier (`model=bert_tiny`, `model=bert_small`)
    flavour: str = "tiny"           # tiny | small | base | large (trainers/models/bert.py)
    dropout: float = 0.1            # embedding, residual and MLP dropout
    attention_dropout: float = 0.0  # on the attention probabilities: > 0 leaves torch's fused CPU attention (slower)
    hidden: Optional[int] = None    # hidden width, overriding the flavour's
    layers: Optional[int] = None    # encoder blocks, overriding the flavour's
    heads: Optional[int] = None     # attention heads, overriding the flavour's


@dataclass
class HFModelConfig:
    name: str = "hf"                # a Hugging Face Transformers model from a local folder (docs/hugging-face.md)
    path: str = ""                  # the folder save_pretrained wrote: config.json, weights (never downloaded)
    task: str = "sequence_classification"  # the head on the model: a logit per class (one value for regression)
    from_scratch: bool = False      # the folder's config only, weights drawn anew (not its model.safetensors)


@dataclass
class EmbedPoolConfig:
    name: str = "embed_pool"        # mean of the token embeddings (padding excluded) -> MLP
    embed_dim: int = 64             # token embedding width
    hidden: int = 64                # width of the hidden layer
    dropout: float = 0.1            # before the classifier


@dataclass
class TfIdfConfig:
    name: str = "tfidf"             # TF-IDF features -> Dense -> BatchNorm -> Dense (trainer=tf_dtensor)
    hidden: int = 128               # width of the hidden layer
    dropout: float = 0.5            # before the classifier
    bigram_buckets: int = 0         # token pairs hashed into this many extra features (0: single tokens only)


def _positive(**sizes: Any) -> None:
    """Each size (a number, None for not set, or a list of numbers) is > 0."""
    for key, value in sizes.items():
        values = value if isinstance(value, list) else [value]
        if any(v is not None and v <= 0 for v in values):
            raise ValueError(f"model.{key}: sizes must be > 0, got {value}")


def _dtensor_split(widths: list[int], trainer: Any) -> None:
    """tf_dtensor shards the layers' widths (inputs first; an input width is never split) over `mesh.model`."""
    if trainer is None or trainer.backend != "tf_dtensor":
        return
    from trainers.tf.dtensor.layout import sharded_widths

    uneven = [w for w in sharded_widths(widths) if w % trainer.mesh.model]
    if uneven:
        raise ValueError(f"trainer.mesh.model: {trainer.mesh.model} devices do not split the sharded layer widths "
                         f"{uneven} evenly (model.hidden)")


def check_mlp(cfg: Any, inputs: DataSchema | None, trainer: Any = None) -> None:
    """The sizes, the DTensor layout, and a pipeline of at most one stage per linear layer."""
    _positive(hidden=list(cfg.hidden))
    if inputs is not None:
        _dtensor_split([inputs.features.width, *cfg.hidden, inputs.target.outputs], trainer)
    if trainer is not None and trainer.get("pp", 1) > 1:
        from trainers.torch.parallel.schedules import stages_per_rank

        stages = trainer.pp * stages_per_rank(trainer.pp_schedule)
        if len(cfg.hidden) + 1 < stages:
            raise ValueError(f"trainer.pp: the MLP's {len(cfg.hidden) + 1} linear layers do not split into {stages} "
                             f"pipeline stages (pp={trainer.pp}, schedule {trainer.pp_schedule}; model.hidden)")


def check_cnn(cfg: Any, inputs: DataSchema | None, trainer: Any = None) -> None:
    if len(cfg.channels) != 2:
        raise ValueError(f"model.channels: the CNN has 2 conv blocks, got {list(cfg.channels)}")
    _positive(hidden=[cfg.hidden, *cfg.channels])  # the CNN's layer sizes
    if inputs is not None and (len(inputs.features.shape) not in (2, 3) or min(inputs.features.shape[:2]) < 4):
        raise ValueError(f"model.name: the CNN takes images of at least 4x4, (H, W) or (H, W, C); "
                         f"'{inputs.dataset}' has shape {inputs.features.shape}")


def check_bert(cfg: Any, inputs: DataSchema | None, trainer: Any = None) -> None:
    """The flavour and sizes, and the layout: tp divides the heads (whole heads per rank), the pipeline's stages
    split the blocks evenly."""
    if cfg.flavour not in BERT_FLAVOURS:
        raise ValueError(f"model.flavour: unknown flavour '{cfg.flavour}' (choices: {', '.join(BERT_FLAVOURS)})")
    _positive(hidden=cfg.hidden, layers=cfg.layers, heads=cfg.heads)
    layers, hidden, heads = bert_sizes(cfg)
    if hidden % heads:
        raise ValueError(f"model.hidden: hidden={hidden} is not a multiple of heads={heads}")
    if trainer is None:
        return
    if trainer.get("pp", 1) > 1:
        from trainers.torch.parallel.schedules import stages_per_rank

        stages = trainer.pp * stages_per_rank(trainer.pp_schedule)
        if layers % stages:
            raise ValueError(f"trainer.pp: {layers} layers do not split into {stages} equal pipeline stages "
                             f"(pp={trainer.pp}, schedule {trainer.pp_schedule})")
    if heads % trainer.get("tp", 1):
        raise ValueError(f"trainer.tp: tp={trainer.tp} does not divide the model's heads={heads}")


def bert_sizes(cfg: Any) -> tuple[int, int, int]:
    """(layers, hidden, heads): the flavour's, each overridden where the config sets it."""
    layers, hidden, heads = BERT_FLAVOURS[cfg.flavour]
    return cfg.layers or layers, cfg.hidden or hidden, cfg.heads or heads


def check_embed_pool(cfg: Any, inputs: DataSchema | None, trainer: Any = None) -> None:
    _positive(embed_dim=cfg.embed_dim, hidden=cfg.hidden)


def check_tfidf(cfg: Any, inputs: DataSchema | None, trainer: Any = None) -> None:
    _positive(hidden=cfg.hidden)
    if cfg.bigram_buckets < 0:
        raise ValueError(f"model.bigram_buckets: must be >= 0 (0: no token pairs), got {cfg.bigram_buckets}")
    if inputs is not None:
        _dtensor_split([0, cfg.hidden, inputs.target.outputs], trainer)


HF_TASKS = ("sequence_classification",)
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def check_hf(cfg: Any, inputs: DataSchema | None, trainer: Any = None) -> None:
    """Transformers installed, the task one the loop trains, a folder named; once the data is known, the folder is a
    saved Transformers model (its weights there unless `from_scratch`), the data within its vocabulary and
    positions, a tp > 1 run's architecture has a tensor-parallel plan whose heads tp divides, and a pp > 1 run's
    splits into its stages. Reads config.json; Transformers is imported only for tp > 1 or pp > 1."""
    if not installed("transformers"):
        raise ValueError("model.name: model 'hf' needs Hugging Face Transformers, not installed in this environment: "
                         "pip install 'ray-train-pipelines[hf]'")
    if cfg.task not in HF_TASKS:
        raise ValueError(f"model.task: '{cfg.task}' is not trained here (choices: {', '.join(HF_TASKS)})")
    if not cfg.path:
        raise ValueError("model.path: name the folder a Transformers model was saved in (save_pretrained): "
                         "model.path=<folder>")
    if inputs is None:  # the folder is read with the data, before anything starts (the docs' commands have neither)
        return
    folder = Path(cfg.path).expanduser()
    if not (folder / "config.json").is_file():
        raise ValueError(f"model.path: {folder} has no config.json (a folder written by save_pretrained; models are "
                         f"never downloaded)")
    if not cfg.from_scratch and not any((folder / name).is_file() for name in HF_WEIGHTS):
        raise ValueError(f"model.path: {folder} has no weights (model.safetensors); model.from_scratch=true trains "
                         f"from its config.json alone")
    config = json.loads((folder / "config.json").read_text())
    _hf_fits_data(config, inputs)
    if trainer is not None and trainer.get("tp", 1) > 1:
        _hf_tp(folder, config, trainer.tp)
    if trainer is not None and trainer.get("pp", 1) > 1:
        _hf_pp(cfg, inputs, trainer)


def _hf_fits_data(config: dict, inputs: DataSchema) -> None:
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if vocab and inputs.vocab_size > vocab:
        raise ValueError(f"model.path: the data's token ids go up to {inputs.vocab_size - 1}; the model's vocabulary "
                         f"has {vocab} (prepare the data with the model's tokenizer: --tokenizer <folder>)")
    positions = config.get("max_position_embeddings") or config.get("n_positions")
    if positions and inputs.max_len > positions:
        raise ValueError(f"model.path: the data's rows are {inputs.max_len} tokens; the model takes at most "
                         f"{positions} (prepare it with --max-len {positions})")


def _hf_tp(folder: Path, config: dict, tp: int) -> None:
    """The architecture's own plan (`base_model_tp_plan`) and heads that tp divides."""
    from trainers.models.hf_config import tp_plan_of

    architecture = (config.get("architectures") or [config.get("model_type", "?")])[0]
    if not tp_plan_of(folder):
        raise ValueError(f"trainer.tp: {architecture} has no tensor-parallel plan in Transformers "
                         f"(base_model_tp_plan); train it with tp=1 (ddp, fsdp, deepspeed)")
    for key in ("num_attention_heads", "num_key_value_heads"):
        if config.get(key) and config[key] % tp:
            raise ValueError(f"trainer.tp: tp={tp} does not divide the model's {key}={config[key]}")


def _hf_pp(cfg: Any, inputs: DataSchema, trainer: Any) -> None:
    """An architecture the pipeline splits (trainers/models/hf_pipeline.py), its layers in equal stages: the model
    built on the meta device (its config alone, no weights) to see its modules."""
    import torch

    from trainers.models.hf import build_hf
    from trainers.models.hf_pipeline import pipeline_parts
    from trainers.torch.parallel.schedules import stages_per_rank

    with torch.device("meta"):
        hf = build_hf(cfg, inputs).hf
    _, layers, _ = pipeline_parts(hf)
    blocks, stages = len(getattr(hf.base_model, layers)), trainer.pp * stages_per_rank(trainer.pp_schedule)
    if blocks % stages:
        raise ValueError(f"trainer.pp: {blocks} layers do not split into {stages} equal pipeline stages "
                         f"(pp={trainer.pp}, schedule {trainer.pp_schedule})")


def bert_blocks(model: Any = None) -> tuple[type, ...]:
    from trainers.models.bert import Block

    return (Block,)


for _spec in (
    ModelSpec("mlp", MLPConfig, "multi-layer perceptron on the flattened features, images or numbers (PyTorch, Keras, "
              "DTensor)", ("image", "numeric"),
              torch="trainers.models.mlp_cnn:build_mlp", keras="trainers.models.keras_models:build_mlp",
              dtensor="trainers.models.tf_modules:build_mlp", check=check_mlp,
              pipeline_split="trainers.torch.parallel.pipeline:sequential_split"),
    ModelSpec("cnn", CNNConfig, "convolutional net for images of any size and channels: two conv blocks and a dense "
              "layer", ("image",),
              torch="trainers.models.mlp_cnn:build_cnn", keras="trainers.models.keras_models:build_cnn",
              check=check_cnn, augment="trainers.models.augment:random_shift"),
    ModelSpec("bert", BertModelConfig, "BERT-style encoder classifier, tensor- and pipeline-parallel", ("tokens",),
              torch="trainers.models.bert:build_bert",
              tensor_parallel="trainers.models.bert_parallel:parallelize_bert",
              pipeline_split="trainers.models.bert_parallel:split_stage", fsdp_blocks=bert_blocks, check=check_bert),
    ModelSpec("hf", HFModelConfig, "a Hugging Face Transformers model from a local folder (save_pretrained), "
              "classifying token ids; exported as one (rtp export)", ("tokens",),
              torch="trainers.models.hf:build_hf", tensor_parallel="trainers.models.hf:parallelize_hf",
              pipeline_split="trainers.models.hf_pipeline:split_stage", fsdp_blocks="trainers.models.hf:fsdp_blocks",
              export="trainers.models.hf:export_hf", check=check_hf,
              flops_per_sample="trainers.models.hf:flops_per_sample"),
    ModelSpec("embed_pool", EmbedPoolConfig, "text baseline: the mean of the token embeddings, then an MLP (PyTorch "
              "and Keras)", ("tokens",),
              torch="trainers.models.text:build_embed_pool",
              keras="trainers.models.keras_models:build_embed_pool",
              check=check_embed_pool),
    ModelSpec("tfidf", TfIdfConfig, "TF-IDF features, Dense, BatchNorm, Dense (tf_dtensor; Keras twin)", ("tokens",),
              ("classification",), dtensor="trainers.models.tf_modules:build_tfidf",
              keras_twin="trainers.models.keras_models:build_tfidf", check=check_tfidf),
):
    register_model(_spec)
