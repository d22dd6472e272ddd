"""The DeepSpeed adapter on the shared loop, on 2 gloo ranks (no Ray), ZeRO-3 over the MNIST MLP: the ranks train
what the dense model trains on both ranks' batches (step losses, and the dense export of the final checkpoint),
stop/resume parity through DeepSpeed's partitioned checkpoint, each rank holds half of the parameters and of Adam's
moments; and a checkpoint saved at 2 ranks loads at 1 (through DeepSpeed's universal format) with the model and the
optimizer state equal: one more step there is the dense model's step from the consolidated weights and moments.
The stages 1-3 with accumulation and a schedule, one rank: tests/unit/test_loop_backends.py."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from pipelines.data.mnist import mnist_schema
from tests.support.dist_utils import RankPools
from tests.support.loop_harness import (check_stop_resume_parity, config, last_checkpoint, make_context,
                                        mnist_columns, shard)
from tests.support.parallel_checks import dense_training

pytestmark = pytest.mark.slow

ROWS, BATCH = 640, 16  # 320 rows per rank: 20 steps per epoch, so the stop at step 10 is mid-epoch
OVERRIDES = ["trainer=deepspeed", "trainer.zero_stage=3", "model.hidden=[32]", "model.dropout=0",
             f"trainer.batch_size={BATCH}", "trainer.epochs=2", "trainer.optimizer=adam", "trainer.lr=0.002",
             "trainer.grad_clip=0.5"]


def _data(rank: int, ranks: int):
    from trainers.torch.data import ShardBatches

    train = {k: torch.from_numpy(v) for k, v in shard(mnist_columns(ROWS), rank, ranks).items()}
    evaluation = {k: torch.from_numpy(v) for k, v in shard(mnist_columns(64, seed=1), rank, ranks).items()}
    return lambda seed: (ShardBatches.from_columns(train, mnist_schema(), BATCH, seed),
                         ShardBatches.from_columns(evaluation, mnist_schema(), 32, seed))


def _torchrun_env(rank: int, world_size: int) -> None:
    """What Ray Train sets for a worker and DeepSpeed reads."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size)})


def _no_whole_parameters(tmp_path: Path) -> str:
    """A DeepSpeed JSON that partitions every parameter: by default ZeRO-3 keeps parameters under 1e5 elements whole
    on every rank (its persistence threshold), which is all of this MLP's."""
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}')
    return f"trainer.deepspeed_config={path}"


def _run(cfg, rank: int, world_size: int):
    from trainers.adapter import WorkerData
    from trainers.torch.deepspeed import DeepSpeed

    return lambda ctx: DeepSpeed().run_worker(cfg, ctx, WorkerData(mnist_schema(), _data(rank, world_size)))


def _train_two_ranks(rank: int, world_size: int, tmp: str) -> None:
    from trainers.torch.deepspeed import DeepSpeed

    _torchrun_env(rank, world_size)
    tmp_path = Path(tmp)
    cfg = config(tmp_path / f"cfg{rank}", [*OVERRIDES, "trainer.num_workers=2", _no_whole_parameters(tmp_path)])
    runs = check_stop_resume_parity(_run(cfg, rank, world_size), tmp_path / "deepspeed", rank, world_size,
                                    rtol=1e-5, atol=1e-6, barrier=dist.barrier)
    if rank == 0:
        shards = [_data(r, 2)(cfg.run.seed + 1000 * r)[0] for r in range(2)]
        losses, model = dense_training(cfg, mnist_schema(), shards)
        # float32: the partitioned reductions sum in another order than the dense backward
        np.testing.assert_allclose(runs["straight"].recorder.curve(), losses, rtol=1e-4, atol=1e-5)
        straight = last_checkpoint(tmp_path / "deepspeed" / "straight")
        exported = DeepSpeed().dense_state(str(straight))  # what MLflow gets
        assert exported.keys() == model.state_dict().keys()
        for name, value in model.state_dict().items():
            torch.testing.assert_close(exported[name], value, rtol=1e-4, atol=1e-5, msg=name)
        memory = runs["straight"].recorder.extras[1]
        dense_bytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
        for r in range(2):  # ZeRO-3: half of the parameters and of Adam's two moments on each rank
            assert abs(memory[f"rank{r}.param_bytes"] / dense_bytes - 0.5) < 0.01
            assert abs(memory[f"rank{r}.optimizer_state_bytes"] / (2 * dense_bytes) - 0.5) < 0.01


def _load_at_one_rank(rank: int, world_size: int, tmp: str) -> None:
    """The checkpoint the 2 ranks saved after epoch 1, loaded by 1 rank: its weights are the consolidated ones,
    and one step on a batch moves them as a dense Adam step moves the consolidated weights with the consolidated
    moments (DeepSpeed's universal files: one per parameter)."""
    from trainers.adapter import WorkerData
    from trainers.torch.deepspeed import DeepSpeed, TAG, to_universal
    from trainers.torch.recipe import build_recipe
    from trainers.models import build_model

    _torchrun_env(0, 1)
    tmp_path = Path(tmp)
    checkpoint = tmp_path / "deepspeed" / "straight" / "checkpoint_1"
    cfg = config(tmp_path / "cfg-one", [*OVERRIDES, "trainer.num_workers=1", _no_whole_parameters(tmp_path)])
    ctx = make_context(0, 1, 2, tmp_path / "one", None, [], restored=checkpoint)
    adapter = DeepSpeed().build_adapter(cfg, ctx, WorkerData(mnist_schema(), _data(0, 1)))
    assert adapter.universal
    adapter.load(str(checkpoint))
    consolidated = DeepSpeed().dense_state(str(checkpoint))
    for name, value in adapter.dense_model_state().items():
        torch.testing.assert_close(value, consolidated[name], rtol=0, atol=0, msg=name)

    model = build_model(cfg.model, mnist_schema())
    model.load_state_dict(consolidated)
    recipe = build_recipe(model, cfg.trainer, 20, torch.device("cpu"))
    universal = Path(to_universal(str(checkpoint), str(tmp_path / "universal"))) / TAG / "zero"
    steps = adapter.recipe.scheduler.last_epoch
    assert steps == 20  # epoch 1's updates
    for name, param in model.named_parameters():
        recipe.optimizer.state[param] = {
            "step": torch.tensor(float(steps)),
            **{moment: torch.load(universal / name / f"{moment}.pt").reshape(param.shape)
               for moment in ("exp_avg", "exp_avg_sq")}}
    batch = next(iter(adapter.batches(2, skip=0)))
    adapter.train_step(batch)
    recipe.optimizer.zero_grad()
    torch.nn.CrossEntropyLoss()(model(*batch[0]), batch[1]).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
    recipe.optimizer.step()
    for name, value in adapter.dense_model_state().items():
        torch.testing.assert_close(value, model.state_dict()[name], rtol=1e-5, atol=1e-7, msg=name)


def test_zero3_trains_the_dense_model_and_its_checkpoint_loads_at_another_world_size(own_ranks: RankPools, tmp_path):
    own_ranks(_train_two_ranks, 2, str(tmp_path))
    own_ranks(_load_at_one_rank, 1, str(tmp_path))
