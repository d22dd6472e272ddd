"""`Backend`: what a backend is, framework-free. One hook is required, `build_adapter(cfg, ctx, data)`: the
`Adapter` (trainers/adapter.py: model, optimizer, data, one training step, state files, collectives) this worker
hands to the shared loop (trainers/loop.py). The rest is provided, each part a method a backend may override:

- on each Ray Train worker: `train_loop_per_worker(config)` (the worker's config, context and data shards, then
  `run_worker`), `run_worker` (`build_adapter`, then `train`), `train` (the shared loop over the adapter);
- in the driver: `build_trainer` (a Ray Train `DataParallelTrainer` with the backend's process-group set-up
  `ray_setup`, `scaling_config`, `dataset_config` and `worker_env`, and every backend's run naming, checkpoint
  retention and restarts), and `log_final_model` (the model of the final checkpoint to the MLflow run).

A framework's family base gives what its backends share (trainers/torch/backend.py `TorchBackend`,
trainers/tf/backend.py `TFBackend` and `KerasFit`); a backend is then its adapter and a few lines. Its rules
(config keys, checks, layout) are registered with its `BackendSpec` (contract/registry.py), which names this object
by "module:attribute". A user's backend is written the same way.
"""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from contract.data import DataSchema
from trainers.adapter import Adapter, WorkerData
from trainers.context import WorkerContext
from trainers.loop import train
from trainers.worker import loop_config, ray_context, run_config, scaling_config, worker_config, worker_inputs


class Backend:
    """A backend on the shared loop. Subclasses give `build_adapter`; a framework's family base gives `shards` and
    `log_final_model`, and `ray_setup` where its backends share one (the torch process group)."""

    # Streamed data (`data.cache_in_worker=false`): True when `shards` reads the prepared files itself
    # (trainers/streamed.py), so Ray Train is handed no datasets; else its workers stream Ray Train's shards.
    streams_files = False

    # What every backend gives: the worker's adapter.
    def build_adapter(self, cfg: DictConfig, ctx: WorkerContext, data: WorkerData) -> Adapter:
        """The adapter this worker hands to the shared loop: its model (from the model spec, laid out as the backend
        lays it out), the recipe's optimizer, its part of the data (`data.shards(seed)`), its collectives."""
        raise NotImplementedError

    # On each worker.
    def train_loop_per_worker(self, config: dict[str, Any]) -> None:
        """What each Ray Train worker runs: `run_worker` on this worker's config, context and data shards."""
        cfg, inputs = worker_config(config), worker_inputs(config)
        data = WorkerData(inputs, lambda seed: self.shards(cfg, inputs, seed))
        self.run_worker(cfg, self.worker_context(config, cfg), data)

    def worker_context(self, config: dict[str, Any], cfg: DictConfig) -> WorkerContext:
        """This Ray Train worker's `WorkerContext` (trainers/worker.py `ray_context`)."""
        return ray_context(config, cfg)

    def shards(self, cfg: DictConfig, inputs: DataSchema, seed: int) -> tuple[Any, Any]:
        """This worker's (train, evaluation) data, in the form its adapters take, shuffled by `seed`."""
        raise NotImplementedError

    def run_worker(self, cfg: DictConfig, ctx: WorkerContext, data: WorkerData) -> bool:
        """This worker's adapter on the shared loop. False: stopped on request, with a checkpoint."""
        return self.train(cfg, ctx, self.build_adapter(cfg, ctx, data))

    def train(self, cfg: DictConfig, ctx: WorkerContext, adapter: Adapter) -> bool:
        """The remaining epochs of `adapter` on the shared loop, then `run.dump_params_dir`."""
        return train(adapter, ctx, cfg.run.dump_params_dir)

    # In the driver.
    def ray_setup(self, cfg: DictConfig, run_id: str) -> Any:
        """The Ray Train `BackendConfig` that sets the workers up before they run (a process group, TF_CONFIG, a
        rendezvous), imported without the framework: Ray Train's controller unpickles it."""
        raise NotImplementedError

    def scaling_config(self, cfg: DictConfig) -> Any:
        """One Ray Train worker per `trainer.num_workers`, a CPU per thread, placed by `trainer.placement_strategy`."""
        return scaling_config(cfg)

    def dataset_config(self, cfg: DictConfig) -> Any:
        """How Ray Train hands each worker its part of the datasets (trainers/data_split.py): an ordered split,
        one part per data-parallel group, when the workers cache their part; Ray's streaming split otherwise."""
        from trainers.data_split import split_config

        return split_config(cfg.trainer.num_workers, cfg.data.cache_in_worker, self.batch_group(cfg))

    def batch_group(self, cfg: DictConfig) -> int:
        """Ranks that read the same batches (a tensor-parallel group, a pipeline): 1 for data parallelism."""
        return 1

    def worker_env(self, cfg: DictConfig) -> dict[str, str]:
        """Variables the worker processes need from their start."""
        return {}

    def build_trainer(self, cfg: DictConfig, datasets: dict, run_id: str, tracking_uri: str, inputs: DataSchema,
                      callbacks: list | None = None) -> Any:
        """The Ray Train trainer of this run: every worker runs `train_loop_per_worker` (`callbacks`: more Ray Train
        callbacks for its RunConfig, e.g. a sweep trial's reporter)."""
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

        return DataParallelTrainer(
            self.train_loop_per_worker,
            train_loop_config=loop_config(cfg, run_id, tracking_uri, inputs),
            backend_config=self.ray_setup(cfg, run_id),
            scaling_config=self.scaling_config(cfg),
            run_config=run_config(cfg, run_id, callbacks, self.worker_env(cfg)),
            datasets=datasets,
            dataset_config=self.dataset_config(cfg),
        )

    def log_final_model(self, tracking_uri: str, run_id: str, cfg: DictConfig, checkpoint: Any,
                        inputs: DataSchema) -> None:
        """The model of `checkpoint` (a Ray Train checkpoint) logged to the MLflow run, in a flavour evaluate and
        predict load."""
        raise NotImplementedError
