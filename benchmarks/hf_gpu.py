"""A Transformers decoder of 100M+ parameters (`model=hf`) on one GPU rank: the tokens/s and MFU of our ddp, fsdp and
tp steps in bf16, each against the same model in a bare PyTorch loop (autocast to bf16, AdamW, the same batches).
In-process on a one-rank NCCL group (as Ray Train makes for one GPU worker), without Ray; tp is tp=1 (the machines
lent here have one GPU: the plan's DTensor machinery without its communication).

    python -m benchmarks.hf_gpu [--steps 20] [--device cuda|cpu] [--small]

The model: a `transformers.LlamaModel` (12 layers of width 768, 12 heads, vocabulary 32,000: 110M parameters)
written with `save_pretrained`, fine-tuned with a new 2-class head; rows of 512 real tokens, 16 a step.
MFU: the spec's FLOPs per sample (counted on the meta device) x samples/s over the GPU's dense bf16 peak
(contract/mfu.py); tokens/s counts every token. Wall ms per step after 3 warm-up steps, each step's loss read
back as the loop does. `--device cpu --small` (gloo, a 2-layer model of width 64) checks the script where no GPU is.
Last line: `min_ratio=<the slowest of ours over bare>`.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.gpu_layouts import build, one_rank_group
from contract.mfu import peak_flops
from pipelines.data.imdb import imdb_schema
from tests.support.loop_harness import config, imdb_columns

LARGE = {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
         "num_attention_heads": 12, "num_key_value_heads": 12, "max_position_embeddings": 512}
SMALL = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 64}
BATCH, WARMUP = 16, 3
LAYOUTS = {"ddp": ["trainer=ddp"], "fsdp": ["trainer=fsdp"], "tp (tp=1)": ["trainer=tp", "trainer.tp=1"]}


def save_llama(folder: Path, sizes: dict[str, int]) -> None:
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    LlamaModel(LlamaConfig(**sizes)).save_pretrained(folder)


def timed(step: Callable[[Any], float], batches: list[Any], device: torch.device) -> float:
    """Wall seconds per step after the warm-up."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for batch in batches[:WARMUP]:
        step(batch)
    sync()
    began = time.perf_counter()
    for batch in batches[WARMUP:]:
        step(batch)
    sync()
    return (time.perf_counter() - began) / (len(batches) - WARMUP)


def ours(cfg: Any, schema: Any, columns: dict[str, np.ndarray], device: torch.device) -> float:
    from trainers.torch.data import ShardBatches

    on_device = {k: torch.from_numpy(v).to(device) for k, v in columns.items()}
    data = lambda seed: (ShardBatches.from_columns(on_device, schema, BATCH, seed),  # noqa: E731
                         ShardBatches.from_columns(on_device, schema, BATCH, seed))
    adapter = build(cfg, data, device, schema)
    return timed(adapter.train_step, list(adapter.batches(0, 0)), device)


def bare(folder: Path, columns: dict[str, np.ndarray], device: torch.device) -> float:
    """The same model from the folder, AdamW, autocast to bf16: the plain PyTorch step."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2, pad_token_id=0).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids, labels = (torch.from_numpy(columns[k]).to(device) for k in ("input_ids", "label"))

    def step(at: int) -> float:
        rows = slice(at * BATCH, (at + 1) * BATCH)
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(input_ids=ids[rows].long()).logits, labels[rows])
        loss.backward()
        optimizer.step()
        return loss.item()
    return timed(step, list(range(len(labels) // BATCH)), device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--small", action="store_true", help="a 2-layer model of width 64: checks the script")
    args = parser.parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    sizes = SMALL if args.small else LARGE
    tokens = sizes["max_position_embeddings"]
    schema = imdb_schema(sizes["vocab_size"], tokens)
    columns = imdb_columns(BATCH * (args.steps + WARMUP), sizes["vocab_size"], tokens, min_len=tokens)  # all real
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        save_llama(folder, sizes)
        one_rank_group(device, tmp)
        from trainers.model_flops import flops_per_sample

        base = ["data=imdb", "model=hf", f"model.path={folder}", "trainer.num_workers=1", f"trainer.batch_size={BATCH}",
                "trainer.optimizer=adamw", "trainer.precision=bf16", f"trainer.use_gpu={device.type == 'cuda'}"]
        flops = flops_per_sample(config(Path(tmp) / "cfg", base).model, schema)
        peak = peak_flops(torch.cuda.get_device_name(device), "bf16") if device.type == "cuda" else None
        seconds = {"bare": bare(folder, columns, device)}
        for name, keys in LAYOUTS.items():
            seconds[name] = ours(config(Path(tmp) / name.split()[0], [*base, *keys]), schema, columns, device)
        dist.destroy_process_group()
    for name, step_s in seconds.items():
        mfu = f"{flops * BATCH / step_s / peak:6.1%}" if peak else "   n/a"
        print(f"{name:10s} {step_s * 1e3:8.1f} ms/step  {BATCH * tokens / step_s:10,.0f} tokens/s  MFU {mfu}  "
              f"{seconds['bare'] / step_s:5.2f}x bare", flush=True)
    print(f"min_ratio={min(seconds['bare'] / seconds[name] for name in LAYOUTS):.2f}")


if __name__ == "__main__":
    main()
