"""The four TP collectives, with inputs equal to the rank so every expected value is computed by hand."""
from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from tests.support.dist_utils import RankFailure, RankPools, seeded_float64
from trainers.torch.parallel.comm import copy_to_tp, gather_from_tp, reduce_from_tp, split_to_tp

# Small integers in float64 are exact, so the checks are exact equality (no tolerance).


def _check_copy_and_reduce(rank: int, n: int) -> None:
    group = dist.group.WORLD
    x = torch.full((3,), float(rank), requires_grad=True)
    y = copy_to_tp(x, group)
    assert torch.equal(y, x)  # identity forward
    y.backward(torch.full((3,), float(rank + 1)))
    assert torch.equal(x.grad, torch.full((3,), float(n * (n + 1) // 2)))  # sum over ranks of (rank + 1)

    x = torch.full((3,), float(rank), requires_grad=True)
    y = reduce_from_tp(x, group)
    assert torch.equal(y, torch.full((3,), float(n * (n - 1) // 2)))  # 0 + 1 + ... + (n-1)
    assert torch.equal(x.detach(), torch.full((3,), float(rank)))  # the input was not reduced in place
    y.backward(torch.full((3,), float(rank + 1)))
    assert torch.equal(x.grad, torch.full((3,), float(rank + 1)))  # identity backward


def _check_gather_and_split(rank: int, n: int) -> None:
    group = dist.group.WORLD
    x = torch.full((2, 1), float(rank), requires_grad=True)
    y = gather_from_tp(x, group, dim=-1)  # (2, n), column j came from rank j
    assert torch.equal(y, torch.arange(n, dtype=torch.float64).expand(2, n))
    grad = 10.0 * torch.arange(n, dtype=torch.float64).expand(2, n) + 100.0 * rank
    y.backward(grad)
    assert torch.equal(x.grad, torch.full((2, 1), 110.0 * rank))  # own column: 10*rank + 100*rank

    full = torch.arange(n, dtype=torch.float64).expand(2, n).clone().requires_grad_()
    y = split_to_tp(full, group, dim=-1)
    assert torch.equal(y, torch.full((2, 1), float(rank)))
    y.backward(torch.full((2, 1), float(rank + 1)))
    assert torch.equal(full.grad, torch.arange(1, n + 1, dtype=torch.float64).expand(2, n))


def _check_group_of_one_skips_communication(rank: int, n: int) -> None:
    singles = [dist.new_group([r]) for r in range(n)]  # new_group is collective: every rank creates every group
    own = singles[rank]
    x = torch.full((3,), float(rank), requires_grad=True)
    with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as reduce_spy, \
            mock.patch.object(dist, "all_gather", wraps=dist.all_gather) as gather_spy:
        y = gather_from_tp(reduce_from_tp(copy_to_tp(x, own), own), own)
        y.sum().backward()
    assert reduce_spy.call_count == 0 and gather_spy.call_count == 0
    assert torch.equal(y, x.detach())
    assert torch.equal(x.grad, torch.ones(3))


def _collectives(rank: int, n: int) -> None:
    seeded_float64()
    _check_copy_and_reduce(rank, n)
    _check_gather_and_split(rank, n)
    _check_group_of_one_skips_communication(rank, n)


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_forward_and_backward(run_ranks: RankPools, world_size: int) -> None:
    run_ranks(_collectives, world_size)


def _failing_rank(rank: int, n: int) -> None:
    assert rank != 1, "rank 1 fails on purpose"


def test_a_failing_rank_fails_the_caller(run_ranks: RankPools) -> None:
    # Rank 0 then waits in a barrier for rank 1: the pool must report rank 1's error, not hang or blame rank 0.
    with pytest.raises(RankFailure, match=r"(?s)failed first on rank 1:.*AssertionError: rank 1 fails on purpose"):
        run_ranks(_failing_rank, 2)
    run_ranks(_collectives, 2)  # and the next call gets a fresh, working pool
