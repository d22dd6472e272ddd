"""Backends and models, registered by name (contract/registry.py), the built-in ones as a user's would be: the
models in trainers/models/specs.py, the backends in each framework's `specs.py`. A backend is a `Backend` object
(trainers/backend.py) in its own module, imported on demand (`get_backend`) so that validating a config never
imports torch, TensorFlow or Ray. Importing this package registers every built-in spec."""
from __future__ import annotations

from typing import Any

import trainers.horovod.specs  # noqa: F401  (registers Horovod)
import trainers.models  # noqa: F401  (registers the built-in models)
import trainers.tf.specs  # noqa: F401  (registers the TensorFlow backends)
import trainers.torch.specs  # noqa: F401  (registers the PyTorch backends)
from contract.registry import BACKENDS, resolve

# framework -> (modules it needs, the package extra that installs them)
FRAMEWORKS: dict[str, tuple[tuple[str, ...], str]] = {
    "torch": (("torch",), "torch"),
    "tf": (("tensorflow", "tf_keras"), "tf"),
}


def get_backend(trainer: Any) -> Any:
    """The `Backend` object that trains a run of this trainer config (its framework's, where it has several); its
    module and framework imported now."""
    backend = resolve(BACKENDS.get(trainer.backend).backend_ref(framework_of(trainer)))
    return backend() if isinstance(backend, type) else backend


def framework_of(trainer: Any) -> str:
    """The framework a run of this trainer config trains with (`trainer.framework` where the backend has several)."""
    spec = BACKENDS.get(trainer.backend)
    return trainer.framework if len(spec.frameworks) > 1 else spec.frameworks[0]


def model_builders(trainer: Any) -> tuple[str, ...]:
    """The builders of a model spec this trainer config can build its model with (torch, keras, dtensor,
    lightning), the first one a spec has being the one used."""
    spec = BACKENDS.get(trainer.backend)
    return spec.model_builders or ({"torch": "torch", "tf": "keras"}[framework_of(trainer)],)
