"""`run_ranks(fn, world_size, *args)`: run a module-level test function on gloo CPU ranks (see dist_utils)."""
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
