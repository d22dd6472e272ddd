"""FLOPs of one training sample, counted by running it on the meta device: torch's `FlopCounterMode` over a
forward pass, the loss and the backward pass of a small batch of the model's own input shape (a token model at its
full `max_len`: the padded length, what a batch of full rows costs). Meta tensors have shapes and no storage, so a
model of any size is counted without its memory, and every operator runs through its reference decomposition
(attention included, which the fused CPU kernel would hide from the counter). Matrix products and convolutions
count, as 2 FLOPs per multiply-add; element-wise work (activations, norms, the optimizer) does not, as in the usual
MFU accounting."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from contract.data import DataSchema
from trainers.torch.recipe import task_loss

EXAMPLE_ROWS = 2


def example_batch(inputs: DataSchema, rows: int = EXAMPLE_ROWS) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """(model inputs, targets) of `rows` rows as the workers feed them (contract/data.py `Features`), on the
    current default device."""
    features = inputs.features
    if features.kind == "tokens":
        ids = torch.ones(rows, features.width, dtype=torch.int64)  # every position a real token
        model_inputs: tuple[torch.Tensor, ...] = (ids, torch.ones(rows, features.width, dtype=torch.bool))
    else:
        model_inputs = (torch.zeros(rows, features.width),)
    regression = inputs.target.task == "regression"
    targets = torch.zeros(rows) if regression else torch.zeros(rows, dtype=torch.int64)
    return model_inputs, targets


def training_flops_per_sample(build: Callable[[], nn.Module], inputs: DataSchema) -> float:
    """Forward and backward FLOPs of one sample of the model `build()` makes (in training mode), built and run on
    the meta device; an operator without a meta kernel raises (NotImplementedError and the like)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = build().train()
        model_inputs, targets = example_batch(inputs)
        with FlopCounterMode(display=False) as counter:
            task_loss(inputs.target.task)(model(*model_inputs), targets).backward()
    return counter.get_total_flops() / len(targets)
