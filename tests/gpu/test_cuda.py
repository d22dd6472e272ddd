"""The CUDA paths of the PyTorch backends on a real GPU, in-process on the shared loop (no Ray cluster): skipped
without a GPU, as in CI. Where one is lent:

    python -m pytest -p no:cacheprovider tests/gpu

(these tests need torch, omegaconf, hydra and Ray's `Checkpoint` class, no Ray cluster or MLflow). The GPU machines
lent here have one GPU, and NCCL refuses two ranks on one device, so the process groups have one rank; every
collective still runs through NCCL, which takes CUDA tensors only, a path the CPU suite's gloo groups never take.
Scoring on a GPU: tests/unit/test_evaluate.py. Results: benchmarks/README.md, "Speed on one GPU"."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist

from pipelines.data.imdb import imdb_schema
from pipelines.data.mnist import mnist_schema
from tests.support.loop_harness import (check_parity, check_stop_resume_parity, config, imdb_columns, mnist_columns,
                                        run_attempt, with_callbacks)
from trainers.callbacks.mfu import Utilisation
from tests.support.parallel_checks import dense_training

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda", 0)
# 320 rows / 16 = 20 steps per epoch: the stop at step 10 is mid-epoch. The recipe as in the CPU test of the
# adapter (tests/unit/test_loop.py): momentum buffers, the schedule's position and the epoch's totals survive.
MNIST = ["trainer.use_gpu=true", "trainer.num_workers=1", "trainer.batch_size=16", "trainer.optimizer=sgd",
         "trainer.lr=0.01", "model.hidden=[32]", "model.dropout=0", "trainer.epochs=2", "trainer.lr_schedule=cosine",
         "trainer.warmup_steps=3", "trainer.grad_clip=1.0", "trainer.grad_accum=2"]
CNN = ["trainer.use_gpu=true", "trainer.num_workers=1", "trainer.batch_size=16", "model=cnn", "model.channels=[8,16]",
       "model.hidden=32", "model.dropout=0"]


@pytest.fixture
def nccl(tmp_path):
    """A one-rank NCCL group on GPU 0, as Ray Train's TorchConfig(backend="nccl") makes for `trainer.use_gpu`."""
    torch.cuda.set_device(CUDA)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1,
                            device_id=CUDA)
    assert dist.get_backend() == "nccl"
    yield
    dist.destroy_process_group()


def batches(train: dict[str, np.ndarray], evaluation: dict[str, np.ndarray], dataset: str, size: int,
            device: torch.device = CUDA) -> Callable:
    """A rank's cached shards as a GPU worker holds them: on the GPU (Ray Data's `iter_torch_batches` hands a GPU
    worker its batches there), text batched by length and trimmed as `trainers.torch.data.ray_batches` does. A
    dense reference on the CPU takes the same batches with `device` the CPU."""
    from trainers.torch.data import ShardBatches

    as_torch = lambda columns: {k: torch.from_numpy(v).to(device) for k, v in columns.items()}  # noqa: E731
    text = dataset == "imdb"
    schema = imdb_schema(64, 16) if text else mnist_schema()
    return lambda seed: (ShardBatches.from_columns(as_torch(train), schema, size, seed, bucket_by_length=text,
                                                   trim=text),
                         ShardBatches.from_columns(as_torch(evaluation), schema, 64, seed, trim=text))


def ddp_run(cfg) -> Callable:
    """DDP's worker on GPU 0, its model in DDP as on a GPU worker of several (one rank here, over NCCL)."""
    from torch.nn.parallel import DistributedDataParallel

    from trainers.adapter import WorkerData
    from trainers.torch.ddp import DDP

    data = batches(mnist_columns(320), mnist_columns(64, seed=1), "mnist", 16)

    def run(ctx):
        adapter = DDP().build_adapter(cfg, replace(ctx, device=CUDA), WorkerData(mnist_schema(), data))
        adapter.model = adapter.forward = DistributedDataParallel(adapter.model, device_ids=[CUDA.index])
        return DDP().train(cfg, ctx, adapter)
    return run


