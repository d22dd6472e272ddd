"""A trainer=lightning worker: Lightning's `Trainer` fits the LightningModule over this worker's Ray Data shard, and a
callback hands each step and epoch to the shared loop (trainers/loop.py), as Keras `fit` does
(trainers/tf/keras_fit.py): the same metrics, step losses, STOP agreement, checkpoints and MLflow logging as every
backend. Lightning's own logger, checkpointing, progress bar and sampler are off: the loop owns those.

Lightning's checkpoint (`lightning.ckpt`: weights, optimizer and schedule, Lightning's loop counters) sits beside the
loop's `train_state.json`; a resumed run hands it to `Trainer.fit(ckpt_path=...)`, which restores it, mid-epoch
included: the data loader skips the steps the stopped epoch trained (`EpochLoader`).
"""
from __future__ import annotations

import collections
import contextlib
import os
import shutil
import tempfile
import time
import warnings
from typing import Any, Callable, Iterator

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.environments import LightningEnvironment
from omegaconf import DictConfig

from contract.console import quiet_lightning_logs
from contract.metrics import PendingReduce
from trainers.adapter import Adapter, WorkerData
from trainers.context import WorkerContext
from trainers.loop import TrainLoop
from trainers.models import build_lightning_module, build_model, has_builder
from trainers.torch.adapter import (TorchProfiler, batch_score, dist_reduce_later, gathered_stats, place_model,
                                    seed_dropout, worker_device)
from trainers.torch.data import Batches
from trainers.torch.lightning_checkpoint import CHECKPOINT_FILE
from trainers.torch.lightning_hyperparameters import ConfiguredHyperparameters
from trainers.torch.lightning_module import RecipeModule
from trainers.torch.parallel.memory import rank_memory

PRECISIONS = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}  # `trainer.precision` -> Lightning's

Strategy = Callable[[DictConfig, WorkerContext], pl.strategies.Strategy]


