"""A straggler under real DDP on 2 gloo ranks (no Ray): rank 1 is made slow, in its data or in its forward pass,
and the loop's per-rank times, gathered once an epoch, name it in rank 0's `straggler` tag; rank 0 is not
named. The slowness is injected as a pause inside rank 1's own work (the others then wait for it inside the
gradient all-reduce, as they would for a slow disk or a busy host)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from pipelines.data.mnist import mnist_schema
from contract.stragglers import STRAGGLER_TAG
from tests.support.dist_utils import RankPools
from tests.support.loop_harness import config, mnist_columns, run_attempt, shard

ROWS, BATCH, PAUSE_S = 128, 16, 0.03  # 4 steps a rank; the pause is ten times a step of this MLP


def _data(rank: int):
    from trainers.torch.data import ShardBatches

    columns = {k: torch.from_numpy(v) for k, v in shard(mnist_columns(ROWS), rank, 2).items()}

    def data(seed: int):
        return (ShardBatches.from_columns(columns, mnist_schema(), BATCH, seed),
                ShardBatches.from_columns(columns, mnist_schema(), 32, seed))
    return data


def _slowed(where: str, adapter) -> None:
    """Rank 1's pause, in its batches or in its forward."""
    if where == "data":
        batches = adapter.batches

        def slow_batches(epoch, skip):
            for batch in batches(epoch, skip):
                time.sleep(PAUSE_S)
                yield batch
        adapter.batches = slow_batches
    else:
        forward = adapter.forward

        def slow_forward(*inputs):
            time.sleep(PAUSE_S)
            return forward(*inputs)
        adapter.forward = slow_forward


def _straggle(rank: int, world_size: int, tmp: str, where: str) -> None:
    from trainers.adapter import WorkerData
    from trainers.torch.ddp import DDP

    torch.set_default_dtype(torch.float32)
    cfg = config(Path(tmp) / f"cfg{rank}", ["trainer.batch_size=16", "trainer.epochs=2", "trainer.num_workers=2",
                                             "model.hidden=[16]"])

    def run(ctx):
        adapter = DDP().build_adapter(cfg, ctx, WorkerData(mnist_schema(), _data(rank)))
        if rank == 1:
            _slowed(where, adapter)
        return DDP().train(cfg, ctx, adapter)
    attempt = run_attempt(run, rank, world_size, 2, Path(tmp) / f"run{rank}")
    if rank != 0:
        return
    recorder = attempt.recorder
    tag = recorder.tags[STRAGGLER_TAG]
    assert "rank 1:" in tag and "rank 0:" not in tag, tag
    for epoch in (1, 2):
        extras = recorder.extras[epoch]
        paused = {"data": "data_wait_ms", "forward": "forward_ms"}[where]
        assert extras[f"rank1.{paused}"] >= PAUSE_S * 1000 > extras[f"rank0.{paused}"], extras
        # The fast rank's step waits for the slow one: the ranks' steps take about as long.
        assert extras["rank0.step_time_ms"] >= PAUSE_S * 1000 * 0.9, extras


@pytest.mark.parametrize("where", ["data", "forward"])
def test_a_slow_rank_is_named_a_straggler(run_ranks: RankPools, tmp_path, where):
    run_ranks(_straggle, 2, str(tmp_path), where)
