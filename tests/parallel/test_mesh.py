"""ParallelDims validation and the rank layout (pure arithmetic: no processes)."""
from __future__ import annotations

import pytest

from trainers.torch.parallel.mesh import ParallelDims, rank_coords


@pytest.mark.parametrize("dims,kwargs,message", [
    (ParallelDims(dp=2, tp=3), {"world_size": 4}, "dp*pp*tp=6 != world_size=4"),
    (ParallelDims(dp=1, tp=3), {"world_size": 3, "heads": 4}, "tp=3 does not divide heads=4"),
    (ParallelDims(dp=1, tp=4), {"world_size": 4, "heads": 4, "hidden": 30}, "tp=4 does not divide hidden=30"),
    (ParallelDims(dp=0, tp=2), {"world_size": 0}, "dp, tp, pp and dp_replicate must be >= 1"),
    (ParallelDims(dp=2, tp=2, pp=2), {"world_size": 4}, "dp*pp*tp=8 != world_size=4"),
    (ParallelDims(dp=2, tp=1, dp_replicate=4), {"world_size": 2}, "dp_replicate=4 does not divide dp=2"),
])
def test_validate_rejects_impossible_dims(dims: ParallelDims, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        dims.validate(**kwargs)


def test_validate_accepts_a_good_layout() -> None:
    ParallelDims(dp=2, tp=2).validate(world_size=4, heads=4, hidden=32)
    assert ParallelDims(dp=3, tp=2).world_size == 6


def test_rank_coords_tp_groups_are_consecutive_dp_groups_strided() -> None:
    coords = [rank_coords(rank, dp=2, tp=4) for rank in range(8)]
    assert coords == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]
    tp_group_of_rank5 = [r for r in range(8) if coords[r][0] == coords[5][0]]
    dp_group_of_rank5 = [r for r in range(8) if coords[r][1] == coords[5][1]]
    assert tp_group_of_rank5 == [4, 5, 6, 7] and dp_group_of_rank5 == [1, 5]
    with pytest.raises(ValueError, match="rank=8 is outside"):
        rank_coords(8, dp=2, tp=4)


def test_pipeline_and_tp_ranks_read_the_same_batches() -> None:
    """rank = (dp_rank * pp + stage) * tp + tp_rank: 2 data shards for 8 ranks of pp 2 x tp 2."""
    dims = ParallelDims(dp=2, tp=2, pp=2, dp_replicate=2)
    dims.validate(world_size=8)
    assert (dims.world_size, dims.batch_group, dims.dp_shard) == (8, 4, 1)
    assert [dims.data_rank(rank) for rank in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    # dropout: a TP group's ranks draw alike; the two stages of one data shard draw their own
    assert [dims.dropout_stream(rank) for rank in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
