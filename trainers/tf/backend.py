"""`TFBackend`: what every TensorFlow backend shares on Ray Train (tf_mwms, tf_dtensor, tf_ps, horovod tf). Its
worker processes start with tf-keras owning `tf.keras` (trainers/tf/adapter.py says why) and import TensorFlow
first, its start-up lines filtered; each worker holds its part of the data in memory (`ShardArrays`), or, in a
backend that `streams_files`, streams its part of every global batch (`StreamedArrays`); the final
checkpoint's model is logged to MLflow in the Keras flavour, from a Ray task started with tf-keras (never in the
driver, which imports no TensorFlow). `KerasFit` adds the choice of Keras `fit` or the shared loop
(`trainer.tf_loop`)."""
from __future__ import annotations

from typing import Any, Callable

from omegaconf import DictConfig

from contract.checkpoint import TrainState
from contract.console import import_tensorflow, quiet_keras_predict
from contract.data import DataSchema
from trainers.adapter import Adapter
from trainers.backend import Backend
from trainers.context import WorkerContext
from trainers.models import training_augment
from trainers.tf.adapter import LEGACY_KERAS_ENV, compiled_model_from, input_example
from trainers.tf.data import TrainArrays, ray_arrays, streamed_arrays


class TFBackend(Backend):
    """A TensorFlow backend. Subclasses give `build_adapter` and `ray_setup`, and `model_from` where a checkpoint does
    not hold the tf-keras model's files."""

    def worker_env(self, cfg: DictConfig) -> dict[str, str]:
        """tf-keras must own `tf.keras` from the process's start; TensorFlow's INFO and WARNING lines off unless
        `run.verbose` (contract/console.py `import_tensorflow`)."""
        return {**LEGACY_KERAS_ENV, "TF_CPP_MIN_LOG_LEVEL": "0" if cfg.run.verbose else "2"}

    def train_loop_per_worker(self, config: dict[str, Any]) -> None:
        import_tensorflow()  # first, with its start-up lines filtered
        super().train_loop_per_worker(config)

    def shards(self, cfg: DictConfig, inputs: DataSchema, seed: int) -> tuple[TrainArrays, TrainArrays]:
        """This worker's part of the data as arrays (the adapter shuffles it), pulled when the adapter asks: after
        the worker has set TensorFlow's threads; or streamed from the files (`data.cache_in_worker=false`, where
        the backend `streams_files`)."""
        if self.streams_files and not cfg.data.cache_in_worker:
            return streamed_arrays(cfg, inputs)  # augmented where read
        train, evaluation = ray_arrays(inputs)
        train.augment = training_augment(cfg)
        return train, evaluation

    def dataset_config(self, cfg: DictConfig) -> Any:
        """An ordered split whenever the worker holds its part (`ShardArrays`), which a backend that does not
        `streams_files` always does."""
        from trainers.data_split import split_config

        held = cfg.data.cache_in_worker or not self.streams_files
        return split_config(cfg.trainer.num_workers, held, self.batch_group(cfg))

    def model_from(self, keras: Any, cfg: Any, inputs: DataSchema, directory: str) -> Any:
        """The Keras model a checkpoint folder holds, for inference (default: tf-keras' weights file)."""
        return compiled_model_from(keras, cfg, inputs, directory)

    def log_final_model(self, tracking_uri: str, run_id: str, cfg: DictConfig, checkpoint: Any,
                        inputs: DataSchema) -> None:
        """MLflow's tensorflow (Keras) flavour. MLflow recognises Keras models through `tensorflow.keras`, which is
        tf-keras only with TF_USE_LEGACY_KERAS=1 from the process's start: the model is logged from a Ray task
        started so, not from this (driver) process."""
        import ray
        from omegaconf import OmegaConf

        from contract.registry import plugin_roots

        task = ray.remote(num_cpus=1, runtime_env={"env_vars": self.worker_env(cfg)})(log_keras_model)
        ray.get(task.remote(tracking_uri, run_id, OmegaConf.to_container(cfg, resolve=True), plugin_roots(cfg.plugins),
                            checkpoint, inputs, self.model_from))


class KerasFit(TFBackend):
    """A TensorFlow backend whose adapter can train through tf-keras `fit` (trainer.tf_loop=fit, with a callback
    that hands each epoch to the loop: trainers/tf/keras_fit.py) or through the shared loop (custom)."""

    def run_worker(self, cfg: DictConfig, ctx: WorkerContext, data: Any) -> bool:
        require_legacy_keras()
        return super().run_worker(cfg, ctx, data)

    def train(self, cfg: DictConfig, ctx: WorkerContext, adapter: Adapter) -> bool:
        from trainers.tf.keras_fit import run_epochs

        if not run_epochs(adapter.keras, adapter, ctx, cfg.trainer.tf_loop):
            return False
        adapter.dump(cfg.run.dump_params_dir)
        return True


def device_scaling(cfg: DictConfig) -> Any:
    """Ray Train's workers when each holds `trainer.devices_per_worker` devices: a CPU per thread, and with
    `use_gpu` a GPU per device."""
    from trainers.worker import scaling_config

    trainer = cfg.trainer
    resources = {"CPU": float(trainer.threads_per_worker)}
    if trainer.use_gpu:
        resources["GPU"] = float(trainer.devices_per_worker)
    return scaling_config(cfg, resources=resources)


def require_legacy_keras() -> None:
    import os

    if os.environ.get("TF_USE_LEGACY_KERAS") != "1":
        raise RuntimeError("TF_USE_LEGACY_KERAS=1 must be in the worker's environment from process start "
                           "(Ray starts the workers with the backend's `worker_env`)")


def log_keras_model(uri: str, run_id: str, cfg_dict: dict, roots: list[str], checkpoint: Any, inputs: DataSchema,
                    model_from: Callable[[Any, Any, DataSchema, str], Any]) -> None:
    """In a Ray task with tf-keras: the Keras model `model_from` reads out of `checkpoint`, logged to the run."""
    import mlflow

    from contract.config import typed_config
    from trainers.models.keras_models import custom_objects

    tf = import_tensorflow()  # before tf_keras imports it: with its start-up lines filtered
    import tf_keras as keras

    quiet_keras_predict(keras)  # MLflow predicts on the input example: no progress lines

    # The logged model is float32 (no dtype policy is set here), so without fp16's LossScaleOptimizer too: an
    # unbuilt one cannot skip the optimizer variables in the weights file (trainers/tf/adapter.py `load_keras_state`).
    cfg = typed_config({**cfg_dict, "trainer": {**cfg_dict["trainer"], "precision": "fp32"}}, roots)
    with checkpoint.as_directory() as directory:
        model = model_from(keras, cfg, inputs, directory)
        epoch = TrainState.read(directory).epoch
    mlflow.set_tracking_uri(uri)
    mlflow.start_run(run_id=run_id, log_system_metrics=False)
    try:
        # Explicit requirements: MLflow's inference imports and scans modules, seconds for nothing here.
        mlflow.tensorflow.log_model(model, name="model", input_example=input_example(inputs),
                                    keras_model_kwargs={"save_format": "keras"}, step=epoch,
                                    custom_objects=custom_objects(keras),
                                    pip_requirements=[f"tensorflow=={tf.__version__}",
                                                      f"tf-keras=={keras.__version__}"])
    finally:
        mlflow.end_run()