def test_ddp_over_nccl_stops_and_resumes_every_step_on_the_gpu(nccl, tmp_path):
    """DDP on CUDA over NCCL (its bucket all-reduce, the loop's metric and stop reductions, the gather of every
    rank's memory figures): the stop/resume contract holds step for step, and the memory figures are CUDA's."""
    runs = check_stop_resume_parity(ddp_run(config(tmp_path, MNIST)), tmp_path, rtol=1e-6, atol=1e-7)
    extras = runs["straight"].recorder.extras[2]
    assert 0 < extras["rank0.peak_memory_bytes"] < torch.cuda.get_device_properties(CUDA).total_memory
    assert extras["rank0.param_bytes"] == 4 * (784 * 32 + 32 + 32 * 10 + 10)  # float32 weights on the GPU


def test_fp16_with_loss_scaling_and_bf16_track_fp32_on_the_gpu(nccl, tmp_path):
    """precision=fp16 (autocast to float16 with a GradScaler: the loss scaled, gradients unscaled before clipping)
    and bf16 on the GPU: their step losses differ from float32's (half precision really ran) and stay within 0.05
    of them over 40 steps; both learn. fp16's stop/resume keeps the scaler's state: the resumed curve is the
    uninterrupted one."""
    from trainers.torch.adapter import DENSE_STATE_FILE

    curves = {}
    for precision in ("fp32", "bf16", "fp16"):
        cfg = config(tmp_path / precision, [*MNIST, f"trainer.precision={precision}"])
        curves[precision] = run_attempt(ddp_run(cfg), 0, 1, 2, tmp_path / precision / "run").recorder.curve()
    for half in ("bf16", "fp16"):
        assert not np.array_equal(curves[half], curves["fp32"]), half
        np.testing.assert_allclose(curves[half], curves["fp32"], rtol=0, atol=0.05, err_msg=half)
        assert curves[half][-5:].mean() < curves[half][:5].mean(), half
    cfg = config(tmp_path / "fp16-resume", [*MNIST, "trainer.precision=fp16"])
    runs = check_stop_resume_parity(ddp_run(cfg), tmp_path / "fp16-resume", rtol=1e-6, atol=1e-7)
    state = torch.load(runs["stopped"].checkpoint / DENSE_STATE_FILE, weights_only=False)
    assert state["scaler"]["scale"] > 0  # the loss scale, restored with the schedule


def test_fused_optimizers_on_the_gpu_train_the_dense_cpu_model(nccl, tmp_path):
    """On CUDA parameters the update runs fused (one kernel per parameter group: `torch_recipe.update_kernels`).
    DDP over NCCL with fused AdamW (decayed matrices, plain biases) and fused SGD with momentum, both with warmup,
    a cosine schedule and clipping, trains the dense CPU model's step losses (foreach kernels) within float
    tolerance."""
    from trainers.models import build_model
    from trainers.torch.recipe import make_optimizer

    cpu_data = batches(mnist_columns(320), mnist_columns(64, seed=1), "mnist", 16, torch.device("cpu"))
    keys = ["trainer.use_gpu=true", "trainer.num_workers=1", "trainer.batch_size=16", "model.hidden=[32]",
            "model.dropout=0", "trainer.epochs=2", "trainer.lr_schedule=cosine", "trainer.warmup_steps=3",
            "trainer.grad_clip=1.0"]
    recipes = {"adamw": ["trainer.optimizer=adamw", "trainer.lr=0.003", "trainer.weight_decay=0.01"],
               "sgd": ["trainer.optimizer=sgd", "trainer.lr=0.01"]}
    for name, recipe in recipes.items():
        cfg = config(tmp_path / name, [*keys, *recipe])
        assert make_optimizer(build_model(cfg.model, mnist_schema()).to(CUDA), cfg.trainer).defaults["fused"], name
        curve = run_attempt(ddp_run(cfg), 0, 1, 2, tmp_path / name / "run").recorder.curve()
        dense, _ = dense_training(cfg, mnist_schema(), [cpu_data(cfg.run.seed)[0]])
        np.testing.assert_allclose(curve, dense, rtol=1e-4, atol=1e-5, err_msg=name)
        assert curve[-5:].mean() < curve[:5].mean(), name


