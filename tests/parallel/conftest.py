"""`run_ranks(fn, world_size, *args)`: run a module-level test function on gloo CPU ranks (see dist_utils);
`own_ranks`: the same, on rank processes of the test's own."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.dist_utils import RankPools


@pytest.fixture(scope="package")  # ended after tests/parallel: 6 idle ranks took ~5 CPU-s a minute from later tests
def run_ranks() -> Iterator[RankPools]:
    pools = RankPools()
    try:
        yield pools
    finally:
        pools.close()


@pytest.fixture
def own_ranks() -> Iterator[RankPools]:
    """Rank processes of the test's own, ended after it: DeepSpeed's ZeRO-3 replaces `torch.nn.functional.linear`
    (with its `zero3_linear_wrap`) in the processes it runs in, which changed a later test's bf16 steps in the
    shared ranks."""
    pools = RankPools()
    try:
        yield pools
    finally:
        pools.close()