class EpochLoader:
    """Lightning's training data: this worker's batches in the loop's fixed order per epoch (`Batches`), as
    (inputs, targets) batches Lightning moves to the device. The epoch is the Trainer's (`epoch_now`); a resumed
    epoch skips the steps trained before its stop (`skip`, from the checkpoint's train_state.json). Keeps each
    batch's token count and the time spent waiting for batches, for the loop's metrics. A `state_dict` makes
    Lightning treat it as resumable: the position is the loop's."""

    def __init__(self, shard: Batches, epoch_now: Callable[[], int], skip: int):
        self.shard, self.epoch_now, self.skip = shard, epoch_now, skip
        self.tokens: collections.deque[int] = collections.deque()  # of batches handed over, not yet trained
        self.wait_s = 0.0

    def __len__(self) -> int:
        return self.shard.steps()

    def __iter__(self) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
        skip, self.skip = self.skip, 0
        batches = self.shard.epoch(self.epoch_now(), skip=skip)
        self.tokens.clear()
        while True:
            start = time.perf_counter()
            batch = next(batches, None)
            self.wait_s += time.perf_counter() - start
            if batch is None:
                return
            inputs, targets, tokens = batch
            self.tokens.append(tokens)
            yield inputs, targets

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class LightningAdapter(Adapter):
    """The loop's side of a Lightning run: evaluation, the all-reduce, checkpoints through Lightning's Trainer and
    per-rank memory. Training steps are Lightning's (`HandToLoop` reports them)."""

    def __init__(self, module: pl.LightningModule, train: Batches, evaluation: Batches,
                 device: torch.device, rank: int, passes: int):
        self.module, self.train, self.evaluation, self.device, self.rank = module, train, evaluation, device, rank
        self.passes = passes  # batches per optimizer step (Lightning's accumulate_grad_batches)
        self.load_s = train.load_s + evaluation.load_s
        self.regression = train.schema.target.task == "regression"
        self.trainer: pl.Trainer | None = None
        self.restore_path: str | None = None  # Lightning's checkpoint to resume from, copied out of the restored one

    def steps_per_epoch(self) -> int:
        return self.train.steps()

    @torch.no_grad()
    def evaluate(self, epoch: int) -> tuple[float, int]:
        """The LightningModule's forward over this rank's evaluation shard; under FSDP with its parameters gathered
        (a collective: every rank evaluates)."""
        was_training = self.module.training
        self.module.eval()
        score, total = 0.0, 0
        with self._whole_parameters():
            for inputs, labels, _ in self.evaluation.epoch(epoch, shuffle=False):
                outputs = self.module(*(x.to(self.device) for x in inputs))
                score += batch_score(outputs, labels.to(self.device), self.regression)
                total += len(labels)
        self.module.train(was_training)
        return score, total

    def _whole_parameters(self) -> Any:
        """FSDP's `summon_full_params` where Lightning's strategy sharded the module, else nothing."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapped = self.trainer.strategy.model
        if isinstance(wrapped, FullyShardedDataParallel):
            return FullyShardedDataParallel.summon_full_params(wrapped, writeback=False)
        return contextlib.nullcontext()

    def reduce_later(self, values: list[float], op: str) -> PendingReduce:
        return dist_reduce_later(values, op)

    def save(self, directory: str) -> None:
        """Lightning's checkpoint (every rank calls: its strategy gathers what rank 0 writes)."""
        self.trainer.save_checkpoint(os.path.join(directory, CHECKPOINT_FILE), weights_only=False)

    def load(self, directory: str) -> None:
        """Keep the checkpoint for `Trainer.fit`, which restores it: the restored folder may be a temporary copy."""
        self.restore_path = os.path.join(tempfile.mkdtemp(prefix="lightning-restore-"), CHECKPOINT_FILE)
        shutil.copyfile(os.path.join(directory, CHECKPOINT_FILE), self.restore_path)

    def profiler(self, folder: str, steps: int) -> TorchProfiler:
        return TorchProfiler(folder, steps, cuda=self.device.type == "cuda")

    def peak_memory_bytes(self) -> float:
        if self.device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(self.device))
        return super().peak_memory_bytes()

    def epoch_extras(self) -> dict[str, float]:
        """Every rank's parameter, gradient and optimizer-state bytes and peak memory, as the other PyTorch
        backends log them."""
        stats = {**rank_memory(self.module, self.trainer.optimizers[0]), "peak_memory_bytes": self.peak_memory_bytes()}
        return gathered_stats(stats, self.rank)

    def dump(self, directory: str | None) -> None:
        if directory:
            os.makedirs(directory, exist_ok=True)
            torch.save(self.module.state_dict(), os.path.join(directory, f"rank{self.rank}.pt"))


