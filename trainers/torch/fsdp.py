"""FSDP2 sharded data parallelism on Ray Train (a torch process group: gloo on CPU, NCCL on GPU).

Every worker builds the same dense model from the same seed and `parallelize_fsdp` shards it (trainers/torch/parallel/
fsdp.py); each worker reads its own data shard, as under DDP, so the run trains what DDP with the same workers
trains, holding ~1/N of the parameters, gradients and optimizer state per worker (logged each epoch as
`rank<r>.param_bytes`, `grad_bytes`, `optimizer_state_bytes`). With `trainer.tp` > 1 (the BERT model) the model is
first tensor-parallel with torch's DTensor plans inside groups of tp consecutive workers, which read the same
batches, and FSDP shards over the rest (FSDP x TP). With `trainer.pp` > 1 (BERT) each worker holds its pipeline
stages (trainers/torch/parallel/pipeline.py), each tensor-parallel and sharded as above, and a training step is one pass
of the pipeline schedule (`PipelineAdapter`): PP x TP x FSDP on one mesh.

Checkpoints are sharded: `torch.distributed.checkpoint` (DCP) writes each rank's shards of the model and optimizer
state into that rank's folder (no gather to rank 0) and Ray Train merges the folders; the schedule's state and
`train_state.json` come from rank 0. DCP's metadata places every shard, so a checkpoint loads at another number of
workers (resharded on load). A checkpoint inside an epoch is DCP's `async_save`: the state copied to host memory
at the step, written by a thread while training goes on. The final model is exported dense from the checkpoint for
MLflow.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from concurrent.futures import Future
from typing import Any, Callable

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed import ProcessGroup

from contract.registry import MODELS
from trainers.adapter import WorkerData
from trainers.context import WorkerContext
from trainers.models import build_model
from trainers.torch.adapter import TorchAdapter, batch_score, seed_dropout, worker_device
from trainers.torch.backend import TorchBackend
from trainers.torch.parallel.comm import collective_device
from trainers.torch.parallel.grad_norm import clip_dtensor_grad_norm
from trainers.torch.parallel.memory import rank_memory
from trainers.torch.parallel.mesh import ParallelDims, build_nd_mesh
from trainers.torch.data import Batch, Batches
from trainers.torch.recipe import AUTOCAST_DTYPES, TorchRecipe, build_recipe, task_loss

RECIPE_FILE = "recipe.pt"  # the schedule's (and scaler's) state, from rank 0, beside DCP's files
STATE_OPTIONS_FLAT = {"flatten_optimizer_state_dict": True}  # optimizer state keyed by parameter name


class FSDPAdapter(TorchAdapter):
    """The loop's adapter for an FSDP2 model: sharded checkpoints. Gradient sync is FSDP's own reduce-scatter in
    backward; clipping takes the global norm of the sharded gradients (trainers/torch/parallel/grad_norm.py
    `clip_dtensor_grad_norm`); every rank's memory is in the epoch extras, as for every PyTorch backend.

    `parts`: the model, or under pipeline parallelism this rank's stages (each a copy of the model holding only
    its stage's parameters, under their dense names). Checkpoints hold the parts' states merged: dense names, so
    any layout (number of ranks, pipeline stages) loads them."""

    sharded_checkpoint = True

    def __init__(self, parts: list[nn.Module], recipe: TorchRecipe, train: Batches,
                 evaluation: Batches, device: torch.device, rank: int, ranks_per_sample: int,
                 pp_group: ProcessGroup | None = None):
        self.parts = nn.ModuleList(parts)  # names "<part>.<dense name>": `_dense_key` drops the part
        model = parts[0] if len(parts) == 1 else self.parts
        super().__init__(model, recipe, train, evaluation, device, rank, ranks_per_sample=ranks_per_sample,
                         clip=lambda max_norm: clip_dtensor_grad_norm(self.parts, max_norm, pp_group))
        self._saving: Future | None = None  # the background save under way
        self._save_group: ProcessGroup | None = None  # its collectives' own gloo group, made at its first use

    def _state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(model state, flattened optimizer state) of this rank's parts, keyed "<part>.<dense name>"."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        return get_state_dict(self.parts, self.optimizer, options=StateDictOptions(**STATE_OPTIONS_FLAT))

    def save(self, directory: str) -> None:
        import torch.distributed.checkpoint as dcp

        self._wait_for_saving()
        dcp.save(self._checkpoint_state(), checkpoint_id=directory)
        self._save_recipe(directory)

    def save_in_background(self, directory: str) -> Callable[[], Any]:
        """DCP's `async_save`: the shards copied to host memory now, written by a thread while training goes on.
        The thread's collectives (the save plan, the metadata) run on a gloo group of their own, so they never
        interleave with the training's on the default group."""
        import torch.distributed.checkpoint as dcp

        self._wait_for_saving()  # one save at a time: each holds a copy of the state
        if self._save_group is None:
            self._save_group = dist.new_group(backend="gloo")
        self._saving = dcp.async_save(self._checkpoint_state(), checkpoint_id=directory,
                                      process_group=self._save_group)
        self._save_recipe(directory)
        return self._saving.result

    def _wait_for_saving(self) -> None:
        if self._saving is not None:
            self._saving.result()
            self._saving = None

    def _checkpoint_state(self) -> dict[str, Any]:
        return _by_dense_names(*self._state())

    def _save_recipe(self, directory: str) -> None:
        if self.rank == 0:
            torch.save(self.recipe.state_dict(), os.path.join(directory, RECIPE_FILE))

    def load(self, directory: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        model_state, optimizer_state = self._state()
        state = _by_dense_names(model_state, optimizer_state)
        dcp.load(state, checkpoint_id=directory)  # into this rank's shards, whatever the saving layout was
        # Back under the parts' keys (DCP replaces the non-tensor entries, e.g. the learning rates, in `state`).
        set_state_dict(self.parts, self.optimizer,
                       model_state_dict={key: state["model"][_dense_key(key, 0)] for key in model_state},
                       optim_state_dict={key: state["optimizer"][_dense_key(key, 1)] for key in optimizer_state},
                       options=StateDictOptions(**STATE_OPTIONS_FLAT))
        self.recipe.load_state_dict(torch.load(os.path.join(directory, RECIPE_FILE), map_location="cpu",
                                               weights_only=False))

    def dense_model_state(self) -> dict[str, torch.Tensor]:
        """This rank's parts, unsharded (collective: all-gathers the shards): the full model without pipeline
        stages, this rank's stages' parameters with them."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.parts, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return _by_dense_name(state, 0)


def _by_dense_names(model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint holds: the model's and the optimizer's states of this rank's parts, by dense name."""
    return {"model": _by_dense_name(model_state, 0), "optimizer": _by_dense_name(optimizer_state, 1)}


def _by_dense_name(state: dict[str, Any], at: int) -> dict[str, Any]:
    """`state` keyed by `_dense_key`. Parts hold disjoint parameters, so keys stay unique."""
    return {_dense_key(key, at): value for key, value in state.items()}


def _dense_key(key: str, at: int) -> str:
    """Drop the part index from "<part>.<dense name>" (model state: `at`=0) or "state.<part>.<dense
    name>.<entry>" (flattened optimizer state: `at`=1)."""
    fields = key.split(".")
    del fields[at]
    return ".".join(fields)


class PipelineAdapter(FSDPAdapter):
    """FSDP (or FSDP x TP) on pipeline stages: a training step is one pass of the pipeline schedule over the batch
    (trainers/torch/parallel/pipeline.py). The last stage computes the loss and broadcasts it to its pipeline group, so
    every rank reports the step's loss and samples (the loop counts each sample `ranks_per_sample` = pp x tp times);
    evaluation runs the pipeline forward only and the last stage broadcasts the score (correct count, squared
    errors)."""

    def __init__(self, parts: list[nn.Module], schedule: Any, stages: list[int], n_stages: int,
                 pp_group: ProcessGroup, recipe: TorchRecipe, train: Batches, evaluation: Batches,
                 device: torch.device, rank: int, ranks_per_sample: int, batch_size: int):
        super().__init__(parts, recipe, train, evaluation, device, rank, ranks_per_sample, pp_group)
        self.schedule, self.pp_group, self.batch_size = schedule, pp_group, batch_size
        self.first, self.last = 0 in stages, n_stages - 1 in stages
        self.last_rank = dist.get_global_rank(pp_group, dist.get_world_size(pp_group) - 1)  # holds the last stage
        self.trained_memory: dict[str, float] = {}

    def train_step(self, batch: Batch) -> tuple[float, int, int]:
        inputs, labels = [x.to(self.device) for x in batch[0]], batch[1].to(self.device)
        self.optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        self.schedule.step(*self._stage_args(inputs), **self._stage_kwargs(inputs),
                           target=labels if self.last else None, losses=losses,
                           return_outputs=False)  # bf16: FSDP's policy casts, not autocast
        loss = torch.stack(losses).mean().detach().double() if self.last else torch.zeros((), dtype=torch.float64)
        self._optimizer_step()
        return float(self._from_last_stage(loss)), len(labels), batch[2]

    def finish_epoch(self) -> None:
        """The epoch's memory figures are taken here, before evaluation: the schedule's forward-only pass drops
        the gradients (its shape inference clears them)."""
        super().finish_epoch()
        self.trained_memory = rank_memory(self.model, self.optimizer)

    def own_stats(self) -> dict[str, float]:
        return {**super().own_stats(), **self.trained_memory}

    @torch.no_grad()
    def evaluate(self, epoch: int) -> tuple[float, int]:
        """Batches of the training batch size (the pipeline's shapes are fixed); the last one padded with copies of
        its first row, whose predictions are dropped."""
        self.model.eval()
        score, total = torch.zeros((), dtype=torch.float64), 0
        for inputs, labels, _ in self.evaluation.epoch(epoch, shuffle=False):
            rows = len(labels)
            inputs = [_pad_rows(x, self.batch_size).to(self.device) for x in inputs]
            labels = _pad_rows(labels, self.batch_size).to(self.device)
            logits = self.schedule.eval(*self._stage_args(inputs), **self._stage_kwargs(inputs),
                                        target=labels if self.last else None)
            if self.last:
                score += batch_score(logits[:rows], labels[:rows], self.regression)
            total += rows
        return float(self._from_last_stage(score)), total

    def _stage_args(self, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The features (or token ids) enter on the first stage; the others receive activations."""
        return (inputs[0],) if self.first else ()

    @staticmethod
    def _stage_kwargs(inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """A token model's padding mask, which every stage gets."""
        return {"attention_mask": inputs[1]} if len(inputs) > 1 else {}

    def _from_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        value = value.to(collective_device(self.pp_group))
        dist.broadcast(value, src=self.last_rank, group=self.pp_group)
        return value.cpu()


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` with copies of its first row appended up to `rows` rows."""
    missing = rows - len(x)
    return torch.cat([x, x[:1].expand(missing, *x.shape[1:])]) if missing > 0 else x


def parallel_dims(trainer: DictConfig, world_size: int) -> ParallelDims:
    """The run's dimensions: the data-parallel degree is what pp x tp leave of the workers."""
    return ParallelDims(dp=world_size // (trainer.pp * trainer.tp), tp=trainer.tp, pp=trainer.pp,
                        dp_replicate=trainer.dp_replicate)


class FSDP(TorchBackend):
    """trainer=fsdp: FSDP2 on an N-D mesh (HSDP, FSDP x TP, pipeline stages); sharded checkpoints (DCP)."""

    def build_adapter(self, cfg: DictConfig, ctx: WorkerContext, data: WorkerData) -> FSDPAdapter:
        """The dense model from the shared seed, parallelized on the N-D mesh (trainers/torch/parallel/parallelize.py:
        this rank's pipeline stages if pp > 1, each tensor-parallel if tp > 1, sharded over the data-parallel
        dimensions); this rank's data-parallel shard, shuffled by its seed (alike in the pp x tp ranks that read the
        same batches)."""
        from trainers.torch.parallel.parallelize import ModelPlans, parallelize
        from trainers.torch.parallel.pipeline import build_schedule

        trainer, device, rank = cfg.trainer, worker_device(ctx), ctx.rank
        dims = parallel_dims(trainer, ctx.world_size)
        dims.validate(ctx.world_size)
        mesh = build_nd_mesh(dims, device.type)
        torch.manual_seed(cfg.run.seed)  # the same dense weights on every rank before each keeps its part
        model = build_model(cfg.model, data.inputs, seed=cfg.run.seed).to(device)
        plans = ModelPlans.of(MODELS.get(cfg.model.name), model)
        split = parallelize(model, dims, mesh, plans, trainer.pp_schedule, trainer.activation_checkpointing,
                            trainer.reshard_after_forward, AUTOCAST_DTYPES[trainer.precision])
        train, evaluation = data.shards(cfg.run.seed + 1000 * dims.data_rank(rank))
        # The recipe over the sharded parameters, without autocast: bf16 is FSDP's mixed-precision policy.
        recipe = replace(build_recipe(nn.ModuleList(split.parts), trainer, train.steps(), device), autocast_dtype=None)
        seed_dropout(cfg.run.seed, dims.dropout_stream(rank))  # the same masks in a TP group
        if dims.pp == 1:
            return FSDPAdapter(split.parts, recipe, train, evaluation, device, rank, ranks_per_sample=dims.batch_group)
        pp_group = mesh.get_group("pp")
        schedule = build_schedule(split.parts, split.stages, split.n_stages, trainer.pp_schedule, trainer.microbatches,
                                  task_loss(data.inputs.target.task), pp_group, device)
        return PipelineAdapter(split.parts, schedule, split.stages, split.n_stages, pp_group, recipe, train, evaluation,
                               device, rank, ranks_per_sample=dims.batch_group, batch_size=trainer.batch_size)

    def batch_group(self, cfg: DictConfig) -> int:
        """The pp x tp ranks of a pipeline (or a TP group) read the same batches."""
        return cfg.trainer.pp * cfg.trainer.tp

    def dense_state(self, directory: str) -> dict[str, torch.Tensor]:
        """The full model of a sharded checkpoint, read in this one process (DCP's `dcp_to_torch_save`)."""
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as scratch:
            path = os.path.join(scratch, "dense.pt")
            dcp_to_torch_save(directory, path)
            return torch.load(path, map_location="cpu", weights_only=False)["model"]
