"""DeepSpeed on Ray Train: `deepspeed.initialize` on the worker's torch process group (gloo on CPU, NCCL on
GPU) with ZeRO stage 1, 2 or 3 (`trainer.zero_stage`), an adapter on the shared loop like every PyTorch backend's.

The recipe maps into DeepSpeed's config (trainers/torch/deepspeed_config.py): the optimizer is the recipe's torch
optimizer, which ZeRO shards, and the schedule the recipe's `LambdaLR`, which the engine steps at each update;
clipping, accumulation and autocast are DeepSpeed's. Accumulation boundaries are the loop's (every `grad_accum`
batches and the epoch's last one, as every backend's), set on the engine before each backward.

Checkpoints are DeepSpeed's own (`engine.save_checkpoint`: every rank writes its ZeRO partitions; Ray Train merges
the folders), marked for DeepSpeed's universal format: a run resumed on another number of ranks converts the
checkpoint (`deepspeed.checkpoint.ds_to_universal`) and loads it with `load_universal`. The logged model is the dense
fp32 model DeepSpeed consolidates from the partitions. DeepSpeed is imported on the workers (and by the driver only
to log the model).
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
from omegaconf import DictConfig

from trainers.adapter import WorkerData
from trainers.context import WorkerContext
from trainers.models import build_model
from trainers.torch.adapter import TorchAdapter, place_model, seed_dropout, worker_device
from trainers.torch.backend import TorchBackend
from trainers.torch.data import Batch
from trainers.torch.deepspeed_config import engine_config
from trainers.torch.parallel.memory import local_bytes
from trainers.torch.recipe import TorchRecipe, build_recipe

TAG = "deepspeed"  # the checkpoint's folder inside a Ray Train checkpoint (DeepSpeed's tag)
UNIVERSAL_INFO = {"universal_checkpoint_version": 0.4}  # what ds_to_universal needs to find in a checkpoint
PARTITION_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def import_deepspeed(use_gpu: bool) -> Any:
    """DeepSpeed on the CPU accelerator (gloo where oneCCL is absent) or CUDA, without its inference-only CPU op,
    its INFO lines off, and its ZeRO's use of a collective torch deprecates (one FutureWarning per worker) unsaid."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if use_gpu else "cpu")
    import deepspeed

    # Its CPU shared-memory all-reduce serves inference only (`inference_all_reduce`); DeepSpeed would JIT-compile it
    # at every process's start on a CPU machine (a C++ compiler run, slow on each new machine or environment).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor. is deprecated", category=FutureWarning)
    return deepspeed


@contextlib.contextmanager
def unprinted(verbose: bool) -> Iterator[None]:
    """DeepSpeed's own prints (its engine's set-up, a checkpoint's consolidation and its progress bar) off the
    console unless `verbose`; errors still raise."""
    if verbose:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def saved_ranks(directory: str | Path) -> int:
    """How many ranks wrote the DeepSpeed checkpoint in `directory` (one ZeRO partition file each)."""
    return sum(1 for path in (Path(directory) / TAG).iterdir() if PARTITION_FILE.match(path.name))


