"""The PyTorch backends, registered by name exactly as a user's backend is (contract/registry.py): each one's config
keys (`trainer.*`, the keys every backend has plus its own), its checks, its layout, and its `Backend` object by
"module:attribute" (imported only when a run uses it). Framework-free: checking a config imports no torch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from contract.checks import ConfigError, choice
from contract.config import TrainerConfig
from contract.data import DataSchema
from contract.registry import BackendSpec, Layout, ModelSpec, register_backend

LIGHTNING_STRATEGIES = ("ddp", "fsdp")
ZERO_STAGES = (1, 2, 3)
# The recipe's optimizer keys (contract/recipe.py): a model spec's own LightningModule builds its optimizer and
# schedule in its `configure_optimizers`, so under trainer=lightning these change nothing.
OPTIMIZER_KEYS = ("trainer.optimizer", "trainer.lr", "trainer.weight_decay", "trainer.momentum", "trainer.lr_schedule",
                  "trainer.warmup_steps", "trainer.warmup_fraction")


@dataclass
class DDPConfig(TrainerConfig):
    backend: str = "ddp"                # PyTorch DistributedDataParallel


@dataclass
class TPConfig(TrainerConfig):
    backend: str = "tp"                 # tensor parallelism x data parallelism (PyTorch)
    batch_size: int = 32                # rows per batch on each data-parallel rank (a TP group shares its batch)
    lr: float = 5e-4                    # peak learning rate (after warmup)
    epochs: int = 3                     # passes over the training split
    tp: int = 2                         # tensor-parallel degree
    dp: Optional[int] = None            # data-parallel degree; default num_workers // tp
    tp_impl: str = "megatron"           # megatron | dtensor


@dataclass
class FSDPConfig(TrainerConfig):
    backend: str = "fsdp"               # PyTorch FSDP2 sharded data parallelism (with TP and PP)
    dp_replicate: int = 1               # HSDP: replicas of the sharded model
    dp_shard: Optional[int] = None      # ranks each replica is sharded over; null: what the other degrees leave
    tp: int = 1                         # FSDP x TP: tensor parallelism (DTensor plans) inside, FSDP over the rest
    reshard_after_forward: bool = True  # free gathered parameters after forward (ZeRO-3); false: keep (ZeRO-2)
    activation_checkpointing: bool = False  # recompute each block's activations in backward instead of keeping them
    pp: int = 1                         # pipeline stages (models with a pipeline_split): over pp groups of tp workers
    pp_schedule: str = "1f1b"           # gpipe | 1f1b | interleaved_1f1b (two stages per worker)
    microbatches: int = 4               # per batch, under pp > 1: >= pp, divides batch_size


@dataclass
class LightningConfig(TrainerConfig):
    backend: str = "lightning"          # PyTorch Lightning's Trainer on Ray Train (ray.train.lightning)
    strategy: str = "ddp"               # ddp | fsdp (Lightning's FSDP needs GPUs: use_gpu=true)


@dataclass
class DeepSpeedConfig(TrainerConfig):
    backend: str = "deepspeed"          # DeepSpeed's engine (ZeRO) on the shared loop
    zero_stage: int = 2                 # ZeRO 1: optimizer states sharded; 2: + gradients; 3: + parameters
    deepspeed_config: Optional[str] = None  # a DeepSpeed JSON of yours, under the recipe's keys (a conflict is an
                                            # error); its optimizer and schedule are the recipe's


def tp_layout(trainer: Any) -> Layout:
    return Layout(dp=trainer.dp or trainer.num_workers // trainer.tp, tp=trainer.tp)


def complete_tp(trainer: Any) -> None:
    """`trainer.dp` left null: what tp leaves of the workers."""
    if trainer.dp is None:
        trainer.dp = trainer.num_workers // trainer.tp


def check_tp(cfg: Any, model: ModelSpec, inputs: DataSchema | None) -> None:
    """tp x dp = num_workers; the model has a tensor-parallel plan (trainer=tp applies it at any degree, tp=1 too)."""
    trainer = cfg.trainer
    if trainer.tp < 1 or (trainer.dp is not None and trainer.dp < 1):
        raise ConfigError(f"trainer.tp: tp and dp must be >= 1, got tp={trainer.tp} dp={trainer.dp}")
    if trainer.num_workers % trainer.tp:
        raise ConfigError(f"trainer.tp: tp={trainer.tp} does not divide num_workers={trainer.num_workers}")
    dp = trainer.dp if trainer.dp is not None else trainer.num_workers // trainer.tp
    if dp * trainer.tp != trainer.num_workers:
        raise ConfigError(f"trainer.dp: tp*dp={trainer.tp}*{dp}={trainer.tp * dp} != num_workers={trainer.num_workers}")
    choice("trainer", "tp_impl", trainer.tp_impl, ("megatron", "dtensor"))
    _require_plan(trainer, model)
    if model.tensor_parallel is None:
        raise ConfigError(f"trainer.backend: trainer=tp lays the model out by its spec's tensor-parallel plan; model "
                          f"'{model.name}' has none (data parallelism alone: trainer=ddp or trainer=fsdp)")


def fsdp_layout(trainer: Any) -> Layout:
    """Data parallelism over what pp x tp leave of the workers; a pipeline's stages have fixed shapes."""
    return Layout(dp=trainer.num_workers // (trainer.tp * trainer.pp), tp=trainer.tp,
                  full_batches=", and a pipeline trains full batches only" if trainer.pp > 1 else "")


