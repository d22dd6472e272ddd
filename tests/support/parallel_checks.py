"""Comparisons of a tensor-parallel module (either implementation) against its dense reference, inside a rank.

Tolerance: float64 (eps 2.2e-16). A TP rank sums its slice of a dot product and the all-reduce adds the slices,
a different order from the dense sum; over <= 128 terms of O(1) values, through two blocks of softmax and
LayerNorm (well conditioned at these sizes), the reordering error stays ~1e-14. atol 1e-10 / rtol 1e-8 leaves
ample headroom, yet is orders of magnitude below what a wrong shard, a missing or doubled reduction, or a wrong
head split gives (errors of O(1e-3..1)).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainers.torch.parallel.plans import shard_state_dict

TOL = {"atol": 1e-10, "rtol": 1e-8}  # justified in the module docstring


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def check_grads(dense: nn.Module, par: nn.Module) -> None:
    """Every local gradient equals this rank's chunk of the dense gradient (whole tensor if replicated)."""
    dense_grads = {name: p.grad for name, p in dense.named_parameters()}
    expected = shard_state_dict(par, dense_grads)
    for name, p in par.named_parameters():
        close(local(p.grad), expected[name], f"grad of {name}")


def check_weights(dense: nn.Module, par: nn.Module, when: str) -> None:
    expected = shard_state_dict(par, dict(dense.named_parameters()))
    for name, p in par.named_parameters():
        close(local(p.detach()), expected[name].detach(), f"{name} {when}")


def check_optimizer_steps(dense: nn.Module, par: nn.Module) -> None:
    """One SGD step, then one AdamW step on the same gradients: both are elementwise, so shards stay chunks."""
    for make in (lambda ps: torch.optim.SGD(ps, lr=0.1),
                 lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)):
        opt_dense, opt_par = make(dense.parameters()), make(par.parameters())
        opt_dense.step()
        opt_par.step()
        check_weights(dense, par, f"after {type(opt_dense).__name__} step")


def dense_training(cfg, inputs, shards: list) -> tuple[list[float], nn.Module]:
    """The plain model in one process, trained with `cfg`'s recipe on the data-parallel ranks' `shards`
    (ShardBatches) for `cfg.trainer.epochs` epochs: each step's loss is the mean of the ranks' batch losses (what
    averaged gradients descend), clipped by the global norm. Returns (those mean losses: the loop's `step_loss`,
    the model)."""
    from trainers.models import build_model
    from trainers.torch.recipe import build_recipe

    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, inputs, seed=cfg.run.seed)
    recipe = build_recipe(model, cfg.trainer, shards[0].steps(), torch.device("cpu"))
    loss_fn, losses = nn.CrossEntropyLoss(), []
    for epoch in range(1, cfg.trainer.epochs + 1):
        for batches in zip(*(s.epoch(epoch) for s in shards)):
            recipe.optimizer.zero_grad()
            per_rank = [loss_fn(model(*inputs), labels) for inputs, labels, _ in batches]
            loss = sum(per_rank) / len(shards)
            loss.backward()
            if cfg.trainer.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
            recipe.optimizer.step()
            recipe.scheduler.step()
            losses.append(loss.item())
    return losses, model
