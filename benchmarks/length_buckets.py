"""What `data.bucket_by_length` saves: BERT tiny training steps (AdamW) on prepared IMDb rows, batched as a
shuffled epoch (every batch padded to the stored width) and as `bucketed_order` batches cut to their longest row,
both through `trainers.torch.data.ShardBatches`, one thread as a Ray worker runs.

    .venv/bin/python -m benchmarks.length_buckets --data data/imdb-ht512/parquet [--rows 3200] [--steps 40]

The rows are the first `--rows` of the train split (the lengths of real reviews are the point). Last line:
`ratio=<samples/s bucketed / padded>`.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from contract.data import DataSchema
from pipelines.data import data_schema
from pipelines.data.shards import read_manifest, shard_paths
from trainers.models.bert import BertClassifier, bert_config
from trainers.torch.data import ShardBatches


def load_rows(folder: Path, rows: int) -> dict[str, torch.Tensor]:
    """The first `rows` rows of the train split's first shard (the manifest and shards checked, as training does)."""
    first_shard = shard_paths(folder, read_manifest(folder), "train")[0]
    table = pq.read_table(first_shard, columns=["input_ids", "length", "label", "id"]).slice(0, rows)
    ids = table.column("input_ids").combine_chunks()
    return {"input_ids": torch.from_numpy(ids.flatten().to_numpy().reshape(len(ids), -1).copy()),
            "length": torch.from_numpy(table["length"].to_numpy()),
            "label": torch.from_numpy(table["label"].to_numpy().astype(np.int64)),
            "id": torch.from_numpy(table["id"].to_numpy())}


def samples_per_s(columns: dict[str, torch.Tensor], schema: DataSchema, batch: int, steps: int,
                  bucketed: bool) -> tuple[float, float]:
    """(samples/s, mean batch width) over `steps` steps of epoch 0, after one warm-up step."""
    torch.manual_seed(0)
    model = BertClassifier(bert_config("tiny", schema.vocab_size, schema.max_len)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    batches = ShardBatches.from_columns(columns, schema, batch, seed=0, bucket_by_length=bucketed, trim=bucketed)
    widths, start = [], 0.0
    for index, (inputs, labels, _) in enumerate(batches.epoch(0)):
        if index == 1:
            start = time.perf_counter()
        loss = F.cross_entropy(model(*inputs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        widths.append(inputs[0].shape[1])
        if index == steps:
            break
    return steps * batch / (time.perf_counter() - start), float(np.mean(widths[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("data/imdb-ht512/parquet"))
    parser.add_argument("--rows", type=int, default=3200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    schema = data_schema(read_manifest(args.data))
    columns = load_rows(args.data, args.rows)
    results = {}
    for name, bucketed in (("padded", False), ("bucketed", True)):
        results[name], width = samples_per_s(columns, schema, args.batch, args.steps, bucketed)
        print(f"{name}: {results[name]:.1f} samples/s, mean batch width {width:.0f} tokens", flush=True)
    print(f"ratio={results['bucketed'] / results['padded']:.2f}")


if __name__ == "__main__":
    main()
