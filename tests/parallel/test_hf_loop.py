"""Hugging Face Transformers models (`model=hf`) on the shared loop, on gloo ranks (no Ray): a tiny BERT and a tiny
Llama, read from folders `save_pretrained` wrote, take the step losses and final weights of the single-process
Transformers model on the same batches: the BERT through ddp, fsdp (with activation checkpointing too; float64),
deepspeed ZeRO-3 and lightning (float32), the Llama through ddp, fsdp, tp=2 by its own `base_model_tp_plan`, fsdp x
tp on 2 x 2 ranks, two pipeline stages split by its `base_model_pp_plan`, alone and with tp=2, and Horovod on one
process (float64). Each
backend's checkpoint, gathered to its dense form, exported as a Transformers folder, loads with `from_pretrained`
alone and gives the trained model's logits; tp=2 holds about half of the Llama on each rank; bf16 (autocast, FSDP's
mixed precision) trains it close to float32."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from pipelines.data.imdb import imdb_schema
from tests.support.dist_utils import RankPools
from tests.support.hf_models import save_tiny
from tests.support.loop_harness import config, imdb_columns, run_attempt, shard
from tests.support.parallel_checks import dense_training

pytestmark = pytest.mark.slow  # trains on several gloo processes

SCHEMA = imdb_schema(64, 16)
ROWS, BATCH = 160, 8  # 80 rows per data-parallel rank: 10 steps
RECIPE = ["data=imdb", "model=hf", f"trainer.batch_size={BATCH}", "trainer.lr=0.003",
          "trainer.epochs=1", "trainer.optimizer=adamw", "trainer.weight_decay=0.01", "trainer.lr_schedule=cosine",
          "trainer.warmup_steps=2", "trainer.grad_clip=0.5"]


FLOAT32 = ("deepspeed", "lightning")  # their engines keep float32 parameters


def _keys(backend: str, deepspeed_json: Path) -> list[str]:
    """The backend's own keys: ZeRO-3 partitioning every parameter (by default it keeps those under 1e5 elements
    whole: all of this model's); Lightning's DDP strategy; FSDP recomputing each `_no_split_modules` block."""
    if backend == "deepspeed":
        deepspeed_json.write_text('{"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}')
        return ["trainer.zero_stage=3", f"trainer.deepspeed_config={deepspeed_json}"]
    if backend == "fsdp_ac":
        return ["trainer.activation_checkpointing=true"]
    return ["trainer.strategy=ddp"] if backend == "lightning" else []


def _data(rank: int, ranks: int):
    from trainers.torch.data import ShardBatches

    train = {k: torch.from_numpy(v) for k, v in shard(imdb_columns(ROWS, 64, 16), rank, ranks).items()}
    evaluation = {k: torch.from_numpy(v) for k, v in shard(imdb_columns(32, 64, 16, seed=1), rank, ranks).items()}
    return lambda seed: (ShardBatches.from_columns(train, SCHEMA, BATCH, seed),
                         ShardBatches.from_columns(evaluation, SCHEMA, 16, seed))


def _train(rank: int, world_size: int, tmp: str, folder: str, backend: str) -> None:
    try:
        _train_and_compare(rank, world_size, tmp, folder, backend)
    finally:
        torch.set_default_dtype(torch.float32)  # the rank processes serve the next tests too


def _train_and_compare(rank: int, world_size: int, tmp: str, folder: str, backend: str) -> None:
    """One epoch of `backend` (ddp | fsdp | fsdp_ac: with activation checkpointing | tp | fsdp_tp: fsdp with tp=2 |
    fsdp_pp: fsdp with pp=2 | fsdp_pp_tp: both | deepspeed | lightning | horovod) on the model in `folder`; on
    rank 0 the loss curve and the dense checkpoint against the single-process model, and the export of that
    checkpoint."""
    from trainers import get_backend
    from trainers.adapter import WorkerData
    from trainers.torch import lightning_fit

    tmp_path = Path(tmp) / backend
    tmp_path.mkdir(parents=True, exist_ok=True)
    tp, pp = (2 if backend.endswith("tp") else 1), (2 if "_pp" in backend else 1)
    cfg = config(tmp_path / f"cfg{rank}", [f"trainer={backend.split('_')[0]}", *RECIPE, f"model.path={folder}",
                                           f"trainer.num_workers={world_size}",
                                           *([f"trainer.tp={tp}"] if tp > 1 else []),
                                           *([f"trainer.pp={pp}"] if pp > 1 else []),
                                           *_keys(backend, tmp_path / f"ds{rank}.json")])
    # float64 where the backend computes in it: the reorderings of sharded sums vanish below its rounding
    torch.set_default_dtype(torch.float32 if backend in FLOAT32 else torch.float64)
    rtol, atol = (1e-4, 1e-5) if backend in FLOAT32 else (1e-9, 1e-12)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size)})  # what Ray Train sets, DeepSpeed and Lightning read
    run_worker = lightning_fit.run_worker if backend == "lightning" else get_backend(cfg.trainer).run_worker
    ranks = world_size // (tp * pp)  # data-parallel ranks: a TP group, a pipeline, reads one shard
    trained = run_attempt(lambda ctx: run_worker(cfg, ctx, WorkerData(SCHEMA, _data(rank // (tp * pp), ranks))), rank,
                          world_size, 1, tmp_path / "run")
    if rank == 0:
        shards = [_data(r, ranks)(cfg.run.seed + 1000 * r)[0] for r in range(ranks)]
        losses, reference = dense_training(cfg, SCHEMA, shards)
        np.testing.assert_allclose(trained.recorder.curve(), losses, rtol=rtol, atol=atol)
        dense = get_backend(cfg.trainer).dense_state(str(trained.checkpoint))
        assert dense.keys() == reference.state_dict().keys()
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(dense[name], value, rtol=rtol, atol=atol, msg=name)
        _check_export(cfg, dense, tmp_path / "export")
    dist.barrier()


def _check_export(cfg, dense: dict[str, torch.Tensor], out: Path) -> None:
    """The checkpoint's model written as a Transformers folder: `from_pretrained` (no code of this project) gives
    its logits within 1e-5 in float32, its classes named."""
    from transformers import AutoModelForSequenceClassification

    from trainers.models import build_model
    from trainers.models.hf import export_hf

    torch.set_default_dtype(torch.float32)
    model = build_model(cfg.model, SCHEMA)
    model.load_state_dict(dense)
    export_hf(model.eval(), out, None)
    loaded = AutoModelForSequenceClassification.from_pretrained(out).eval()
    columns = imdb_columns(8, 64, 16, seed=2)
    ids = torch.from_numpy(columns["input_ids"]).long()
    mask = torch.arange(16) < torch.from_numpy(columns["length"])[:, None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).logits, model(ids, mask),
                                   rtol=1e-5, atol=1e-5)
    assert loaded.config.id2label == dict(enumerate(SCHEMA.target.classes))


@pytest.mark.parametrize("architecture, backends", [
    ("bert", ("ddp", "fsdp", "fsdp_ac", "lightning")),
    ("llama", ("ddp", "fsdp", "tp", "fsdp_tp", "fsdp_pp", "fsdp_pp_tp")),
])
def test_a_transformers_model_trains_as_the_single_process_one_and_exports(run_ranks: RankPools, tmp_path: Path,
                                                                           architecture: str,
                                                                           backends: tuple[str, ...]) -> None:
    folder = save_tiny(architecture, tmp_path / architecture)
    for backend in backends:
        run_ranks(_train, 4 if backend in ("fsdp_tp", "fsdp_pp_tp") else 2, str(tmp_path), str(folder), backend)


def test_deepspeed_zero3_trains_a_transformers_model_as_the_single_process_one(own_ranks: RankPools,
                                                                             tmp_path: Path) -> None:
    own_ranks(_train, 2, str(tmp_path), str(save_tiny("bert", tmp_path / "bert")), "deepspeed")


def test_horovod_trains_a_transformers_model_as_the_single_process_one(own_ranks: RankPools, tmp_path: Path) -> None:
    """Horovod (PyTorch) as a lone process (size 1: no rendezvous), in processes of its own (Horovod's state)."""
    own_ranks(_train, 1, str(tmp_path), str(save_tiny("llama", tmp_path / "llama")), "horovod")


def _tp_halves(rank: int, world_size: int, folder: str) -> None:
    from omegaconf import OmegaConf

    from trainers.models.hf import build_hf, parallelize_hf
    from trainers.torch.parallel.mesh import ParallelDims, build_mesh

    cfg = OmegaConf.create({"path": folder, "from_scratch": False, "task": "sequence_classification"})
    dense = sum(p.numel() for p in build_hf(cfg, SCHEMA).parameters())
    sharded = parallelize_hf(build_hf(cfg, SCHEMA), build_mesh(ParallelDims(1, 2)))
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in sharded.parameters())
    # Everything but the norms and the 2-class head is split: about half of the model on each rank.
    assert 0.45 * dense < local < 0.55 * dense, (local, dense)