def test_checkpoints_move_between_cpu_and_gpu_runs_with_each_devices_kernels(nccl, tmp_path):
    """A CPU run's checkpoint (foreach AdamW, its step counters on the CPU) resumed by a GPU worker updates fused,
    as a fresh GPU run does, its counters on the GPU; a GPU run's checkpoint loads with its tensors on the CPU and
    resumes on the CPU with foreach. Both stopped-then-resumed step-loss curves are the uninterrupted CPU run's."""
    from trainers.adapter import WorkerData
    from trainers.torch.adapter import load_state_file
    from trainers.torch.ddp import DDP

    keys = ["trainer.num_workers=1", "trainer.batch_size=16", "model.hidden=[32]", "model.dropout=0",
            "trainer.epochs=2", "trainer.optimizer=adamw", "trainer.lr=0.003", "trainer.weight_decay=0.01",
            "trainer.lr_schedule=cosine", "trainer.warmup_steps=3"]
    cpu = torch.device("cpu")
    adapters = []

    def run_on(device: torch.device) -> Callable:
        cfg = config(tmp_path / device.type, [*keys, f"trainer.use_gpu={device.type == 'cuda'}"])
        data = batches(mnist_columns(320), mnist_columns(64, seed=1), "mnist", 16, device)

        def run(ctx):
            adapters.append(DDP().build_adapter(cfg, replace(ctx, device=device), WorkerData(mnist_schema(), data)))
            return DDP().train(cfg, ctx, adapters[-1])
        return run

    straight = run_attempt(run_on(cpu), 0, 1, 2, tmp_path / "straight")
    for saver, resumer in ((cpu, CUDA), (CUDA, cpu)):
        folder = tmp_path / f"{saver.type}-to-{resumer.type}"
        stopped = run_attempt(run_on(saver), 0, 1, 2, folder / "stopped", stop=True)
        state = load_state_file(stopped.checkpoint)
        assert not any(value.is_cuda for entry in state["optimizer"]["state"].values() for value in entry.values()
                       if torch.is_tensor(value))
        resumed = run_attempt(run_on(resumer), 0, 1, 2, folder / "resumed", restored=stopped.checkpoint)
        check_parity({"straight": straight, "stopped": stopped, "resumed": resumed}, 2, False, rtol=1e-4, atol=1e-5)
        optimizer = adapters[-1].optimizer
        assert all(bool(group["fused"]) == (resumer.type == "cuda") for group in optimizer.param_groups)
        assert all(entry["step"].device.type == resumer.type for entry in optimizer.state.values())


def test_fsdp_over_nccl_on_the_gpu_trains_the_dense_model(nccl, tmp_path):
    """FSDP2 (`fully_shard` on a one-rank CUDA mesh, NCCL) trains the dense model (float32 on the CPU: the same
    step losses within float tolerance, other kernels); with bf16 mixed precision its step losses differ, follow
    float32's within 0.01 for 15 steps (later ones drift further as training amplifies the rounding: 0.08 apart at
    step 20 on an H200) and fall; the sharded checkpoint exports dense float32 weights. The text shard is cached on
    the GPU and batched by length, as a GPU worker's Ray Data shard is (a `use_gpu` IMDb run failed there once: its
    attention mask and length buckets were built on the CPU)."""
    keys = ["model=bert_tiny", "model.hidden=32", "model.heads=2", "model.dropout=0", "trainer.lr=0.002"]
    curves, dense = fsdp_in_both_precisions(keys, tmp_path)
    np.testing.assert_allclose(curves["fp32"], dense, rtol=1e-4, atol=1e-4)
    assert not np.array_equal(curves["bf16"], curves["fp32"])
    np.testing.assert_allclose(curves["bf16"][:15], curves["fp32"][:15], rtol=0, atol=0.01)
    assert curves["bf16"][-5:].mean() < curves["bf16"][:5].mean()