def check_fsdp(cfg: Any, model: ModelSpec, inputs: DataSchema | None) -> None:
    """num_workers = dp_replicate x dp_shard x pp x tp; the model's plans for tp > 1 and pp > 1."""
    trainer = cfg.trainer
    if trainer.pp < 1 or trainer.num_workers % trainer.pp:
        raise ConfigError(f"trainer.pp: must be >= 1 and divide num_workers={trainer.num_workers}, got {trainer.pp}")
    if trainer.tp < 1 or (trainer.num_workers // trainer.pp) % trainer.tp:
        raise ConfigError(f"trainer.tp: must be >= 1 and divide num_workers / pp = {trainer.num_workers // trainer.pp}"
                          f", got {trainer.tp}")
    dp = trainer.num_workers // (trainer.tp * trainer.pp)
    if trainer.dp_replicate < 1 or dp % trainer.dp_replicate:
        raise ConfigError(f"trainer.dp_replicate: must be >= 1 and divide num_workers / (pp x tp) = {dp}, got "
                          f"{trainer.dp_replicate}")
    if trainer.dp_shard is not None and trainer.dp_replicate * trainer.dp_shard != dp:
        raise ConfigError(f"trainer.dp_shard: dp_replicate x dp_shard x pp x tp = {trainer.dp_replicate} x "
                          f"{trainer.dp_shard} x {trainer.pp} x {trainer.tp} != num_workers={trainer.num_workers}")
    if trainer.precision == "fp16":
        raise ConfigError("trainer.precision: fp16 (loss scaling over sharded gradients) is not supported with fsdp; "
                          "use bf16")
    if trainer.min_workers and (trainer.tp, trainer.pp, trainer.dp_replicate, trainer.dp_shard) != (1, 1, 1, None):
        raise ConfigError("trainer.min_workers: an elastic fsdp run shards the model over all its workers, whatever "
                          "their number (tp=1, pp=1, dp_replicate=1, dp_shard unset)")
    if trainer.pp > 1:
        _check_pipeline(trainer)
    _require_plan(trainer, model)
    if trainer.pp > 1 and model.pipeline_split is None:
        raise ConfigError(f"trainer.pp: pp={trainer.pp} splits the model into stages by its spec's pipeline_split; "
                          f"model '{model.name}' has none (pipeline_split=, e.g. "
                          f"trainers.torch.parallel.pipeline.sequential_split)")


def _require_plan(trainer: Any, model: ModelSpec) -> None:
    if trainer.tp > 1 and model.tensor_parallel is None:
        raise ConfigError(f"trainer.tp: tp={trainer.tp} shards the model by its spec's tensor-parallel plan; model "
                          f"'{model.name}' has none (tensor_parallel=, e.g. trainers.torch.parallel.plans.styles_plan)")


def _check_pipeline(trainer: Any) -> None:
    from trainers.torch.parallel.schedules import SCHEDULES

    choice("trainer", "pp_schedule", trainer.pp_schedule, SCHEDULES)
    if trainer.microbatches < trainer.pp:
        raise ConfigError(f"trainer.microbatches: {trainer.microbatches} micro-batches leave stages of a {trainer.pp}-"
                          f"stage pipeline idle; use >= pp")
    if trainer.batch_size % trainer.microbatches:
        raise ConfigError(f"trainer.microbatches: {trainer.microbatches} does not divide batch_size="
                          f"{trainer.batch_size}")
    if trainer.pp_schedule == "interleaved_1f1b" and trainer.microbatches % trainer.pp:
        raise ConfigError(f"trainer.microbatches: interleaved_1f1b needs a multiple of pp={trainer.pp}, got "
                          f"{trainer.microbatches}")
    if trainer.grad_accum != 1:
        raise ConfigError("trainer.grad_accum: with pp > 1 the micro-batches are the accumulation; use "
                          "trainer.microbatches")
    if trainer.compile:  # a pipeline schedule runs its stages itself
        raise ConfigError("trainer.compile: not supported with pipeline stages (pp > 1)")


def check_lightning(cfg: Any, model: ModelSpec, inputs: DataSchema | None) -> None:
    """Lightning's strategies: its FSDP refuses CPUs ("The strategy `fsdp` requires a GPU accelerator")."""
    trainer = cfg.trainer
    choice("trainer", "strategy", trainer.strategy, LIGHTNING_STRATEGIES)
    if trainer.strategy == "fsdp" and not trainer.use_gpu:
        raise ConfigError("trainer.strategy: Lightning's fsdp strategy runs on GPUs only (use_gpu=true); on CPUs use "
                          "strategy=ddp, or trainer=fsdp")
    if trainer.strategy == "fsdp" and trainer.grad_clip is not None:
        raise ConfigError("trainer.grad_clip: Lightning's fsdp strategy does not clip by the global norm "
                          "(\"gradient_clip_algorithm='norm' is currently not supported for FSDPPrecision\"); "
                          "use strategy=ddp, or trainer=fsdp")
    if trainer.strategy == "fsdp" and trainer.precision == "fp16":
        raise ConfigError("trainer.precision: fp16 (loss scaling over sharded gradients) is not supported with fsdp; "
                          "use bf16")
    if trainer.compile:
        raise ConfigError("trainer.compile: not supported with lightning (its Trainer runs the LightningModule "
                          "it is given); compile inside your LightningModule instead")


def lightning_ignored_keys(cfg: Any, model: ModelSpec) -> tuple[tuple[str, ...], str]:
    """A spec's own LightningModule picks its optimizer and schedule: the recipe's keys change nothing."""
    if model.lightning is None:
        return (), ""
    return OPTIMIZER_KEYS, (f"model '{model.name}' is its own LightningModule, whose configure_optimizers picks its "
                            f"optimizer and schedule; sweep the keys of its model config that it reads")


def check_deepspeed(cfg: Any, model: ModelSpec, inputs: DataSchema | None) -> None:
    """The ZeRO stage, and the user's DeepSpeed JSON against the recipe (trainers/torch/deepspeed_config.py)."""
    from trainers.torch.deepspeed_config import DeepSpeedConfigError, engine_config

    trainer = cfg.trainer
    if trainer.zero_stage not in ZERO_STAGES:
        raise ConfigError(f"trainer.zero_stage: must be one of {ZERO_STAGES}, got {trainer.zero_stage}")
    try:
        engine_config(trainer)
    except DeepSpeedConfigError as err:
        raise ConfigError(str(err)) from err
    if trainer.compile:
        raise ConfigError("trainer.compile: not supported with deepspeed (its engine wraps the model)")
    if trainer.min_workers and trainer.optimizer not in ("adam", "adamw"):
        raise ConfigError(f"trainer.min_workers: an elastic deepspeed run resumes at another size through DeepSpeed's "
                          f"universal checkpoint, which converts Adam's states only; trainer.optimizer="
                          f"{trainer.optimizer} cannot resize (use adam or adamw)")


for _spec in (
    BackendSpec("ddp", "trainers.torch.ddp:DDP", DDPConfig, ("torch",),
                "PyTorch DistributedDataParallel (gloo on CPU, NCCL on GPU)", elastic=True),
    BackendSpec("fsdp", "trainers.torch.fsdp:FSDP", FSDPConfig, ("torch",),
                "PyTorch FSDP2 sharded data parallelism; HSDP, FSDP x TP and pipeline stages (PP x TP x FSDP)",
                check=check_fsdp, layout=fsdp_layout, elastic=True),
    BackendSpec("tp", "trainers.torch.tp:TP", TPConfig, ("torch",),
                "tensor parallelism (Megatron-style layers or DTensor plans) x data parallelism",
                check=check_tp, layout=tp_layout, complete=complete_tp),
    BackendSpec("lightning", "trainers.torch.lightning:Lightning", LightningConfig, ("torch",),
                "PyTorch Lightning's Trainer (ddp, or fsdp on GPUs) through Ray Train's Lightning integration",
                model_builders=("lightning", "torch"), needs=("lightning",), extra="lightning",
                check=check_lightning, ignored_keys=lightning_ignored_keys, elastic=True),
    BackendSpec("deepspeed", "trainers.torch.deepspeed:DeepSpeed", DeepSpeedConfig, ("torch",),
                "DeepSpeed's engine: ZeRO stage 1, 2 or 3 (gloo on CPU, NCCL on GPU)", needs=("deepspeed",),
                extra="deepspeed", check=check_deepspeed, elastic=True),
):
    register_backend(_spec)
