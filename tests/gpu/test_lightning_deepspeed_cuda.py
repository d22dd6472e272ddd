"""trainer=lightning and trainer=deepspeed on a real GPU, in-process on one NCCL rank (no Ray cluster): skipped without
a GPU, as in CI. Where one is lent: `python -m pytest -p no:cacheprovider tests/gpu`. Lightning's FSDP refuses CPUs,
so its `strategy=fsdp` is covered here only; so are the mixed-precision paths where Lightning clips (no fused
optimizer) and DeepSpeed's autocast on CUDA."""
from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
import torch

from pipelines.data.mnist import mnist_schema
from tests.gpu.test_cuda import CUDA, MNIST, batches, nccl  # noqa: F401  (the fixture)
from tests.support.loop_harness import check_stop_resume_parity, config, mnist_columns, run_attempt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run_on_gpu(module_name: str, cfg):
    """A backend's worker (its `run_worker`) on GPU 0 with the GPU-resident shards a GPU worker holds."""
    import importlib

    from trainers.adapter import WorkerData

    module = importlib.import_module(module_name)
    data = batches(mnist_columns(320), mnist_columns(64, seed=1), "mnist", 16)
    return lambda ctx: module.run_worker(cfg, replace(ctx, device=CUDA), WorkerData(mnist_schema(), data))


@pytest.mark.parametrize("strategy, precision", [("ddp", "bf16"), ("ddp", "fp16"), ("fsdp", "bf16")])
def test_lightning_on_the_gpu_stops_and_resumes_every_step(nccl, tmp_path, strategy, precision):  # noqa: F811
    """Lightning's Trainer on CUDA over NCCL, mixed precision (fsdp: no clipping, which its FSDP refuses): the
    stop/resume contract step for step, and a curve that learns."""
    keys = [key for key in MNIST if strategy == "ddp" or not key.startswith("trainer.grad_clip")]
    cfg = config(tmp_path / "cfg", ["trainer=lightning", f"trainer.strategy={strategy}",
                                    f"trainer.precision={precision}", *keys])
    runs = check_stop_resume_parity(run_on_gpu("trainers.torch.lightning_fit", cfg), tmp_path, rtol=1e-5,
                                    atol=1e-6)
    curve = runs["straight"].recorder.curve()
    assert curve[-5:].mean() < curve[:5].mean()


def test_deepspeed_zero3_on_the_gpu_matches_ddp_and_stops_and_resumes(nccl, tmp_path):  # noqa: F811
    """DeepSpeed's engine on CUDA (NCCL), ZeRO-3: the same step losses as trainer=ddp on the GPU within float
    tolerance, and the stop/resume contract step for step."""
    from tests.gpu.test_cuda import ddp_run

    # DDP first: DeepSpeed's ZeRO-3 replaces torch.nn.functional.linear in this process once it has run
    ddp = run_attempt(ddp_run(config(tmp_path / "ddp-cfg", MNIST)), 0, 1, 2, tmp_path / "ddp").recorder.curve()
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
    cfg = config(tmp_path / "cfg", ["trainer=deepspeed", "trainer.zero_stage=3", *MNIST])
    runs = check_stop_resume_parity(run_on_gpu("trainers.torch.deepspeed", cfg), tmp_path / "ds", rtol=1e-5,
                                    atol=1e-6)
    np.testing.assert_allclose(runs["straight"].recorder.curve(), ddp, rtol=1e-4, atol=1e-5)