def fsdp_in_both_precisions(keys: list[str], tmp_path) -> tuple[dict[str, np.ndarray], list[float]]:
    """FSDP's worker on the GPU for one epoch of an IMDb-shaped text shard cached there (64 ids, 16 tokens, batch 16,
    AdamW with clipping; `keys`: the model and its learning rate), in fp32 and in bf16, each checkpoint exporting
    dense float32 weights; and the step losses of the dense model trained on the CPU on the same batches."""
    from trainers.adapter import WorkerData
    from trainers.torch.fsdp import FSDP

    model_inputs = imdb_schema(64, 16)
    data, cpu_data = (batches(imdb_columns(320, 64, 16), imdb_columns(64, 64, 16, seed=1), "imdb", 16, device)
                      for device in (CUDA, torch.device("cpu")))
    keys = ["trainer=fsdp", "data=imdb", *keys, "trainer.batch_size=16", "trainer.epochs=1", "trainer.num_workers=1",
            "trainer.optimizer=adamw", "trainer.weight_decay=0.01", "trainer.grad_clip=0.5", "trainer.use_gpu=true"]
    curves = {}
    for precision in ("fp32", "bf16"):
        cfg = config(tmp_path / precision, [*keys, f"trainer.precision={precision}"])
        run = lambda ctx: FSDP().run_worker(cfg, replace(ctx, device=CUDA), WorkerData(model_inputs, data))  # noqa: E731
        attempt = run_attempt(run, 0, 1, 1, tmp_path / precision / "run")
        curves[precision] = np.asarray(attempt.recorder.curve())
        assert {v.dtype for v in FSDP().dense_state(str(attempt.checkpoint)).values()} == {torch.float32}
    dense, _ = dense_training(config(tmp_path / "dense", keys), model_inputs, [cpu_data(cfg.run.seed)[0]])
    return curves, dense


@pytest.mark.parametrize("impl", ["megatron", "dtensor"])
def test_tp_over_nccl_on_the_gpu_trains_the_dense_model(nccl, tmp_path, impl):
    """Tensor parallelism of either impl on a one-rank CUDA mesh (NCCL), AdamW with clipping, trains the dense CPU
    model: the same step losses within float tolerance. The DTensor plan leaves embeddings and norms plain, a mix
    that CUDA's default foreach update refuses (a `use_gpu` tp run failed at its first step)."""
    from trainers.adapter import WorkerData
    from trainers.torch.tp import TP

    model_inputs = imdb_schema(64, 16)
    data, cpu_data = (batches(imdb_columns(320, 64, 16), imdb_columns(64, 64, 16, seed=1), "imdb", 16, device)
                      for device in (CUDA, torch.device("cpu")))
    keys = ["trainer=tp", "trainer.tp=1", f"trainer.tp_impl={impl}", "data=imdb", "model=bert_tiny",
            "model.hidden=32", "model.heads=2", "model.dropout=0", "trainer.batch_size=16", "trainer.lr=0.002",
            "trainer.epochs=1", "trainer.num_workers=1", "trainer.optimizer=adamw", "trainer.weight_decay=0.01",
            "trainer.grad_clip=0.5", "trainer.use_gpu=true"]
    cfg = config(tmp_path, keys)
    run = lambda ctx: TP().run_worker(cfg, replace(ctx, device=CUDA), WorkerData(model_inputs, data))  # noqa: E731
    curve = run_attempt(run, 0, 1, 1, tmp_path / "run").recorder.curve()
    dense, _ = dense_training(config(tmp_path / "dense", keys), model_inputs, [cpu_data(cfg.run.seed)[0]])
    np.testing.assert_allclose(curve, dense, rtol=1e-4, atol=1e-4)
    assert curve[-5:].mean() < curve[:5].mean()


