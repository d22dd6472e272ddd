"""The PyTorch recipe under real DDP on 2 gloo ranks (no Ray): gradient accumulation with `no_sync`, including an
epoch whose last optimizer step has fewer batches (DDP skipped their all-reduce: the adapter averages them
itself), plus clipping and a schedule, against a dense reference computed by hand on the same batches."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipelines.data.mnist import mnist_schema
from tests.support.loop_harness import config, mnist_columns, run_attempt, shard
from tests.support.dist_utils import RankPools

ROWS, BATCH = 160, 16  # 80 rows per rank: 5 batches, accumulated 2 + 2 + 1
OVERRIDES = ["trainer.batch_size=16", "trainer.optimizer=sgd", "trainer.lr=0.05", "model.dropout=0", "trainer.epochs=1",
             "trainer.num_workers=2", "trainer.grad_accum=2",
             "trainer.lr_schedule=linear", "trainer.warmup_steps=1", "trainer.grad_clip=0.5"]


def _batches(rank: int):
    from trainers.torch.data import ShardBatches

    columns = {k: torch.from_numpy(v) for k, v in shard(mnist_columns(ROWS), rank, 2).items()}
    evaluation = {k: torch.from_numpy(v) for k, v in mnist_columns(32, seed=1).items()}

    def data(seed: int):
        return (ShardBatches.from_columns(columns, mnist_schema(), BATCH, seed),
                ShardBatches.from_columns(evaluation, mnist_schema(), 32, seed))
    return data


def _dense_reference(cfg, model: nn.Module) -> dict[str, torch.Tensor]:
    """One process: each optimizer step's gradient is the mean over both ranks' batches of the group (each batch's
    loss / grad_accum, averaged over the 2 ranks, as DDP does), clipped, then SGD with the linear schedule. Each
    rank's batches draw their dropout masks from that rank's own stream (seed + 1000 x rank)."""
    from trainers.torch.recipe import build_recipe

    recipe = build_recipe(model, cfg.trainer, 5, torch.device("cpu"))
    epochs = [list(_batches(r)(cfg.run.seed + 1000 * r)[0].epoch(1)) for r in range(2)]
    streams = [torch.Generator().manual_seed(cfg.run.seed + 1000 * r).get_state() for r in range(2)]
    loss_fn = nn.CrossEntropyLoss()
    for group in ([0, 1], [2, 3], [4]):
        recipe.optimizer.zero_grad()
        for rank in range(2):
            for i in group:
                inputs, labels, _ = epochs[rank][i]
                torch.set_rng_state(streams[rank])
                (loss_fn(model(*inputs), labels) / 2 / 2).backward()
                streams[rank] = torch.get_rng_state()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
        recipe.optimizer.step()
        recipe.scheduler.step()
    return model.state_dict()


# the CNN trains in channels-last memory format (trainers/torch/adapter.place_model); its reference is plain NCHW.
# `compiled`: the same MLP trained through torch.compile (DDP's graph split at its buckets).
# `dropout`: the MLP with dropout on; the reference draws each rank's masks from its own stream
# (trainers/torch/adapter.seed_dropout), so ranks sharing one stream would fail it.
MODELS = {"mlp": ["model.hidden=[32]"], "cnn": ["model=cnn", "model.channels=[4,8]", "model.hidden=16"],
          "compiled": ["model.hidden=[32]", "trainer.compile=true"],
          "dropout": ["model.hidden=[32]", "model.dropout=0.5"]}


def _accumulate(rank: int, world_size: int, tmp: str, model: str) -> None:
    from trainers.adapter import WorkerData
    from trainers.models import build_model
    from trainers.torch.ddp import DDP

    torch.set_default_dtype(torch.float32)  # the pool's ranks may have run a float64 test before
    cfg = config(Path(tmp) / f"cfg{rank}", [*OVERRIDES, *MODELS[model]])  # the model's keys last: they win
    adapters = []

    def run(ctx):
        adapters.append(DDP().build_adapter(cfg, ctx, WorkerData(mnist_schema(), _batches(rank))))
        return DDP().train(cfg, ctx, adapters[-1])
    run_attempt(run, rank, world_size, 1, Path(tmp) / f"run{rank}")
    [adapter] = adapters
    assert isinstance(adapter.model, nn.parallel.DistributedDataParallel)  # 2 ranks: wrapped as Ray's prepare_model
    convs = [m for m in adapter.model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == (2 if model == "cnn" else 0)
    assert all(c.weight.is_contiguous(memory_format=torch.channels_last) for c in convs)
    assert (adapter.forward is not adapter.model) == cfg.trainer.compile  # trained through torch.compile or not
    trained = adapter.dense_model_state()
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, trained)
    for name, value in trained.items():  # replicas stay identical, the partial last step included
        torch.testing.assert_close(gathered[1 - rank][name], value, rtol=0, atol=0)
    if rank == 0:
        torch.manual_seed(cfg.run.seed)
        expected = _dense_reference(cfg, build_model(cfg.model, mnist_schema(), seed=cfg.run.seed))
        # float32, 3 steps: DDP's bucketed all-reduce sums in another order than the reference (~1e-7 relative);
        # compiled kernels fuse and reorder too.
        for name, value in trained.items():
            torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6 if model != "compiled" else 1e-5)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_ddp_accumulation_with_a_partial_last_step_matches_the_dense_reference(run_ranks: RankPools, tmp_path,
                                                                                model):
    run_ranks(_accumulate, 2, str(tmp_path), model)
