"""The recipe (contract/recipe.py) and its PyTorch form (trainers/torch/recipe.py), in-process on one rank: the
schedule's curve, weight-decay groups, gradient accumulation as one larger batch, and bf16 autocast staying close
to fp32. DDP's accumulation on 2 ranks and TP's clipping norm: tests/parallel."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from pipelines.data.mnist import mnist_schema
from contract.recipe import Monitor, default_mode, lr_factor, schedule_steps, updates_per_epoch
from pipelines.config import ConfigError
from tests.support.loop_harness import config, mnist_columns, plain_context, run_attempt

SMALL = ["trainer.batch_size=16", "model.hidden=[32]", "model.dropout=0", "trainer.epochs=1", "trainer.num_workers=1"]


def test_lr_factor_warms_up_then_decays_to_zero():
    warm = [lr_factor(s, "cosine", 4, 20) for s in range(4)]
    assert warm == [0.25, 0.5, 0.75, 1.0]  # the first update already moves
    assert lr_factor(4, "cosine", 4, 20) == 1.0 and lr_factor(12, "cosine", 4, 20) == pytest.approx(0.5)
    assert lr_factor(20, "cosine", 4, 20) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(12, "linear", 4, 20) == 0.5 and lr_factor(30, "linear", 4, 20) == 0.0  # clamped past the end
    assert lr_factor(100, "constant", 0, 20) == 1.0
    cosine = [lr_factor(s, "cosine", 0, 10) for s in range(11)]
    assert all(a > b for a, b in zip(cosine, cosine[1:]))
    assert updates_per_epoch(5, 2) == 3 and updates_per_epoch(4, 2) == 2


def test_monitor_picks_the_later_epoch_on_ties_and_runs_out_of_patience():
    acc, loss = Monitor("test_accuracy", "max", patience=2), Monitor("train_loss", default_mode("train_loss"))
    assert acc.better(0.9, None) and acc.better(0.9, 0.9) and not acc.better(0.8, 0.9)
    assert loss.mode == "min" and loss.better(0.1, 0.2) and not loss.better(0.3, 0.2)
    assert acc.worst() == -sys.float_info.max and loss.worst() == sys.float_info.max  # JSON-safe
    assert not acc.exhausted(3, 2) and acc.exhausted(4, 2) and not loss.exhausted(99, 1)


def test_torch_schedule_and_weight_decay_groups(tmp_path):
    """LambdaLR applies lr * lr_factor(k) at update k; matrices decay, biases do not; on CPU parameters the
    update runs as multi-tensor (foreach) kernels."""
    from trainers.models import build_model
    from trainers.torch.recipe import build_recipe

    cfg = config(tmp_path, [*SMALL, "trainer.optimizer=adamw", "trainer.weight_decay=0.1", "trainer.lr=0.01",
                            "trainer.lr_schedule=cosine", "trainer.warmup_steps=3", "trainer.grad_accum=2"])
    model = build_model(cfg.model, mnist_schema())
    recipe = build_recipe(model, cfg.trainer, steps_per_epoch=9, device=torch.device("cpu"))  # 5 updates
    assert isinstance(recipe.optimizer, torch.optim.AdamW)
    assert recipe.optimizer.defaults["foreach"] and not recipe.optimizer.defaults["fused"]  # CPU: multi-tensor
    decayed, plain = recipe.optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decayed["params"])
    assert plain["weight_decay"] == 0.0 and all(p.dim() == 1 for p in plain["params"])
    lrs = []
    for _ in range(5):
        lrs.append(recipe.optimizer.param_groups[0]["lr"])
        recipe.optimizer.step()
        recipe.scheduler.step()
    np.testing.assert_allclose(lrs, [0.01 * lr_factor(k, "cosine", 3, 5) for k in range(5)], rtol=1e-12)

    # An engine that pays per group (DeepSpeed) gets one where nothing decays; adamw keeps its two at any decay
    for optimizer, groups in (("adam", 1), ("sgd", 1), ("adamw", 2)):
        same = config(tmp_path / optimizer, [*SMALL, f"trainer.optimizer={optimizer}"])
        one = build_recipe(model, same.trainer, 9, torch.device("cpu"), group_per_decay=False).optimizer
        assert len(one.param_groups) == groups
        assert sum(len(group["params"]) for group in one.param_groups) == len(list(model.parameters()))

    # warmup_fraction: the same curve with round(0.6 * 5) = 3 warmup updates; and both keys at once is an error
    fraction = config(tmp_path / "fraction", [*SMALL, "trainer.lr_schedule=cosine", "trainer.warmup_fraction=0.6",
                                              "trainer.grad_accum=2"])
    assert schedule_steps(fraction.trainer, 9) == (3, 5)
    with pytest.raises(ConfigError, match=r"^trainer\.warmup_fraction: set warmup_steps or warmup_fraction"):
        config(tmp_path / "both", [*SMALL, "trainer.warmup_steps=2", "trainer.warmup_fraction=0.5"])


def test_restored_checkpoint_keeps_its_schedule_position_but_takes_the_configs_hyperparameters(tmp_path):
    """A checkpoint trained at lr 0.01, weight decay 0.1 loaded by a recipe configured with lr 0.002, weight decay
    0.3 (a PBT trial exploiting another's checkpoint with mutated values): the schedule continues at the saved
    update, the Adam moments are the saved ones, the learning rate and decay are the config's. The checkpoint's
    groups say fused, as a GPU run's do: the restored optimizer updates with this run's CPU kernels."""
    from trainers.models import build_model
    from trainers.torch.recipe import build_recipe, with_kernels_of

    recipe_keys = ["trainer.optimizer=adamw", "trainer.lr_schedule=cosine", "trainer.warmup_steps=2"]
    saved = config(tmp_path / "a", [*SMALL, *recipe_keys, "trainer.lr=0.01", "trainer.weight_decay=0.1"])
    model = build_model(saved.model, mnist_schema())
    recipe = build_recipe(model, saved.trainer, steps_per_epoch=8, device=torch.device("cpu"))
    for _ in range(3):
        model(torch.randn(4, 784)).sum().backward()
        recipe.optimizer.step()
        recipe.scheduler.step()
    state = {"optimizer": recipe.optimizer.state_dict(), **recipe.state_dict()}
    for group in state["optimizer"]["param_groups"]:
        group.update(foreach=None, fused=True)

    changed = config(tmp_path / "b", [*SMALL, *recipe_keys, "trainer.lr=0.002", "trainer.weight_decay=0.3"])
    restored = build_recipe(model, changed.trainer, steps_per_epoch=8, device=torch.device("cpu"))
    restored.optimizer.load_state_dict(with_kernels_of(restored.optimizer, state["optimizer"]))
    restored.load_state_dict(state)
    assert restored.scheduler.last_epoch == 3
    decayed, plain = restored.optimizer.param_groups
    assert (decayed["weight_decay"], plain["weight_decay"]) == (0.3, 0.0)
    assert all(group["foreach"] and not group["fused"] for group in (decayed, plain))
    assert [g["lr"] for g in (decayed, plain)] == [pytest.approx(0.002 * lr_factor(3, "cosine", 2, 8))] * 2
    moments = restored.optimizer.state_dict()["state"][0]["exp_avg"]
    torch.testing.assert_close(moments, state["optimizer"]["state"][0]["exp_avg"])
    restored.scheduler.step()
    assert decayed["lr"] == pytest.approx(0.002 * lr_factor(4, "cosine", 2, 8))


def _train(tmp_path, overrides: list[str], batch: int):
    """One epoch of the DDP adapter (one rank, no DDP wrapper) on 320 rows; its final weights and step losses."""
    from trainers.adapter import WorkerData
    from trainers.torch.ddp import DDP
    from trainers.torch.data import ShardBatches

    cfg = config(tmp_path, [*SMALL, f"trainer.batch_size={batch}", *overrides])
    columns = {k: torch.from_numpy(v) for k, v in mnist_columns(320).items()}
    evaluation = {k: torch.from_numpy(v) for k, v in mnist_columns(32, seed=1).items()}

    def data(seed):
        return (ShardBatches.from_columns(columns, mnist_schema(), batch, seed),
                ShardBatches.from_columns(evaluation, mnist_schema(), 32, seed))
    adapter = DDP().build_adapter(cfg, plain_context(), WorkerData(mnist_schema(), data))
    attempt = run_attempt(lambda ctx: DDP().train(cfg, ctx, adapter), 0, 1, 1, tmp_path / "run")
    return adapter.dense_model_state(), attempt.recorder.curve()


def test_accumulating_k_batches_of_b_is_one_batch_of_k_times_b(tmp_path):
    """grad_accum=2 with 16 rows per batch takes the same 10 updates as 32 rows per batch (the epoch's row order
    is the same permutation, cut into halves): SGD with momentum and a schedule, both per update. (No clipping
    here: it would hide a gradient of the wrong scale; tests/parallel/test_ddp_recipe.py clips.)"""
    recipe = ["trainer.optimizer=sgd", "trainer.lr=0.05", "trainer.lr_schedule=linear", "trainer.warmup_steps=2"]
    accumulated, _ = _train(tmp_path / "a", [*recipe, "trainer.grad_accum=2"], 16)
    whole, _ = _train(tmp_path / "b", recipe, 32)
    for name, value in whole.items():
        # float32: the mean of two half-batch means vs one mean, summed in another order (~1e-7 relative a step)
        torch.testing.assert_close(accumulated[name], value, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_stays_close_to_fp32(tmp_path):
    """bf16 keeps 8 bits of mantissa (relative error 2^-8 = 0.4% per rounding): over 20 Adam steps of a small MLP
    the loss curve stays within 5% of fp32's, yet differs (autocast really ran in bf16)."""
    _, fp32 = _train(tmp_path / "fp32", ["trainer.log_every_n_steps=1"], 16)
    _, bf16 = _train(tmp_path / "bf16", ["trainer.precision=bf16"], 16)
    assert not np.array_equal(fp32, bf16)
    np.testing.assert_allclose(bf16, fp32, rtol=0.05, atol=0.02)
    assert bf16[-5:].mean() < bf16[:5].mean()  # and it learns


def test_the_best_epochs_checkpoint_is_kept_beside_rays_last_ones_and_logged(tmp_path):
    """`trainers.keep_best.KeepBest` (Ray Train's controller calls it after each report) links an epoch's checkpoint
    that is the best so far into the run's `best_checkpoint/`, in place of the one before; a worse epoch's, a
    step's or a stop's leaves it, and it outlives Ray Train deleting the folder it came from.
    `pipelines.fit.final_checkpoint` logs the model from there (`run.final_model=best`) unless the best epoch is
    the last, or from the checkpoint a run was started from when its best epoch is that one; it fails in one line
    when the best epoch's checkpoint is gone."""
    import shutil

    from ray.train import Checkpoint, Result

    from contract.checkpoint import BEST_CHECKPOINT, TrainState
    from contract.metrics import step_checkpoint_metrics, stop_metrics
    from pipelines.fit import final_checkpoint
    from trainers.keep_best import KeepBest

    run_folder = tmp_path / "run-x"

    def report(name: str, epoch: int, best_epoch: int, metrics: dict) -> Checkpoint:
        folder = run_folder / name
        folder.mkdir(parents=True)
        TrainState(epoch=epoch, metrics={}, best_epoch=best_epoch, best_value=0.9).write(folder)
        (folder / "state.pt").write_bytes(bytes([epoch]))
        checkpoint = Checkpoint.from_directory(str(folder))
        KeepBest().after_report(None, [metrics], checkpoint)
        return checkpoint

    first = report("checkpoint_1", 1, 1, {"epoch": 1, "best_epoch": 1})
    second = report("checkpoint_2", 2, 2, {"epoch": 2, "best_epoch": 2})
    report("checkpoint_3_step", 2, 2, step_checkpoint_metrics(3, 5))
    report("checkpoint_3_stop", 2, 2, stop_metrics(3, 6))
    third = report("checkpoint_3", 3, 2, {"epoch": 3, "best_epoch": 2})
    for gone in (first, second):  # Ray Train's retention of the last checkpoints
        shutil.rmtree(gone.path)
    best = run_folder / BEST_CHECKPOINT
    assert TrainState.read(best).epoch == 2 and (best / "state.pt").read_bytes() == bytes([2])
    assert sorted(p.name for p in run_folder.iterdir()) == [BEST_CHECKPOINT, "checkpoint_3", "checkpoint_3_step",
                                                            "checkpoint_3_stop"]
    result = Result(metrics={}, checkpoint=third, error=None, path=str(run_folder))
    chosen, epoch = final_checkpoint(result, "best")
    assert (chosen.path, epoch) == (str(best), 2)
    assert final_checkpoint(result, "last") == (third, 3)
    shutil.rmtree(best)
    with pytest.raises(RuntimeError, match=r"the checkpoint of the best epoch \(2\) is not in .*best_checkpoint"):
        final_checkpoint(result, "best")
    # A run started from another run's epoch 2 (`run.resume_from`), never better since: its best epoch is there.
    source = tmp_path / "run-y" / "checkpoint_2"
    source.mkdir(parents=True)
    TrainState(epoch=2, metrics={}, best_epoch=2, best_value=0.9).write(source)
    chosen, epoch = final_checkpoint(result, "best", resumed_from=str(source))
    assert (chosen.path, epoch) == (str(source), 2)