def test_compiled_cnn_on_the_gpu_trains_the_eager_step_losses(nccl, tmp_path):
    """`trainer.compile=true` on CUDA (Inductor's Triton kernels, DDP over NCCL): the CNN's step losses are eager's
    within float tolerance for 15 steps and stay within 1% over 40 (other kernels, other rounding, which training
    amplifies: 0.12% apart at step 39 on an H200); the forward really went through Dynamo."""
    keys = [*CNN, "trainer.optimizer=sgd", "trainer.lr=0.01", "trainer.epochs=2", "trainer.grad_clip=1.0"]
    curves = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        cfg = config(tmp_path / str(compiled), [*keys, f"trainer.compile={str(compiled).lower()}"])
        curves[compiled] = run_attempt(ddp_run(cfg), 0, 1, 2, tmp_path / str(compiled) / "run").recorder.curve()
        assert (torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0) == compiled
    np.testing.assert_allclose(curves[True][:15], curves[False][:15], rtol=1e-4, atol=0)
    np.testing.assert_allclose(curves[True], curves[False], rtol=1e-2, atol=0)
    assert curves[True][-5:].mean() < curves[True][:5].mean()


def test_flight_recorder_dumps_the_ranks_collectives_when_the_hang_watcher_fires(tmp_path, monkeypatch):
    """NCCL's Flight Recorder, on as `trainers.torch.process_group.flight_recorder_env` turns it on, records this rank's
    collectives; `dump_flight_recorder` (what the hang watcher calls on a GPU rank) writes them where
    `torch.distributed.flight_recorder.fr_trace` reads them, with the all-reduces made."""
    import pickle

    from trainers.torch.process_group import flight_recorder_env
    from trainers.torch.backend import dump_flight_recorder

    for key, value in flight_recorder_env(str(tmp_path)).items():
        monkeypatch.setenv(key, value)  # before the group exists: NCCL reads them when it is made
    torch.cuda.set_device(CUDA)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1,
                            device_id=CUDA)
    try:
        for _ in range(3):
            dist.all_reduce(torch.ones(4, device=CUDA))
        torch.cuda.synchronize()
        dump_flight_recorder(tmp_path, 0)
    finally:
        dist.destroy_process_group()
    trace = pickle.loads((tmp_path / "nccl_trace_rank_0").read_bytes())
    assert sum("all_reduce" in entry["profiling_name"] for entry in trace["entries"]) >= 3  # "nccl:all_reduce"


def test_mfu_is_logged_against_the_gpus_peak(tmp_path, nccl):
    """The loop's `tflops_per_rank` over the device's dense peak at the run's precision (contract/mfu.py)."""
    from contract.mfu import peak_flops
    from trainers.model_flops import flops_per_sample

    peak = peak_flops(torch.cuda.get_device_name(CUDA), "fp32")
    if peak is None:
        pytest.skip(f"{torch.cuda.get_device_name(CUDA)} is not in contract/mfu.py's table")
    cfg = config(tmp_path / "cfg", MNIST)
    flops = flops_per_sample(cfg.model, mnist_schema())
    run = ddp_run(cfg)
    attempt = run_attempt(lambda ctx: run(with_callbacks(replace(ctx, device=CUDA), Utilisation(flops, peak))), 0,
                          1, 1, tmp_path / "run")
    extras = attempt.recorder.extras[1]
    assert extras["mfu"] == pytest.approx(extras["tflops_per_rank"] * 1e12 / peak) and 0 < extras["mfu"] < 1


def test_a_transformers_model_trains_on_the_gpu_in_float32_and_bf16(nccl, tmp_path):
    """`model=hf` (a tiny Llama from a `save_pretrained` folder) through FSDP over NCCL on the GPU: float32 takes the
    dense CPU model's step losses within float tolerance; bf16 (FSDP's mixed precision) differs from float32 and
    follows it within 0.01 for 10 steps, and the sharded checkpoint exports dense float32 weights."""
    from tests.support.hf_models import save_tiny

    folder = save_tiny("llama", tmp_path / "llama")
    curves, dense = fsdp_in_both_precisions(["model=hf", f"model.path={folder}", "trainer.lr=0.003"], tmp_path)
    np.testing.assert_allclose(curves["fp32"], dense, rtol=1e-4, atol=1e-4)
    assert not np.array_equal(curves["bf16"], curves["fp32"])
    np.testing.assert_allclose(curves["bf16"][:10], curves["fp32"][:10], rtol=0, atol=0.01)
