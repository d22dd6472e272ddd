"""Checks of a Horovod run's outputs shared by the local and the Slurm tests: the ranks' final weights
(`run.dump_params_dir`), Horovod's init log and the optimizer's step counter in the newest checkpoint."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# tiny_mnist: 1024 training rows -> 512 per worker -> 16 batches of 32 per epoch.
BATCHES_PER_EPOCH = 16


def final_weights(params_dir: Path, framework: str) -> list[list[np.ndarray]]:
    """Each rank's final weights (`run.dump_params_dir`), as arrays in a fixed order."""
    if framework == "torch":
        states = [torch.load(params_dir / f"rank{r}.pt") for r in (0, 1)]
        return [[state[k].numpy() for k in sorted(state)] for state in states]
    files = [np.load(params_dir / f"rank{r}.npz") for r in (0, 1)]
    return [[f[k] for k in f.files] for f in files]


def check_replicas_identical(params_dir: Path, framework: str) -> list[np.ndarray]:
    """Bitwise: ranks start from different seeds, so equal weights at the start need the broadcast, and at the
    end every rank applied the same averaged gradients with the same ops."""
    rank0, rank1 = final_weights(params_dir, framework)
    assert len(rank0) == len(rank1) > 0
    for a, b in zip(rank0, rank1):
        np.testing.assert_array_equal(a, b)
    return rank0


def init_log(params_dir: Path) -> list[dict[str, str]]:
    lines = (params_dir / "horovod_init.log").read_text().splitlines()
    return [dict(field.split("=", 1) for field in line.split()) for line in lines]


def optimizer_steps(storage: Path, framework: str, run_id: str = "*") -> int:
    """The optimizer's step counter in the newest checkpoint of the run (`run_id`: where several runs share
    `storage`)."""
    checkpoints = [p for p in storage.glob(f"run-{run_id}/checkpoint_*") if p.is_dir()]
    newest = max(checkpoints, key=lambda p: p.stat().st_mtime)
    if framework == "torch":
        state = torch.load(newest / "state.pt", weights_only=False)["optimizer"]["state"]
        return {int(s["step"]) for s in state.values()}.pop()
    with np.load(newest / "optimizer.npz") as store:
        return int(store["0"])  # tf-keras' optimizer variables start with `iterations`