class HandToLoop(pl.Callback):
    """Hands Lightning's steps and epochs to the shared loop: each step's loss (`step_loss`, non-finite losses),
    each step and epoch to the loop's callbacks (the step bar, profiler, start-up metrics, hang marks), the STOP
    agreement at update boundaries (a checkpoint of the
    half-done epoch, then Lightning stops), and each epoch's totals to `loop.end_epoch` (evaluation, metrics,
    checkpoint, report, MLflow; early stopping)."""

    def __init__(self, loop: TrainLoop, loader: EpochLoader, passes: int):
        self.loop, self.loader, self.passes = loop, loader, passes
        self.stopped = False  # on a STOP request, with a checkpoint
        self.ended = False    # no more training: stopped, diverged or early-stopped
        self.epoch = 0        # the epoch in progress (1-based)

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self._begin_epoch(trainer)  # Lightning calls no `on_train_epoch_start` for an epoch it resumes mid-way

    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.epoch != trainer.current_epoch + 1:
            self._begin_epoch(trainer)

    def _begin_epoch(self, trainer: pl.Trainer) -> None:
        loop, self.epoch = self.loop, trainer.current_epoch + 1
        self.totals = loop.state.totals_for(self.epoch, loop.ctx.rank)
        loop.callbacks.on_epoch_start(self.epoch, self.totals.steps)
        loop.callbacks.on_phase(self.epoch, self.totals.steps + 1, "step")
        self.loader.wait_s = 0.0
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loop, totals = self.loop, self.totals
        loss = float(outputs["loss"]) * trainer.accumulate_grad_batches  # Lightning hands it scaled for backward
        totals.loss_sum += loss * len(batch[1])
        totals.samples += len(batch[1])
        totals.steps += 1
        totals.tokens += self.loader.tokens.popleft()
        loop.callbacks.on_phase(self.epoch, totals.steps + 1, "step")
        loop.step_losses.log(self.epoch, totals.steps, loss)
        if loop.diverged_at is not None:  # every rank at once: each settled the same all-reduced losses
            self._closed_totals()
            self._end(trainer)
            loop.report_diverged(self.epoch)
            return
        loop.callbacks.on_steps_end(self.epoch, totals.steps, 1)
        boundary = totals.steps % self.passes == 0  # Lightning stepped the optimizer after this batch
        if boundary and loop.after_steps(self.epoch, totals, self.start):  # a step checkpoint, or STOP
            self._end(trainer)
            self.stopped = True
            loop.report_stop(self.epoch, self._closed_totals())

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.ended:
            return
        loop = self.loop
        totals = self._closed_totals()
        if loop.diverged_at is not None:  # found by the epoch's last step losses
            self._end(trainer)
            loop.report_diverged(self.epoch)
        elif loop.end_epoch(self.epoch, totals):
            self._end(trainer)  # early stopping, or a non-finite epoch loss

    def _closed_totals(self) -> Any:
        """The epoch's totals once its step losses are settled and its training told to the loop's callbacks."""
        self.loop.step_losses.settle()
        self.totals.train_s += time.perf_counter() - self.start
        self.totals.data_wait_s += self.loader.wait_s
        self.loop.callbacks.on_epoch_trained(self.epoch)
        return self.totals

    def _end(self, trainer: pl.Trainer) -> None:
        self.ended = True
        trainer.should_stop = True


class WorkerEnvironment(LightningEnvironment):
    """Lightning's view of a worker whose process group is set up already (by Ray Train, or a test): its rank and
    world size from the `WorkerContext`, one process per worker (Lightning launches none)."""

    def __init__(self, ctx: WorkerContext):
        super().__init__()
        self.ctx = ctx

    @property
    def creates_processes_externally(self) -> bool:
        return True

    def world_size(self) -> int:
        return self.ctx.world_size

    def global_rank(self) -> int:
        return self.ctx.rank

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return 0

    def set_world_size(self, size: int) -> None:
        pass

    def set_global_rank(self, rank: int) -> None:
        pass

    def teardown(self) -> None:
        pass


class OnWorkerDevice:
    """A Lightning strategy on the worker's device (what `ray.train.lightning`'s strategies do with Ray Train's)."""

    def __init__(self, device: torch.device, **kwargs: Any):
        super().__init__(**kwargs)
        self.device = device

    @property
    def root_device(self) -> torch.device:
        return self.device


class WorkerDDPStrategy(OnWorkerDevice, pl.strategies.DDPStrategy):
    """Lightning's DDP on the worker's device."""


class WorkerFSDPStrategy(OnWorkerDevice, pl.strategies.FSDPStrategy):
    """Lightning's FSDP on the worker's device."""


def local_strategy(cfg: DictConfig, ctx: WorkerContext) -> pl.strategies.Strategy:
    """`trainer.strategy` over the process group a test set up, outside Ray Train."""
    environment = WorkerEnvironment(ctx)
    if cfg.trainer.strategy == "fsdp":
        return WorkerFSDPStrategy(worker_device(ctx), cluster_environment=environment, state_dict_type="full")
    return WorkerDDPStrategy(worker_device(ctx), cluster_environment=environment)


def ray_strategy(cfg: DictConfig, ctx: WorkerContext) -> pl.strategies.Strategy:
    """Ray's Lightning strategies (`trainer.strategy`), on Ray Train's process group and device."""
    from ray.train.lightning import RayDDPStrategy, RayFSDPStrategy, RayLightningEnvironment

    if cfg.trainer.strategy == "fsdp":
        return RayFSDPStrategy(cluster_environment=RayLightningEnvironment(), state_dict_type="full")
    return RayDDPStrategy(cluster_environment=RayLightningEnvironment())


