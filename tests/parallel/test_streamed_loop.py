"""Streamed data (`data.cache_in_worker=false`, trainers/streamed.py) on the shared loop under each backend that can
change its number of workers (ddp, fsdp, deepspeed, lightning; gloo, no Ray; horovod's is
tests/integration/test_horovod.py's): a run stopped at step 10 on 2 ranks and resumed on 1 rank with the same global
batch continues the uninterrupted 2-rank run step for step, its learning-rate schedule included (known from the files'
row counts), and ends with the same model. The files are held in memory and read in blocks that cross them; Ray Data
reading real Parquet for the same class is tests/integration/test_streamed.py."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from pipelines.data.mnist import mnist_schema
from tests.support.dist_utils import RankPools
from tests.support.loop_harness import (STOP_AT, attempt_from_json, attempt_to_json, check_metric_set, config,
                                        last_checkpoint, mnist_columns, run_attempt)

FILE_ROWS = [70, 50, 90, 40, 70]  # 320 rows: 20 global batches of 16
GLOBAL_BATCH = 16
OVERRIDES = ["trainer.optimizer=sgd", "trainer.lr=0.05", "trainer.momentum=0.9", "model.dropout=0",
             "model.hidden=[32]", "trainer.epochs=1", "trainer.lr_schedule=cosine", "trainer.warmup_steps=3",
             "data.cache_in_worker=false", "data.shuffle_buffer=100"]
# DeepSpeed resumes at another world size through its universal checkpoint, which converts Adam's states only.
BACKEND_OVERRIDES = {"deepspeed": ["trainer.optimizer=adam", "trainer.lr=0.002"]}


def _data(rank: int, dp: int):
    """(train, evaluation) StreamedBatches of rank `rank` of `dp` over the files, as `streamed_batches` makes them."""
    from contract.stream_order import StreamOrder
    from tests.support.streamed import in_process
    from trainers.streamed import SplitFiles, StreamedRows
    from trainers.torch.data import StreamedBatches

    schema = mnist_schema()
    every = mnist_columns(sum(FILE_ROWS) + 48)  # one set of digit templates: the last 48 rows evaluate
    train = {c: v[:sum(FILE_ROWS)] for c, v in every.items()}
    evaluation = {c: v[sum(FILE_ROWS):] for c, v in every.items()}

    def files(columns: dict[str, np.ndarray], rows: list[int]):
        starts = np.cumsum([0, *rows])
        held = {f"f{i}": {c: v[starts[i]:starts[i + 1]] for c, v in columns.items()} for i in range(len(rows))}

        def read(paths: list[str], names: list[str]):
            joined = {c: np.concatenate([held[p][c] for p in paths]) for c in names}
            for start in range(0, len(joined["label"]), 25):
                yield {c: v[start:start + 25] for c, v in joined.items()}
        return SplitFiles(list(held), rows), read

    def rows(columns, file_rows, batch, shuffle):
        split, read = files(columns, file_rows)
        order = StreamOrder(file_rows, 100, seed=0, shuffle=shuffle)
        return StreamedRows(split, ["image", "label"], order, batch, dp, rank, read=in_process(read),
                            stored=schema.stored_columns)

    return lambda seed: (StreamedBatches(rows(train, FILE_ROWS, GLOBAL_BATCH // dp, True), schema),
                         StreamedBatches(rows(evaluation, [20, 28], 8, False), schema))


def _attempt(rank: int, world_size: int, tmp: str, name: str, stop: bool, restored: str | None,
             backend: str) -> None:
    import os

    from contract.registry import BACKENDS, resolve
    from trainers.adapter import WorkerData
    from trainers.torch import lightning_fit

    torch.set_default_dtype(torch.float32)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size)})  # what Ray Train sets and DeepSpeed reads
    overrides = [*OVERRIDES, f"trainer={backend}", *BACKEND_OVERRIDES.get(backend, []),
                 f"trainer.num_workers={world_size}", f"trainer.batch_size={GLOBAL_BATCH // world_size}"]
    cfg = config(Path(tmp) / f"cfg-{name}{rank}", overrides)
    trainer, adapters = resolve(BACKENDS.get(backend).backend_ref("torch"))(), []

    def run(ctx):
        data = WorkerData(mnist_schema(), _data(rank, world_size))
        if backend == "lightning":  # Lightning's own loop (its Trainer.fit), the shared loop's callbacks
            return lightning_fit.run_worker(cfg, ctx, data)
        adapters.append(trainer.build_adapter(cfg, ctx, data))
        return trainer.train(cfg, ctx, adapters[-1])
    attempt = run_attempt(run, rank, world_size, 1, Path(tmp) / name, restored=Path(restored) if restored else None,
                          stop=stop)
    state = trainer.dense_state(str(last_checkpoint(Path(tmp) / name))) if backend == "lightning" else \
        adapters[0].dense_model_state()
    if rank == 0:
        torch.save(state, Path(tmp) / f"{name}.pt")
        (Path(tmp) / f"{name}.json").write_text(json.dumps(attempt_to_json(attempt)))
    dist.barrier()


def _read(tmp: Path, name: str):
    return attempt_from_json(json.loads((tmp / f"{name}.json").read_text())), torch.load(tmp / f"{name}.pt")


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "deepspeed", "lightning"])  # the elastic ones
def test_a_streamed_run_stopped_on_2_ranks_resumes_on_1_rank_in_the_same_sequence(run_ranks: RankPools, tmp_path,
                                                                                  backend: str):
    run_ranks(_attempt, 2, str(tmp_path), "straight", False, None, backend)
    run_ranks(_attempt, 2, str(tmp_path), "stopped", True, None, backend)
    run_ranks(_attempt, 1, str(tmp_path), "resumed", False, str(last_checkpoint(tmp_path / "stopped")), backend)
    (straight, straight_model), (stopped, _), (resumed, resumed_model) = (
        _read(tmp_path, name) for name in ("straight", "stopped", "resumed"))
    assert straight.finished and not stopped.finished and resumed.finished
    assert sorted(straight.recorder.step_losses) == list(range(1, 21))  # the steps the files' rows make
    assert sorted(stopped.recorder.step_losses) == list(range(1, STOP_AT + 1))
    assert sorted(resumed.recorder.step_losses) == list(range(STOP_AT + 1, 21))
    combined = {**stopped.recorder.step_losses, **resumed.recorder.step_losses}
    # One rank's mean over 16 rows against two ranks' means over 8 each, averaged: float32 sums in another order.
    np.testing.assert_allclose([combined[s] for s in range(1, 21)],
                               [straight.recorder.step_losses[s] for s in range(1, 21)], rtol=1e-5)
    assert straight.recorder.epochs[1]["test_accuracy"] > 0.5  # it learned
    for key in ("train_loss", "test_accuracy"):
        np.testing.assert_allclose(resumed.recorder.epochs[1][key], straight.recorder.epochs[1][key], rtol=1e-5)
    check_metric_set(straight.recorder, 1, text=False)
    for name, value in straight_model.items():
        torch.testing.assert_close(resumed_model[name], value, rtol=1e-4, atol=1e-6)
