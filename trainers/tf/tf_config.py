"""The Ray Train backend of `MultiWorkerMirroredStrategy` (each worker's TF_CONFIG), in a module that imports no
TensorFlow: Ray Train's controller unpickles it in a process that never runs TensorFlow, and Ray's own
`ray.train.tensorflow.TensorflowConfig` lives in a package that imports TensorFlow at the top (seconds of CPU in
every controller: benchmarks/README.md, startup). Each step is one of Ray's own functions, run on the workers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import ray
from ray.train.backend import Backend, BackendConfig
from ray.train.v2._internal.util import TrainingFramework

from contract.console import import_tensorflow
from trainers.preflight import PreflightConfig, check_workers_reachable
from trainers.worker import free_addresses, on_worker

TENSORFLOW = "ray.train.tensorflow.config"


@dataclass
class MirroredConfig(BackendConfig):
    """What `TensorflowConfig` sets up for `MultiWorkerMirroredStrategy`: each worker's TF_CONFIG naming every
    worker's address (and tf-keras as `tf.keras`, as Ray sets it). `preflight`: the workers' reachability, checked
    first (trainers/preflight.py)."""

    preflight: Optional[PreflightConfig] = None
    framework = TrainingFramework.TENSORFLOW  # what Ray Train records of the run

    @property
    def backend_cls(self) -> type:
        return MirroredBackend


class MirroredBackend(Backend):
    """`ray.train.tensorflow.config._TensorflowBackend`'s steps, the workers' ports drawn as our other TensorFlow
    backends draw theirs (`trainers.worker.free_addresses`: distinct, above the kernel's range for outgoing
    connections)."""

    def on_start(self, worker_group: Any, backend_config: MirroredConfig) -> None:
        if backend_config.preflight is not None:
            check_workers_reachable(worker_group, backend_config.preflight)
        urls = free_addresses(worker_group)  # each worker's TensorFlow server, as tf_ps' and DTensor's
        ray.get([worker_group.execute_single_async(index, set_up_worker, urls, index)
                 for index in range(len(worker_group))])


def set_up_worker(worker_addresses: list[str], index: int) -> None:
    """Runs on a worker: TensorFlow imported first, its start-up lines filtered (`ray.train.tensorflow` imports it
    at the top), then Ray's own set-up of the worker's TF_CONFIG."""
    import_tensorflow()
    on_worker(TENSORFLOW, "_setup_tensorflow_environment", worker_addresses=worker_addresses, index=index)
