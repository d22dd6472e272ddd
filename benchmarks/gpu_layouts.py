"""One GPU rank's training step through each PyTorch layout: ddp, fsdp (fp32, bf16, bf16 without resharding after
forward), tp of both impls at tp=1. In-process on a one-rank NCCL group (as Ray Train makes for one GPU worker),
without Ray, on the test harness's token batches in IMDb's shape (vocabulary 8,000, 128 tokens, batch 128), BERT tiny
and a larger BERT (8 layers, hidden 512, 8 heads). With one rank nothing is shared, so each layout's time over
ddp's is what its machinery costs the host and the GPU.

    python -m benchmarks.gpu_layouts [--steps 30] [--device cuda|cpu]

Prints the milliseconds per step (wall, after 5 warm-up steps; each step reads its loss back, as the loop does)
and the process's CPU milliseconds per step. `--device cpu` (gloo) checks the script where no GPU is.
Last line: `max_ratio=<slowest layout's step over ddp's, larger model>`.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from pipelines.data.imdb import imdb_schema
from tests.support.loop_harness import config, imdb_columns

MODEL_INPUTS = imdb_schema(8000, 128)
BATCH, WARMUP = 128, 5
MODELS = {"bert tiny": [], "bert 8x512": ["model.hidden=512", "model.layers=8", "model.heads=8"]}
LAYOUTS = {"ddp": ["trainer=ddp"], "ddp bf16": ["trainer=ddp", "trainer.precision=bf16"],
           "fsdp": ["trainer=fsdp"], "fsdp bf16": ["trainer=fsdp", "trainer.precision=bf16"],
           "fsdp bf16, no reshard": ["trainer=fsdp", "trainer.precision=bf16", "trainer.reshard_after_forward=false"],
           "tp megatron": ["trainer=tp", "trainer.tp=1", "trainer.tp_impl=megatron"],
           "tp dtensor": ["trainer=tp", "trainer.tp=1", "trainer.tp_impl=dtensor"]}


def layout_config(folder: Path, overrides: list[str], device: torch.device) -> DictConfig:
    """The validated pipeline config of one layout (the test harness's: data comes from the caller)."""
    return config(folder, ["data=imdb", "model=bert_tiny", "trainer.num_workers=1", f"trainer.batch_size={BATCH}",
                           "trainer.optimizer=adamw", f"trainer.use_gpu={device.type == 'cuda'}", *overrides])


def build(cfg: DictConfig, data: Callable, device: torch.device, inputs: Any = MODEL_INPUTS) -> Any:
    """The backend's adapter on this one rank, as its worker builds it (ddp's model in DDP, as on a worker of
    several), on data of schema `inputs`."""
    from trainers import get_backend
    from trainers.adapter import WorkerData
    from trainers.context import WorkerContext

    ctx = WorkerContext(rank=0, world_size=1, report=lambda metrics, folder: None, epochs=1, device=device)
    adapter = get_backend(cfg.trainer).build_adapter(cfg, ctx, WorkerData(inputs, data))
    if cfg.trainer.backend == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        adapter.model = adapter.forward = DistributedDataParallel(adapter.model, device_ids=ids)
    return adapter


def step_times(cfg: DictConfig, steps: int, device: torch.device) -> tuple[float, float]:
    """(wall ms, CPU ms) per training step after the warm-up, batches cached on the device as a worker's are."""
    from trainers.torch.data import ShardBatches

    vocab, length = MODEL_INPUTS.vocab_size, MODEL_INPUTS.max_len
    columns = {k: torch.from_numpy(v).to(device)
               for k, v in imdb_columns(BATCH * (steps + WARMUP), vocab, length).items()}
    evaluation = {k: torch.from_numpy(v).to(device) for k, v in imdb_columns(BATCH, vocab, length, seed=1).items()}
    data = lambda seed: (ShardBatches.from_columns(columns, MODEL_INPUTS, BATCH, seed,  # noqa: E731
                                                   bucket_by_length=True, trim=True),
                         ShardBatches.from_columns(evaluation, MODEL_INPUTS, BATCH, seed, trim=True))
    adapter = build(cfg, data, device)
    batches = list(adapter.batches(0, 0))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for batch in batches[:WARMUP]:
        adapter.train_step(batch)
    sync()
    wall, cpu = time.perf_counter(), time.process_time()
    for batch in batches[WARMUP:WARMUP + steps]:
        adapter.train_step(batch)
    sync()
    return (time.perf_counter() - wall) * 1e3 / steps, (time.process_time() - cpu) * 1e3 / steps


def one_rank_group(device: torch.device, folder: str) -> None:
    """This process as the one rank of a process group: NCCL on a GPU (as Ray Train makes for one GPU worker), gloo
    on the CPU; `folder` holds the rendezvous file."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"file://{folder}/rendezvous", rank=0, world_size=1,
                                device_id=device)
    else:
        dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=0, world_size=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        one_rank_group(device, tmp)
        walls = {}
        for model, model_keys in MODELS.items():
            for layout, keys in LAYOUTS.items():
                cfg = layout_config(Path(tmp) / str(len(walls)), [*keys, *model_keys], device)
                wall, cpu = step_times(cfg, args.steps, device)
                walls[model, layout] = wall
                print(f"{model:11s} {layout:22s} {wall:8.2f} ms/step  {cpu:8.2f} CPU ms/step  "
                      f"{wall / walls[model, 'ddp']:6.2f}x ddp", flush=True)
        dist.destroy_process_group()
    larger = list(MODELS)[-1]
    print(f"max_ratio={max(walls[larger, layout] / walls[larger, 'ddp'] for layout in LAYOUTS):.2f}")


if __name__ == "__main__":
    main()
