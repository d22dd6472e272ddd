"""Each Megatron layer against the dense module it was sharded from (float64, same seed and input on all ranks).

Tolerances: see tests/support/parallel_checks.py.
"""
from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from tests.support.parallel_checks import check_grads, check_optimizer_steps, close, local
from tests.support.dist_utils import RankPools, seeded_float64
from trainers.models.bert import MLP, SelfAttention
from trainers.models.bert_parallel import ParallelMLP, ParallelSelfAttention, attention_plan
from trainers.torch.parallel.layers import ColumnParallelLinear, RowParallelLinear, TPLayer, VocabParallelEmbedding
from trainers.torch.parallel.mesh import ParallelDims, build_mesh


def _column(rank: int, n: int) -> None:
    group = dist.group.WORLD
    for gather in (False, True):
        seeded_float64()
        dense = nn.Linear(8, 12)  # 12 output features split 2 or 4 ways
        par = ColumnParallelLinear.from_dense(dense, group, gather_output=gather)
        assert par.weight.shape == (12 // n, 8) and par.bias.shape == (12 // n,)
        x = torch.randn(3, 8)
        loss_weights = torch.randn(3, 12)  # a fixed random linear loss exercises every output gradient
        xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
        yd, yp = dense(xd), par(xp)
        own = slice(None) if gather else slice(rank * 12 // n, (rank + 1) * 12 // n)
        close(yp, yd[:, own], "output")
        (yd * loss_weights).sum().backward()
        # Without gather each rank holds part of the loss; copy_to_tp's all-reduce sums their input gradients.
        (yp * loss_weights[:, own]).sum().backward()
        close(xp.grad, xd.grad, "input grad")
        check_grads(dense, par)
        check_optimizer_steps(dense, par)


def _row(rank: int, n: int) -> None:
    group = dist.group.WORLD
    for input_is_parallel in (True, False):
        seeded_float64()
        dense = nn.Linear(8, 6)
        par = RowParallelLinear.from_dense(dense, group, input_is_parallel=input_is_parallel)
        assert par.weight.shape == (6, 8 // n) and par.bias.shape == (6,)
        x = torch.randn(3, 8)
        own = slice(rank * 8 // n, (rank + 1) * 8 // n) if input_is_parallel else slice(None)
        xd, xp = x.clone().requires_grad_(), x[:, own].clone().requires_grad_()
        yd, yp = dense(xd), par(xp)
        close(yp, yd, "output")  # replicated: the full output on every rank, bias added once
        loss_weights = torch.randn(3, 6)
        (yd * loss_weights).sum().backward()
        (yp * loss_weights).sum().backward()
        close(xp.grad, xd.grad[:, own], "input grad")
        check_grads(dense, par)
        check_optimizer_steps(dense, par)


@pytest.mark.parametrize("world_size", [2, 4])
def test_column_parallel_linear_matches_dense(run_ranks: RankPools, world_size: int) -> None:
    run_ranks(_column, world_size)


@pytest.mark.parametrize("world_size", [2, 4])
def test_row_parallel_linear_matches_dense(run_ranks: RankPools, world_size: int) -> None:
    run_ranks(_row, world_size)


def _mlp(rank: int, n: int) -> None:
    seeded_float64()
    dense = MLP(16, 64, dropout=0.0)
    par = ParallelMLP.from_dense(dense, dist.group.WORLD)
    x = torch.randn(2, 4, 16)
    xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss_weights = torch.randn(2, 4, 16)
    yd = dense(xd)
    (yd * loss_weights).sum().backward()
    with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as spy:
        yp = par(xp)
        assert spy.call_count == 1, f"forward did {spy.call_count} all-reduces, expected 1"
        (yp * loss_weights).sum().backward()
        assert spy.call_count == 2, f"backward did {spy.call_count - 1} all-reduces, expected 1"
    close(yp, yd, "output")
    close(xp.grad, xd.grad, "input grad")
    check_grads(dense, par)


def test_parallel_mlp_matches_dense_with_one_all_reduce_each_way(run_ranks: RankPools) -> None:
    run_ranks(_mlp, 2)


def _attention(rank: int, n: int, impl: str) -> None:
    seeded_float64()
    dense = SelfAttention(32, 4, dropout=0.0)
    par = SelfAttention(32, 4, dropout=0.0)
    par.load_state_dict(dense.state_dict())
    if impl == "megatron":
        par = ParallelSelfAttention.from_dense(par, dist.group.WORLD)
    else:
        parallelize_module(par, build_mesh(ParallelDims(1, n))["tp"], attention_plan())
    assert local(par.q_proj.weight).shape == (32 // n, 32)  # the plan really sharded the heads
    x = torch.randn(2, 6, 32)
    key_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss_weights = torch.randn(2, 6, 32)
    yd = dense(xd, key_mask)
    (yd * loss_weights).sum().backward()
    with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as spy:
        yp = par(xp, key_mask)
        (yp * loss_weights).sum().backward()
    if impl == "megatron":  # one copy_to_tp shared by q/k/v, one reduce after out_proj
        assert spy.call_count == 2, f"{spy.call_count} all-reduces, expected 1 forward + 1 backward"
    close(local(yp), yd, "output")
    close(xp.grad, xd.grad, "input grad")
    check_grads(dense, par)


@pytest.mark.parametrize("impl", ["megatron", "dtensor"])
def test_parallel_self_attention_matches_dense(run_ranks: RankPools, impl: str) -> None:
    run_ranks(_attention, 2, impl)


def _embedding(rank: int, n: int) -> None:
    seeded_float64()
    dense = nn.Embedding(50, 8)  # 50 rows over 4 ranks: blocks of 13, the last one padded with 2 unused rows
    par = VocabParallelEmbedding.from_dense(dense, dist.group.WORLD)
    assert par.weight.shape == (13, 8)
    ids = torch.tensor([[0, 12, 13, 25], [26, 38, 39, 49]])  # both edges of every block
    yd, yp = dense(ids), par(ids)
    close(yp, yd, "output")
    loss_weights = torch.randn(2, 4, 8)
    (yd * loss_weights).sum().backward()
    (yp * loss_weights).sum().backward()
    check_grads(dense, par)
    close(par.full_tensor("weight", par.weight.detach()), dense.weight.detach(), "gathered table")
    check_optimizer_steps(dense, par)


def test_vocab_parallel_embedding_matches_dense_with_uneven_vocab(run_ranks: RankPools) -> None:
    run_ranks(_embedding, 4)


def _construct_without_dense(rank: int, n: int) -> None:
    """Built directly, a TP layer draws the full dense init and keeps its shard: same seed, same function."""
    group = dist.group.WORLD
    for make_dense, make_par in ((lambda: nn.Linear(8, 12), lambda: ColumnParallelLinear(8, 12, group)),
                                 (lambda: nn.Linear(8, 6), lambda: RowParallelLinear(8, 6, group)),
                                 (lambda: nn.Embedding(10, 4), lambda: VocabParallelEmbedding(10, 4, group))):
        seeded_float64(1)
        dense = make_dense()
        seeded_float64(1)
        par: TPLayer = make_par()
        for name, p in par.named_parameters():
            close(par.full_tensor(name, p.detach()), getattr(dense, name).detach(), name)
    with pytest.raises(ValueError, match="tp=2 does not divide out_features=5"):
        ColumnParallelLinear(8, 5, group)
    with pytest.raises(ValueError, match="tp=2 does not divide heads=3"):
        ParallelSelfAttention(6, 3, group)


def test_direct_construction_shards_the_dense_init(run_ranks: RankPools) -> None:
    run_ranks(_construct_without_dense, 2)