def build_module(cfg: DictConfig, ctx: WorkerContext, inputs: Any, steps_per_epoch: int) -> pl.LightningModule:
    """The model spec's own LightningModule, else its plain model under this project's recipe (`RecipeModule`);
    the same initial weights on every rank (DDP broadcasts rank 0's too)."""
    torch.manual_seed(cfg.run.seed)
    if has_builder(cfg.model, "lightning"):
        module = build_lightning_module(cfg.model, inputs, seed=cfg.run.seed)
    else:
        model = build_model(cfg.model, inputs, seed=cfg.run.seed)
        module = RecipeModule(model, inputs.target.task, cfg.trainer, steps_per_epoch)
    return place_model(module, worker_device(ctx))


def build_trainer(cfg: DictConfig, ctx: WorkerContext, strategy: pl.strategies.Strategy,
                  callbacks: list[pl.Callback]) -> pl.Trainer:
    """Lightning's Trainer with the recipe's clipping, accumulation and precision; nothing of its own logging,
    checkpointing or sampling (the loop's and the shards' do that)."""
    trainer = cfg.trainer
    return pl.Trainer(
        accelerator="gpu" if trainer.use_gpu else "cpu", devices=1, num_nodes=ctx.world_size, strategy=strategy,
        max_epochs=trainer.epochs, precision=PRECISIONS[trainer.precision],
        gradient_clip_val=trainer.grad_clip, gradient_clip_algorithm="norm",
        accumulate_grad_batches=trainer.grad_accum, callbacks=callbacks,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False)


def fit(cfg: DictConfig, ctx: WorkerContext, data: WorkerData, strategy: Strategy,
        prepare: Callable[[pl.Trainer], pl.Trainer] = lambda trainer: trainer) -> bool:
    """This worker's remaining epochs through Lightning's Trainer (`prepare`d), handed to the shared loop. False:
    stopped on request, with a checkpoint."""
    if not cfg.run.verbose:
        quiet_lightning_logs()
    train, evaluation = data.shards(cfg.run.seed + 1000 * ctx.rank)
    device = worker_device(ctx)
    module = build_module(cfg, ctx, data.inputs, train.steps())
    seed_dropout(cfg.run.seed, ctx.rank)
    adapter = LightningAdapter(module, train, evaluation, device, ctx.rank, cfg.trainer.grad_accum)
    loop = TrainLoop(adapter, ctx)  # restores: adapter.restore_path, the state's half-done epoch
    try:
        if loop.first_epoch > ctx.epochs or loop.early_stopped():
            return True
        loader = EpochLoader(train, lambda: adapter.trainer.current_epoch + 1,
                             skip=loop.state.totals_for(loop.first_epoch, ctx.rank).steps)
        hand = HandToLoop(loop, loader, cfg.trainer.grad_accum)
        # A resumed run trains with its config's hyperparameters, not the checkpoint's (hyperparameters.py)
        adapter.trainer = prepare(build_trainer(cfg, ctx, strategy(cfg, ctx), [ConfiguredHyperparameters(), hand]))
        with warnings.catch_warnings():
            if not cfg.run.verbose:  # Lightning's advice on its loggers, loaders and Slurm; a user's warnings stay
                warnings.filterwarnings("ignore", module=r"lightning\.")
            adapter.trainer.fit(module, train_dataloaders=loader, ckpt_path=adapter.restore_path, weights_only=False)
    finally:  # the checkpoint's copy: read by `fit`, or not needed (a run already ended, or one that failed)
        if adapter.restore_path is not None:
            shutil.rmtree(os.path.dirname(adapter.restore_path), ignore_errors=True)
    if hand.stopped:
        return False
    adapter.dump(cfg.run.dump_params_dir)
    return True


def run_worker(cfg: DictConfig, ctx: WorkerContext, data: WorkerData, strategy: Strategy = local_strategy) -> bool:
    return fit(cfg, ctx, data, strategy)


def run_on_ray(cfg: DictConfig, ctx: WorkerContext, data: WorkerData) -> bool:
    """A Ray Train worker: Ray's Lightning strategy and environment, checked by `prepare_trainer`."""
    from ray.train.lightning import prepare_trainer

    return fit(cfg, ctx, data, ray_strategy, prepare_trainer)
