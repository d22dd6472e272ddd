"""The training recipe (contract/recipe.py) as PyTorch objects: the optimizer with its weight-decay groups, the
learning-rate schedule as a `LambdaLR` (checkpointed beside the optimizer), autocast for bf16/fp16 with a
`GradScaler` for fp16, the gradient clipping every PyTorch backend applies after its gradient sync, and each
task's loss."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from contract.recipe import lr_factor, no_weight_decay, schedule_steps

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def task_loss(task: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The training loss of a task: cross-entropy of the logits [B, classes] and class ids, or the mean squared
    error of the predictions ([B] or [B, 1]) and the targets."""
    if task == "regression":
        return lambda outputs, targets: nn.functional.mse_loss(outputs.reshape(targets.shape).float(), targets)
    return nn.CrossEntropyLoss()


def make_optimizer(model: nn.Module, trainer: Any, fused: bool = True,
                   group_per_decay: bool = True) -> torch.optim.Optimizer:
    """`trainer.optimizer` over two parameter groups: weight-decayed matrices, and biases and norm parameters
    without decay (only adamw has `trainer.weight_decay` > 0: the config check). `fused`: whether a GPU update may
    be one fused kernel (Lightning clips no fused optimizer under mixed precision: it unscales inside its step).
    `group_per_decay=False`: one group for an optimizer that never decays (adam, sgd), for an engine that pays per
    group (DeepSpeed's ZeRO-1 and -2: a flat buffer and collectives of its own per group). adamw keeps its two groups at
    any weight decay, so that a resumed run or a PBT trial with another `weight_decay` finds the groups it saved."""
    decay, plain = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (plain if no_weight_decay(name, param.dim()) else decay).append(param)
    if not group_per_decay and trainer.optimizer != "adamw":
        decay, plain = decay + plain, []
    groups = [group for group in ({"params": decay, "weight_decay": trainer.weight_decay},
                                  {"params": plain, "weight_decay": 0.0}) if group["params"]]
    kernels = update_kernels(decay + plain, fused)
    if trainer.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=trainer.lr, momentum=trainer.momentum, **kernels)
    if trainer.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=trainer.lr, **kernels)
    return torch.optim.Adam(groups, lr=trainer.lr, **kernels)


def update_kernels(params: list[torch.Tensor], fused: bool = True) -> dict[str, bool]:
    """How the optimizer runs its update: on CPUs one multi-tensor (foreach) kernel per update op instead of torch's
    default loop over the parameters (a faster CPU step, the same numbers bit for bit); on a GPU one fused kernel
    per parameter group, where a host-bound step pays for each op it dispatches (benchmarks/README.md,
    gpu_loop.py). Sharded (DTensor) parameters keep torch's default, except beside plain
    ones (a tensor-parallel plan leaves embeddings and norms whole): torch's default on CUDA, one foreach kernel
    over a group's tensors, refuses that mix, so those update one tensor at a time."""
    sharded = [isinstance(param, DTensor) for param in params]
    if all(sharded) and params:
        return {}
    if any(sharded):
        return {"foreach": False}
    if params and all(param.is_cuda for param in params) and fused:
        return {"fused": True}
    return {"foreach": True}


def with_kernels_of(optimizer: torch.optim.Optimizer, saved: dict) -> dict:
    """`saved` (an optimizer state dict) with `optimizer`'s update kernels in its groups. torch's `load_state_dict`
    keeps the saved groups' flags and places the saved step counters by them: a CPU run's checkpoint resumed on a
    GPU would update with CPU-style kernels and CPU counters, where a fresh GPU run's are fused, with counters on the
    GPU (and a GPU run's checkpoint would resume fused on the CPU). This run's flags make it resume as it starts."""
    own = [{key: group[key] for key in ("foreach", "fused") if key in group} for group in optimizer.param_groups]
    return {**saved, "param_groups": [{**group, **flags} for group, flags in zip(saved["param_groups"], own)]}


@dataclass
class TorchRecipe:
    """What the adapter needs to take an optimizer step the recipe's way."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    passes: int = 1                                   # batches per optimizer step (`trainer.grad_accum`)
    grad_clip: float | None = None                    # max global gradient norm
    autocast_dtype: torch.dtype | None = None         # bf16 / fp16 forward passes
    scaler: torch.amp.GradScaler | None = None        # fp16: loss scaling
    hyperparameters: list[dict] | None = None         # each param group's config values (`configured_groups`)

    def state_dict(self) -> dict:
        """Scheduler (and scaler) state; the optimizer's is saved by the adapter (dense, for sharded models)."""
        state = {"scheduler": self.scheduler.state_dict()}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """After the adapter loaded the optimizer's state: the schedule's position (and loss scale) from the
        checkpoint, the hyperparameters from the config. A checkpoint holds the learning rate, weight decay and
        momentum it was trained with; loading them back would ignore a changed config (a PBT trial continuing
        another's checkpoint with a mutated lr, a user resuming with a lower one). TF's optimizers keep no
        hyperparameters in their variables, so both frameworks resume the same way."""
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        if self.hyperparameters is not None:
            self._apply_configured(self.hyperparameters)

    def _apply_configured(self, groups: list[dict]) -> None:
        step = self.scheduler.last_epoch
        self.scheduler.base_lrs = [group["lr"] for group in groups]
        for param_group, configured, factor in zip(self.optimizer.param_groups, groups, self.scheduler.lr_lambdas):
            param_group.update(configured, initial_lr=configured["lr"], lr=configured["lr"] * factor(step))


def build_recipe(model: nn.Module, trainer: Any, steps_per_epoch: int, device: torch.device,
                 wrap_optimizer: Callable[[torch.optim.Optimizer], torch.optim.Optimizer] | None = None,
                 fused: bool = True, group_per_decay: bool = True) -> TorchRecipe:
    """The recipe of `trainer` for `model` (plain or sharded parameters); `wrap_optimizer`: e.g. Horovod's
    DistributedOptimizer, which the schedule must then drive. The schedule spans `trainer.epochs` epochs of
    `steps_per_epoch` batches. `fused`, `group_per_decay`: see `make_optimizer`."""
    optimizer = make_optimizer(model, trainer, fused, group_per_decay)
    if wrap_optimizer is not None:
        optimizer = wrap_optimizer(optimizer)
    configured = configured_groups(optimizer)  # before the schedule scales the learning rates
    warmup, total = schedule_steps(trainer, steps_per_epoch)
    schedule = trainer.lr_schedule
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, schedule, warmup, total))
    dtype = AUTOCAST_DTYPES[trainer.precision]
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    return TorchRecipe(optimizer, scheduler, trainer.grad_accum, trainer.grad_clip, dtype, scaler, configured)


def configured_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's hyperparameters as the config set them (before any checkpoint is loaded)."""
    keys = ("lr", "weight_decay", "momentum")
    return [{key: group[key] for key in keys if key in group} for group in optimizer.param_groups]


def clip_dense_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip gradients of a model whose every rank holds whole parameters (DDP, Horovod) to `max_norm`."""
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