class DeepSpeedAdapter(TorchAdapter):
    """The loop's adapter over a DeepSpeed engine. `universal`: the checkpoint to restore was written by another
    number of ranks (converted on load)."""

    sharded_checkpoint = True  # every rank writes its ZeRO partitions

    def __init__(self, engine: Any, recipe: TorchRecipe, train: Any, evaluation: Any, device: torch.device,
                 rank: int, universal: bool):
        super().__init__(engine, recipe, train, evaluation, device, rank)
        self.engine, self.universal = engine, universal
        self.position = 0  # batches of the epoch trained so far

    def batches(self, epoch: int, skip: int) -> Iterator[Batch]:
        self.position = skip
        return super().batches(epoch, skip)

    def train_step(self, batch: Batch) -> tuple[float, int, int]:
        """Forward, backward and the engine's step, which updates (clip, optimizer, schedule) at a boundary only;
        the engine scales the loss by 1/grad_accum, as every backend does."""
        inputs, labels = tuple(x.to(self.device) for x in batch[0]), batch[1].to(self.device)
        self.position += 1
        boundary = self.pending + 1 == self.passes or self.position == self.train.steps()
        self.engine.set_gradient_accumulation_boundary(boundary)
        loss = self.loss_fn(self.engine(*inputs).float(), labels)
        self.engine.backward(loss)
        self.engine.step()
        self.pending = 0 if boundary else self.pending + 1
        return loss.item(), len(labels), batch[2]

    def finish_epoch(self) -> None:
        """Nothing: the epoch's last batch was an update boundary."""

    def own_stats(self) -> dict[str, float]:
        """This rank's parameter bytes (under ZeRO-3 its partitions) and optimizer-state bytes (its ZeRO partition of
        the torch optimizer's state), and peak memory."""
        param_bytes = sum(held_elements(p) * p.element_size() for p in self.engine.module.parameters())
        states = [value for state in self.recipe.optimizer.state.values() for value in state.values()
                  if isinstance(value, torch.Tensor) and value.dim() > 0]
        return {"param_bytes": float(param_bytes), "optimizer_state_bytes": local_bytes(states),
                "peak_memory_bytes": self.peak_memory_bytes()}

    def dense_model_state(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict (ZeRO-3 gathers its partitions: a collective)."""
        import deepspeed

        module, sharded = self.engine.module, self.engine.zero_optimization_stage() == 3
        with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=sharded):
            return {key: value.detach().clone() for key, value in module.state_dict().items()}

    def save(self, directory: str) -> None:
        self.engine.save_checkpoint(directory, tag=TAG)

    def load(self, directory: str) -> None:
        """DeepSpeed's checkpoint (model, ZeRO partitions, schedule); one of another world size through DeepSpeed's
        universal format. The hyperparameters are the config's (a PBT trial with a mutated lr), as every backend's."""
        if self.universal:
            with tempfile.TemporaryDirectory(prefix="deepspeed-universal-") as converted:
                self.engine.load_checkpoint(to_universal(directory, converted), tag=TAG)
            own_step_counters(self.recipe.optimizer)
        else:
            self.engine.load_checkpoint(directory, tag=TAG)
        self.recipe.load_state_dict({})


def held_elements(param: torch.nn.Parameter) -> int:
    """Elements of `param` this rank holds: under ZeRO-3 its partition, or the whole of a small parameter DeepSpeed
    keeps on every rank (`ds_persist`: below stage3_param_persistence_threshold); else the whole parameter."""
    if hasattr(param, "ds_tensor"):
        return param.ds_numel if getattr(param, "ds_persist", False) else param.ds_tensor.numel()
    return param.numel()


def own_step_counters(optimizer: torch.optim.Optimizer) -> None:
    """Give each ZeRO partition its own copy of the update count. DeepSpeed's universal load (ZeRO-3) puts one
    tensor in every parameter group's state; torch's Adam advances it in place once per group, so the second
    group's bias correction would run a step ahead of a dense Adam's."""
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def to_universal(directory: str, converted: str) -> str:
    """The checkpoint in `directory` converted to DeepSpeed's universal format into the folder `converted` (each
    worker converts its own copy: no folder need be shared between nodes); returns `converted`."""
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    str(Path(directory) / TAG), "--output_folder", str(Path(converted) / TAG),
                    "--num_extract_workers", "1", "--num_merge_workers", "1"],
                   check=True, capture_output=True, text=True)
    (Path(converted) / "latest_universal").write_text(TAG)
    return converted


def restored_ranks(ctx: WorkerContext) -> int | None:
    """How many ranks wrote the checkpoint this worker restores (None: none to restore)."""
    if ctx.restored is None:
        return None
    with ctx.restored.as_directory() as directory:
        return saved_ranks(directory)


class DeepSpeed(TorchBackend):
    """trainer=deepspeed: DeepSpeed's engine (ZeRO 1, 2 or 3) on the worker's process group."""

    def build_adapter(self, cfg: DictConfig, ctx: WorkerContext, data: WorkerData) -> DeepSpeedAdapter:
        """The plain model (the same initial weights on every rank) and the recipe's optimizer and schedule, handed to
        `deepspeed.initialize` on the process group already set up; this rank's shard, shuffled by its own seed."""
        deepspeed = import_deepspeed(cfg.trainer.use_gpu)
        device = worker_device(ctx)
        torch.manual_seed(cfg.run.seed)
        model = place_model(build_model(cfg.model, data.inputs, seed=cfg.run.seed), device)
        model.universal_checkpoint_info = dict(UNIVERSAL_INFO)
        train, evaluation = data.shards(cfg.run.seed + 1000 * ctx.rank)
        # One parameter group where nothing decays: ZeRO all-gathers each group's updated partition apart, so a
        # second group is a second set of collectives at every step (benchmarks/README.md, deepspeed_vs_bare).
        recipe = build_recipe(model, cfg.trainer, train.steps(), device, group_per_decay=False)
        saved = restored_ranks(ctx)
        universal = saved is not None and saved != ctx.world_size
        config = engine_config(cfg.trainer)
        config["checkpoint"] = {**config.get("checkpoint", {}), "load_universal": universal}
        with unprinted(cfg.run.verbose):
            engine, _, _, _ = deepspeed.initialize(model=model, optimizer=recipe.optimizer, config=config,
                                                   lr_scheduler=recipe.scheduler, dist_init_required=False)
        seed_dropout(cfg.run.seed, ctx.rank)
        return DeepSpeedAdapter(engine, recipe, train, evaluation, device, ctx.rank, universal)

    def dense_state(self, directory: str) -> dict[str, torch.Tensor]:
        """The dense fp32 model DeepSpeed consolidates from a checkpoint's ZeRO partitions."""
        import_deepspeed(use_gpu=False)
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with unprinted(verbose=False):
            return get_fp32_state_dict_from_zero_checkpoint(directory, tag=TAG)
