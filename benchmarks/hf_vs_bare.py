"""`model=hf` through our ddp and fsdp against a bare PyTorch loop over the same Hugging Face Transformers BERT, the
same batches and data, in alternated rounds.

    python -m benchmarks.hf_vs_bare [--epochs 3] [--rows 3000] [--tokens 64] [--batch 32] [--layers 2]
                                    [--hidden 256] [--repeats 2]

The model: a `transformers.BertModel` of `--layers` blocks of width `--hidden` (heads of 64), written with
`save_pretrained` into a temporary folder, fine-tuned with a new 2-class head; the data: `rtp prepare synthetic
--tokens T` (rows of T/4 to T ids). Bare: one process, one thread, the folder loaded with
`AutoModelForSequenceClassification.from_pretrained`, AdamW (torch's multi-tensor kernel, as ours), each batch cut
to its longest row (dynamic padding), as ours does; `bare_fsdp`: that loop with the model sharded by torch's
`fully_shard` over a one-process gloo group (its `_no_split_modules` blocks, then the root), as our fsdp shards it.
Ours: `rtp train model=hf` on 1 Ray Train worker of one thread, trainer=ddp and trainer=fsdp, held data.
Throughput: training samples/s, the mean of epochs 2..N; each round runs bare, ddp, bare_fsdp, fsdp in turn.
Last line: `min_ratio=<the lower of the medians of ddp / bare and fsdp / bare_fsdp>`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from benchmarks.common import QUIET_ENV, ROOT, free_ports, pipeline_run, steady_rate

LR = 1e-4
# (ours, its bare counterpart): ddp against the plain loop; fsdp against the plain loop sharded by fully_shard (what
# our code costs), and fsdp's sharding against none (what FSDP costs on one rank)
PAIRS = (("ddp", "bare"), ("fsdp", "bare_fsdp"), ("bare_fsdp", "bare"))


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rows", type=int, default=3000, help="generated rows over the three splits")
    parser.add_argument("--tokens", type=int, default=64, help="ids per row at most")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="alternated rounds")
    return parser.parse_args()


def save_bert(folder: Path, args: argparse.Namespace, vocab: int) -> None:
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=args.hidden // 64, intermediate_size=4 * args.hidden,
                        max_position_embeddings=max(128, args.tokens))
    BertModel(config).save_pretrained(folder)


def prepare(out: Path, args: argparse.Namespace, vocab: int) -> None:
    cmd = [sys.executable, "-m", "pipelines.prepare", "synthetic", "--rows", str(args.rows), "--tokens",
           str(args.tokens), "--vocab-size", str(vocab), "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, env={**os.environ, **QUIET_ENV}, check=True, capture_output=True)


def train_split(data: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids [N, T], lengths [N], labels [N]) of the prepared train split, in stored order."""
    manifest = json.loads((data / "manifest.json").read_text())
    tables = [pq.read_table(data / shard["file"]) for shard in manifest["splits"]["train"]["shards"]]
    ids = np.concatenate([np.stack(t.column("features").to_numpy(zero_copy_only=False)) for t in tables])
    lengths = np.concatenate([t.column("length").to_numpy() for t in tables])
    labels = np.concatenate([t.column("label").to_numpy() for t in tables])
    return ids.astype(np.int64), lengths, labels


def bare(folder: Path, data: Path, args: argparse.Namespace, fsdp: bool = False) -> list[float]:
    """The plain loop: samples/s of each epoch. `fsdp`: the model sharded by torch's `fully_shard` over a gloo
    group of this one process, each block the model names in `_no_split_modules` a unit, then the root (what FSDP
    itself costs a rank)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2, local_files_only=True,
                                                               dtype=torch.float32).train()
    if fsdp:
        model = fully_sharded(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, foreach=True)
    ids, lengths, labels = (torch.from_numpy(a) for a in train_split(data))
    rates = []
    for epoch in range(args.epochs):
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(epoch))
        start = time.perf_counter()
        for i in range(0, len(labels), args.batch):
            index = order[i:i + args.batch]
            longest = int(lengths[index].max())
            batch_ids = ids[index, :longest]
            mask = torch.arange(longest) < lengths[index, None]
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(input_ids=batch_ids, attention_mask=mask).logits,
                                                     labels[index])
            loss.backward()
            optimizer.step()
        rates.append(len(labels) / (time.perf_counter() - start))
    if fsdp:
        torch.distributed.destroy_process_group()
    return rates


def fully_sharded(model):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    [port] = free_ports(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    for module in model.modules():
        if type(module).__name__ in model._no_split_modules:
            fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def ours(backend: str, folder: Path, data: Path, args: argparse.Namespace) -> list[float]:
    history, _ = pipeline_run([f"trainer={backend}", "model=hf", f"model.path={folder}", f"data.path={data}",
                               "trainer.num_workers=1", "trainer.threads_per_worker=1", f"trainer.epochs={args.epochs}",
                               f"trainer.batch_size={args.batch}", "trainer.optimizer=adamw", f"trainer.lr={LR}",
                               "trainer.weight_decay=0.01", "trainer.lr_schedule=constant", "trainer.warmup_steps=0",
                               "data.cache_in_worker=true", "run.system_metrics=false"])
    return history["samples_per_s"]


def main() -> int:
    args = parse()
    vocab = 8000
    rounds: dict[str, list[float]] = {"bare": [], "ddp": [], "bare_fsdp": [], "fsdp": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder, data = Path(tmp) / "bert", Path(tmp) / "data"
        save_bert(folder, args, vocab)
        prepare(data, args, vocab)
        for i in range(1, args.repeats + 1):
            for row in rounds:
                rates = (bare(folder, data, args, fsdp=row == "bare_fsdp") if row.startswith("bare")
                         else ours(row, folder, data, args))
                rounds[row].append(steady_rate(rates))
            print(f"round {i}: " + ", ".join(f"{row} {values[-1]:.1f}" for row, values in rounds.items()) +
                  " samples/s; " + ", ".join(f"{row}/{base} {rounds[row][-1] / rounds[base][-1]:.3f}"
                                             for row, base in PAIRS), flush=True)
    ratios = {f"{row}/{base}": float(np.median(np.array(rounds[row]) / np.array(rounds[base])))
              for row, base in PAIRS}
    print(f"BERT {args.layers} x {args.hidden}, {args.tokens} tokens at most, batch {args.batch}, {args.epochs} "
          f"epochs (mean of epochs 2..{args.epochs}), medians of {args.repeats} rounds: "
          + ", ".join(f"{pair} {ratio:.3f}" for pair, ratio in ratios.items()))
    print(f"min_ratio={min(ratios['ddp/bare'], ratios['fsdp/bare_fsdp']):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
