"""A user's tensor-parallel plan: torch `ParallelStyle`s by module-name pattern (`styles_plan`), the form a model
spec of a user's own gives (contract/registry.py `ModelSpec.tensor_parallel`). On 2 gloo ranks in float64, the
sharded model computes what the dense one does, gets the same gradients, and takes the same optimizer step; its
state moves to the dense form and back, as checkpoints need."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from tests.support.dist_utils import RankPools, seeded_float64
from tests.support.parallel_checks import check_grads, check_optimizer_steps, close, local
from trainers.torch.parallel.mesh import ParallelDims, build_mesh
from trainers.torch.parallel.plans import shard_state_dict, styles_plan, unshard_state_dict


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class UserModel(nn.Module):
    """What a user might write: blocks in a ModuleList, then a head; no parallelism inside."""

    def __init__(self, width: int = 8, classes: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


PLAN = styles_plan({"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()})


def _user_plan(rank: int, n: int) -> None:
    seeded_float64()
    dense, twin = UserModel(), UserModel()
    twin.load_state_dict(dense.state_dict())
    par = PLAN(twin, build_mesh(ParallelDims(1, n)), "dtensor")
    assert local(par.blocks[0].up.weight).shape == (32 // n, 8)  # sharded by the plan, every block
    assert local(par.blocks[1].down.weight).shape == (8, 32 // n)
    x = torch.randn(5, 8)
    close(local(par(x)), dense(x), "output")
    loss_weights = torch.randn(5, 3)
    (dense(x) * loss_weights).sum().backward()
    (par(x) * loss_weights).sum().backward()
    check_grads(dense, par)
    state = unshard_state_dict(par)  # the dense form a checkpoint holds
    for name, value in dense.state_dict().items():
        close(state[name], value, f"dense form of {name}")
    resharded = shard_state_dict(par, state)
    for name, value in par.state_dict().items():
        close(local(resharded[name]), local(value), f"shard of {name}")
    check_optimizer_steps(dense, par)


def test_a_user_plan_shards_a_user_model_as_the_dense_one_computes(run_ranks: RankPools) -> None:
    run_ranks(_user_plan, 2)


def test_a_plan_naming_no_module_is_an_error() -> None:
    plan = styles_plan({"blocks.*.gate": ColwiseParallel()})
    with pytest.raises(ValueError, match=r"tensor-parallel plan: 'blocks\.\*\.gate' names no module of UserModel"):
        plan(UserModel(), None, "dtensor")