def test_tp_holds_about_half_of_a_transformers_model_on_each_rank(run_ranks: RankPools, tmp_path: Path) -> None:
    run_ranks(_tp_halves, 2, str(save_tiny("llama", tmp_path / "llama")))


def _bf16(rank: int, world_size: int, tmp: str, folder: str) -> None:
    """precision=bf16 on a Transformers model: autocast under ddp, FSDP's mixed-precision policy under fsdp and
    its pipeline stages. The step losses differ from float32's (bf16 keeps 8 bits of mantissa) yet stay within 0.005
    of them on average and 0.02 at every step (here: 3e-4 and 1e-3 at most, while the loss moves by 0.1-0.3 over
    the epoch); the checkpoint's weights are float32."""
    from trainers import get_backend
    from trainers.adapter import WorkerData

    curves = {}
    for backend, keys in {"ddp": [], "fsdp": [], "fsdp_pp": ["trainer.pp=2"]}.items():
        for precision in ("fp32", "bf16"):
            tmp_path = Path(tmp) / backend / precision
            cfg = config(tmp_path / f"cfg{rank}", [f"trainer={backend.split('_')[0]}", *RECIPE, f"model.path={folder}",
                                                   f"trainer.num_workers={world_size}", *keys,
                                                   f"trainer.precision={precision}"])
            ranks = world_size // cfg.trainer.get("pp", 1)
            backend_impl = get_backend(cfg.trainer)
            attempt = run_attempt(lambda ctx: backend_impl.run_worker(cfg, ctx, WorkerData(SCHEMA, _data(
                rank // (world_size // ranks), ranks))), rank, world_size, 1, tmp_path / "run")
            curves[backend, precision] = np.asarray(attempt.recorder.curve()) if rank == 0 else None
            if rank == 0 and precision == "bf16":
                dense = backend_impl.dense_state(str(attempt.checkpoint))
                assert {value.dtype for value in dense.values()} == {torch.float32}
    if rank == 0:
        for backend in ("ddp", "fsdp", "fsdp_pp"):
            bf16, fp32 = curves[backend, "bf16"], curves[backend, "fp32"]
            assert not np.array_equal(bf16, fp32)  # bf16 really ran
            assert np.abs(bf16 - fp32).mean() < 0.005, (backend, bf16, fp32)
            np.testing.assert_allclose(bf16, fp32, rtol=0, atol=0.02)
    dist.barrier()


def test_bf16_trains_a_transformers_model_close_to_float32(run_ranks: RankPools, tmp_path: Path) -> None:
    run_ranks(_bf16, 2, str(tmp_path), str(save_tiny("llama", tmp_path / "llama")))
