"""Pipeline parallelism (trainer=fsdp with pp > 1) on the shared loop, on gloo ranks (no Ray), in float64.

- 2 stages, each schedule (GPipe, 1F1B, interleaved 1F1B with 4 stages on 2 ranks): every step's loss and the
  final weights are the dense model's on the same batches; the evaluation (padded last batch) scores what the
  dense model scores; each rank holds only its stages' parameters. 1F1B also stops mid-epoch and resumes from
  its sharded checkpoint on the same loss curve.
- PP x TP x FSDP on 8 ranks (2 x 2 x 2) trains the dense model for an epoch; its checkpoint then resumes at 2
  ranks without pipeline or TP (plain FSDP on the same 2 data shards), the second epoch follows the dense curve
  and ends with the dense model's weights.
- bf16: FSDP's mixed-precision policy, with and without a pipeline, stays close to float32.
- The MLP on images, split by `sequential_split` (its spec's): features, not token ids, enter the first stage, and
  the 2 stages train the dense model.

Tolerance: float64; micro-batching changes only the order of sums (the mean of 4 equal micro-batch means is the
batch mean), so steps agree to ~1e-13; rtol 1e-9 is far below what a wrong stage boundary, a lost micro-batch or
unscaled gradients give (>1e-3).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from pipelines.data.imdb import imdb_schema
from pipelines.data.mnist import mnist_schema
from tests.support.loop_harness import (check_stop_resume_parity, config, imdb_columns, last_checkpoint,
                                        mnist_columns, run_attempt, shard)
from tests.support.parallel_checks import dense_training
from tests.support.dist_utils import RankPools

pytestmark = pytest.mark.slow  # pipeline stages trained on several gloo processes

MODEL_INPUTS = imdb_schema(64, 16)
ROWS, EVAL_ROWS, BATCH = 320, 40, 16  # 40 evaluation rows: two full batches and one padded
ROWS_3D = 128  # 8 ranks on 2 cores: 4 steps per epoch on each of the 2 data shards
OVERRIDES = ["trainer=fsdp", "data=imdb", "model=bert_tiny", "model.hidden=32", "model.heads=2", "model.layers=4",
             "model.dropout=0", f"trainer.batch_size={BATCH}", "trainer.microbatches=4", "trainer.lr=0.002",
             "trainer.optimizer=adamw", "trainer.weight_decay=0.01", "trainer.lr_schedule=cosine",
             "trainer.warmup_steps=4", "trainer.grad_clip=0.5"]


def _data(data_rank: int, data_ranks: int, rows: int = ROWS):
    from trainers.torch.data import ShardBatches

    train = {k: torch.from_numpy(v) for k, v in shard(imdb_columns(rows, 64, 16), data_rank, data_ranks).items()}
    evaluation = {k: torch.from_numpy(v) for k, v in imdb_columns(EVAL_ROWS, 64, 16, seed=1).items()}
    return lambda seed: (ShardBatches.from_columns(train, imdb_schema(64, 16), BATCH, seed, drop_last=True),
                         ShardBatches.from_columns(evaluation, imdb_schema(64, 16), BATCH, seed))


def _run(cfg, rank: int, world_size: int, rows: int = ROWS):
    """The worker of `rank`: the pp x tp ranks of a pipeline read the same data shard, as OrderedSplit gives."""
    from trainers.adapter import WorkerData
    from trainers.torch.fsdp import FSDP

    group = cfg.trainer.tp * cfg.trainer.pp
    data = _data(rank // group, world_size // group, rows)
    return lambda ctx: FSDP().run_worker(cfg, ctx, WorkerData(MODEL_INPUTS, data))


def _dense(cfg, data_ranks: int, rows: int = ROWS):
    """(rank 0's step losses, the trained dense model, its accuracy on the evaluation rows)."""
    shards = [_data(r, data_ranks, rows)(cfg.run.seed + 1000 * r)[0] for r in range(data_ranks)]
    losses, model = dense_training(cfg, MODEL_INPUTS, shards)
    evaluation = _data(0, 1)(0)[1]
    with torch.no_grad():
        model.eval()
        correct = sum(int((model(*inputs).argmax(dim=1) == labels).sum())
                      for inputs, labels, _ in evaluation.epoch(1, shuffle=False))
    return np.array(losses), model, correct / EVAL_ROWS


def _two_stages(rank: int, world_size: int, tmp: str, schedule: str) -> None:
    torch.set_default_dtype(torch.float64)
    tmp_path = Path(tmp) / schedule
    keys = [*OVERRIDES, "trainer.num_workers=2", "trainer.pp=2", f"trainer.pp_schedule={schedule}"]
    cfg = config(tmp_path / f"cfg{rank}", [*keys, "trainer.epochs=1"])
    attempt = run_attempt(_run(cfg, rank, world_size), rank, world_size, 1, tmp_path / "run")
    if schedule == "1f1b":  # the sharded checkpoint of a pipeline: stop at step 10 of 20, resume, same curve
        parity_cfg = config(tmp_path / f"cfg-parity{rank}", [*keys, "trainer.epochs=2"])
        check_stop_resume_parity(_run(parity_cfg, rank, world_size), tmp_path / "parity", rank, world_size,
                                 text=True, rtol=1e-10, atol=1e-12, barrier=dist.barrier)
    if rank == 0:
        from trainers.torch.fsdp import FSDP

        losses, model, accuracy = _dense(cfg, 1)
        np.testing.assert_allclose(attempt.recorder.curve(), losses, rtol=1e-9, atol=1e-12)
        assert attempt.recorder.epochs[1]["test_accuracy"] == pytest.approx(accuracy, abs=1e-12)
        dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        extras = attempt.recorder.extras[1]
        shares = [extras[f"rank{r}.param_bytes"] / dense_bytes for r in range(2)]
        # Half of the blocks each; rank 0 also the embeddings (token + position), rank 1 the classifier head.
        assert all(0.25 < share < 0.75 for share in shares) and abs(sum(shares) - 1) < 1e-9, shares
        for r in range(2):  # a gradient and Adam's two moments for each of those parameters
            assert extras[f"rank{r}.grad_bytes"] == extras[f"rank{r}.param_bytes"]
            assert extras[f"rank{r}.optimizer_state_bytes"] == 2 * extras[f"rank{r}.param_bytes"]
        exported = FSDP().dense_state(str(last_checkpoint(tmp_path / "run")))  # every stage's part, dense names
        assert exported.keys() == model.state_dict().keys()
        for name, value in model.state_dict().items():
            torch.testing.assert_close(exported[name], value, rtol=1e-9, atol=1e-12, msg=name)
    torch.set_default_dtype(torch.float32)


def test_pipeline_schedules_train_the_dense_model(run_ranks: RankPools, tmp_path):
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        run_ranks(_two_stages, 2, str(tmp_path), schedule)


def _bf16(rank: int, world_size: int, tmp: str) -> None:
    """precision=bf16 is FSDP's mixed-precision policy (bf16 parameters in compute, float32 gradient reduction and
    master weights), for FSDP alone and for pipeline stages (float32 activations between them): the step losses
    differ from float32's (bf16 keeps 8 bits of mantissa), and the difference compounds step by step and depends on
    the CPU's bf16 kernels (a step can land a few hundredths off where one rounding tips), so the first steps stay
    within 0.01 of float32's on average, the epoch's mean loss too, and every step within 0.1 (the loss moves by
    ~0.45 over the epoch here); the checkpoint's weights are float32."""
    from trainers.torch.fsdp import FSDP

    tmp_path = Path(tmp)
    curves = {}
    for name, keys in {"fsdp": [], "pp": ["trainer.pp=2", "trainer.pp_schedule=gpipe"]}.items():
        for precision in ("fp32", "bf16"):
            cfg = config(tmp_path / f"cfg-{name}-{precision}{rank}", [*OVERRIDES, "trainer.num_workers=2", *keys,
                                                                      f"trainer.precision={precision}",
                                                                      "trainer.epochs=1"])
            attempt = run_attempt(_run(cfg, rank, world_size), rank, world_size, 1, tmp_path / name / precision)
            curves[name, precision] = attempt.recorder.curve() if rank == 0 else None
            if rank == 0 and precision == "bf16":
                assert {v.dtype for v in FSDP().dense_state(str(attempt.checkpoint)).values()} == {torch.float32}
    if rank == 0:
        for name in ("fsdp", "pp"):
            assert not np.array_equal(curves[name, "bf16"], curves[name, "fp32"])  # bf16 really ran
            bf16, fp32 = np.asarray(curves[name, "bf16"]), np.asarray(curves[name, "fp32"])
            assert np.abs(bf16[:8] - fp32[:8]).mean() < 0.01, (name, bf16[:8], fp32[:8])
            assert abs(bf16.mean() - fp32.mean()) < 0.01, (name, bf16.mean(), fp32.mean())
            np.testing.assert_allclose(bf16, fp32, rtol=0, atol=0.1)


def test_bf16_is_fsdp_mixed_precision_with_and_without_a_pipeline(run_ranks: RankPools, tmp_path):
    run_ranks(_bf16, 2, str(tmp_path))


def _three_d(rank: int, world_size: int, tmp: str) -> None:
    """PP x TP x FSDP (2 x 2 x 2): rank = (shard * pp + stage) * tp + tp rank; 2 data shards. Epoch 1 of 2."""
    torch.set_default_dtype(torch.float64)
    tmp_path = Path(tmp)
    cfg = config(tmp_path / f"cfg3d{rank}", [*OVERRIDES, "trainer.num_workers=8", "trainer.pp=2", "trainer.tp=2",
                                             "trainer.epochs=2"])
    attempt = run_attempt(_run(cfg, rank, world_size, ROWS_3D), rank, world_size, 1, tmp_path / "3d")
    if rank == 0:
        losses, _, _ = _dense(cfg, 2, ROWS_3D)
        np.testing.assert_allclose(attempt.recorder.curve(), losses[:len(losses) // 2], rtol=1e-9, atol=1e-12)
    torch.set_default_dtype(torch.float32)


def _resume_at_two_ranks(rank: int, world_size: int, tmp: str) -> None:
    """The 8-rank checkpoint, resumed by plain FSDP on 2 ranks (the same 2 data shards): epoch 2 follows the dense
    curve, so every stage's and TP rank's shards of the model and of Adam's state were put back in place."""
    torch.set_default_dtype(torch.float64)
    tmp_path = Path(tmp)
    cfg = config(tmp_path / f"cfg2{rank}", [*OVERRIDES, "trainer.num_workers=2", "trainer.epochs=2",
                                            f"run.dump_params_dir={tmp_path / 'dump'}"])
    resumed = run_attempt(_run(cfg, rank, world_size, ROWS_3D), rank, world_size, 2, tmp_path / "resumed",
                          restored=last_checkpoint(tmp_path / "3d"))
    if rank == 0:
        losses, model, _ = _dense(cfg, 2, ROWS_3D)
        trained = torch.load(tmp_path / "dump" / "rank0.pt")  # the FSDP model, gathered (run.dump_params_dir)
        for name, value in model.state_dict().items():
            torch.testing.assert_close(trained[name], value, rtol=1e-9, atol=1e-12, msg=name)
        assert resumed.recorder.resumed == [1]
        steps = sorted(resumed.recorder.step_losses)
        assert steps == list(range(len(losses) // 2 + 1, len(losses) + 1))  # epoch 2's steps, numbered on
        np.testing.assert_allclose([resumed.recorder.step_losses[s] for s in steps], losses[len(losses) // 2:],
                                   rtol=1e-9, atol=1e-12)
    torch.set_default_dtype(torch.float32)


def test_pp_x_tp_x_fsdp_trains_the_dense_model_and_resumes_at_another_layout(run_ranks: RankPools, tmp_path):
    run_ranks(_three_d, 8, str(tmp_path))
    run_ranks(_resume_at_two_ranks, 2, str(tmp_path))


def _mlp_stages(rank: int, world_size: int, tmp: str) -> None:
    """In float32, as image batches are: micro-batches reorder sums (~1e-7), a wrong split is off by > 1e-3."""
    from trainers.adapter import WorkerData
    from trainers.torch.data import ShardBatches
    from trainers.torch.fsdp import FSDP

    cfg = config(Path(tmp) / f"cfg{rank}", ["trainer=fsdp", "model=mlp", "model.hidden=[32,16]", "model.dropout=0",
                                            "trainer.num_workers=2", "trainer.pp=2", "trainer.pp_schedule=1f1b",
                                            f"trainer.batch_size={BATCH}", "trainer.microbatches=4",
                                            "trainer.lr=0.01", "trainer.epochs=1"])
    train = {k: torch.from_numpy(v) for k, v in mnist_columns(96).items()}
    evaluation = {k: torch.from_numpy(v) for k, v in mnist_columns(40, seed=1).items()}

    def data(seed: int):
        return (ShardBatches.from_columns(train, mnist_schema(), BATCH, seed, drop_last=True),
                ShardBatches.from_columns(evaluation, mnist_schema(), BATCH, seed))

    attempt = run_attempt(lambda ctx: FSDP().run_worker(cfg, ctx, WorkerData(mnist_schema(), data)), rank,
                          world_size, 1, Path(tmp) / "run")
    if rank == 0:
        from trainers.torch.fsdp import FSDP

        losses, model = dense_training(cfg, mnist_schema(), [data(cfg.run.seed)[0]])
        np.testing.assert_allclose(attempt.recorder.curve(), losses, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            correct = sum(int((model(*inputs).argmax(dim=1) == labels).sum())
                          for inputs, labels, _ in data(0)[1].epoch(1, shuffle=False))
        assert attempt.recorder.epochs[1]["test_accuracy"] == pytest.approx(correct / 40, abs=1e-12)
        exported = FSDP().dense_state(str(last_checkpoint(Path(tmp) / "run")))
        assert exported.keys() == model.state_dict().keys()  # net.0 from stage 0, net.3 and net.6 from stage 1
        for name, value in model.state_dict().items():
            torch.testing.assert_close(exported[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_an_mlp_on_images_is_split_by_its_sequential_layers_and_trains_the_dense_model(run_ranks: RankPools,
                                                                                     tmp_path):
    run_ranks(_mlp_stages, 2, str(tmp_path))
