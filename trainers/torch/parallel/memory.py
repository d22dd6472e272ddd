"""What a rank holds of a model: parameter, gradient and optimizer-state bytes, counting a DTensor's local shard
(FSDP, DTensor TP) and a plain tensor whole (DDP, Horovod, our Megatron layers' own shards)."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def local_bytes(tensors: Iterable[torch.Tensor | None]) -> float:
    """Bytes this rank holds of `tensors` (a DTensor's local shard; None skipped)."""
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return float(total)


def rank_memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """This rank's parameter, gradient and optimizer-state bytes (with FSDP over N ranks: ~1/N of the model's)."""
    states = [value for state in optimizer.state.values() for value in state.values()
              if isinstance(value, torch.Tensor) and value.dim() > 0]  # Adam's step counts are scalars
    params = list(model.parameters())
    return {"param_bytes": local_bytes(params), "grad_bytes": local_bytes(p.grad for p in params),
            "optimizer_state_bytes": local_bytes(states)}
