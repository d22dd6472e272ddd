"""Run by tests/integration/test_horovod.py as a script (so Ray ships `probe` by value to the workers):

    python -m tests.support.horovod_probe FRAMEWORK OUT_DIR STORAGE_DIR

Two workers on the cluster at RAY_ADDRESS, joined by `RendezvousConfig` only; each runs known collectives with
Horovod's `FRAMEWORK` binding (torch | tf) and writes what it got to OUT_DIR/rank<r>.json.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def probe(config: dict) -> None:
    import numpy as np
    import ray.train

    if config["framework"] == "torch":
        import horovod.torch as hvd
        import torch

        as_tensor, to_list = (lambda v: torch.tensor(v, dtype=torch.float64)), (lambda t: t.tolist())
    else:
        import horovod.tensorflow as hvd
        import tensorflow as tf

        as_tensor, to_list = (lambda v: tf.constant(v, dtype=tf.float64)), (lambda t: t.numpy().tolist())
    hvd.init()
    rank = hvd.rank()
    mine = [rank + 1.0, 10.0 * (rank + 1)]
    got = {
        "ray_rank": ray.train.get_context().get_world_rank(),
        "rank": rank, "size": hvd.size(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
        "sum": to_list(hvd.allreduce(as_tensor(mine), op=hvd.Sum, name="sum")),
        "average": to_list(hvd.allreduce(as_tensor(mine), op=hvd.Average, name="average")),
        "max": to_list(hvd.allreduce(as_tensor(mine), op=hvd.Max, name="max")),
        "fp16_sum": to_list(hvd.allreduce(as_tensor(mine), op=hvd.Sum, name="fp16",
                                          compression=hvd.Compression.fp16)),
        "allgather": to_list(hvd.allgather(as_tensor([[float(rank)] * 2]), name="gather")),
        "broadcast": to_list(hvd.broadcast(as_tensor([float(rank) + 7.0]), root_rank=1, name="bcast")),
        "env": {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")},
    }
    if config["framework"] == "torch":
        got["channels_last"] = channels_last_collectives(hvd, rank)
    assert np.isfinite(got["sum"]).all()
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(got))


def channels_last_collectives(hvd, rank: int) -> dict:
    """A channels-last gradient all-reduced through `ContiguousCompression` as Horovod's optimizer does (compress,
    in-place all-reduce, decompress), and channels-last weights broadcast from rank 0: the values, and whether the
    gradient tensor itself holds the result in its own layout."""
    import torch

    from trainers.horovod.torch import ContiguousCompression, broadcast_from_rank0

    def block(value: float) -> torch.Tensor:
        return torch.full((2, 3, 2, 2), value).contiguous(memory_format=torch.channels_last)
    grad, weights = block(rank + 1.0), {"w": block(rank + 5.0)}
    compression = ContiguousCompression(hvd.Compression.none)
    packed, ctx = compression.compress(grad)
    reduced = compression.decompress(hvd.allreduce_(packed, op=hvd.Average, name="channels_last"), ctx)
    broadcast_from_rank0(hvd, weights)
    return {"average": sorted(set(reduced.flatten().tolist())), "into_the_gradient": reduced is grad,
            "broadcast": sorted(set(weights["w"].flatten().tolist())),
            "layouts_kept": all(not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)
                                for t in (grad, weights["w"]))}


def main(framework: str, out: str, storage: str) -> int:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from trainers.horovod.rendezvous import RendezvousConfig

    ray.init(address=os.environ["RAY_ADDRESS"])
    Path(out).mkdir(parents=True, exist_ok=True)
    trainer = DataParallelTrainer(probe, train_loop_config={"framework": framework, "out": out},
                                  backend_config=RendezvousConfig(),
                                  scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                                  run_config=RunConfig(name=f"probe-{framework}", storage_path=storage))
    trainer.fit()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
