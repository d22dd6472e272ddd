"""What dropout on the attention probabilities costs: BERT tiny training steps (AdamW) with
`attention_dropout=0.1` and with 0 (the default), one thread as a Ray worker runs, on random token ids.

    .venv/bin/python -m benchmarks.attention_dropout [--lengths 256 512] [--batch 32] [--steps 8]

torch's CPU `scaled_dot_product_attention` uses its fused kernel only without dropout; with it, attention runs
the unfused math (the (T x T) probabilities materialised, masked and dropped). Last line:
`ratio=<samples/s without / with attention dropout>` at the longest length.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from trainers.models.bert import BertClassifier, bert_config


def samples_per_s(length: int, batch: int, steps: int, attention_dropout: float, vocab: int = 30000) -> float:
    torch.manual_seed(0)
    model = BertClassifier(bert_config("tiny", vocab, length, attention_dropout=attention_dropout)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    ids = torch.randint(5, vocab, (batch, length))
    labels = torch.randint(0, 2, (batch,))

    def step() -> None:
        loss = F.cross_entropy(model(ids), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    step()  # warm-up: allocator and kernel selection
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ratio = float("nan")
    for length in args.lengths:
        with_dropout = samples_per_s(length, args.batch, args.steps, 0.1)
        without = samples_per_s(length, args.batch, args.steps, 0.0)
        ratio = without / with_dropout
        print(f"max_len {length}: attention_dropout=0.1 {with_dropout:.1f} samples/s, "
              f"0 {without:.1f} samples/s, {ratio:.2f}x")
    print(f"ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
