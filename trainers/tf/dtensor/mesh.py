"""TensorFlow DTensor for `trainer=tf_dtensor`: the mesh over every client's devices, the sharding plan applied to a
plain `tf.Module` (`parallelize_dtensor`), batches packed onto the mesh, sums across the clients, and whole values
of sharded variables (checkpoints). Which device holds what: trainers/tf/dtensor/layout.py.

Multi-client DTensor: every Ray worker is one client holding `devices_per_worker` local devices (GPUs, or the CPU
split into logical devices, as the DTensor tutorial does); `initialize_accelerator_system` reads the DTENSOR_*
variables trainers/tf/dtensor/clients.py sets and connects the clients, and each op on a DTensor then runs on every
client's devices in step (SPMD), DTensor inserting the collectives a layout needs.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from trainers.models.tf_modules import BatchNorm, Classifier, Dense
from trainers.tf.dtensor.layout import COLUMN, ROW, MeshDims, dense_plan

U = dtensor.UNSHARDED
BATCH, MODEL, WORLD = "batch", "model", "world"


class DTensorMesh:
    """The `batch x model` mesh of this client and a 1-D mesh over the same devices for sums across clients."""

    def __init__(self, dims: MeshDims, client: int, device_type: str = "CPU", initialize: bool = True):
        """`initialize`: start this process's DTensor (once, before any other TF op: TF fixes its devices at the
        first), a CPU client splitting the CPU into `devices_per_client` logical devices; False: a further mesh
        over the devices of a process started already."""
        if initialize:
            cpus = dims.devices_per_client if device_type == "CPU" else None
            dtensor.initialize_accelerator_system(device_type, num_logical_cpu_devices=cpus)
        self.dims, self.client = dims, client
        self.mesh = dtensor.create_distributed_mesh([(BATCH, dims.batch), (MODEL, dims.model)], device_type=device_type)
        self.world = dtensor.create_distributed_mesh([(WORLD, dims.devices)], device_type=device_type)
        self.coords = dims.local_coords(client)  # per local device: which of this client's batches it holds

    def layout(self, spec: list[str]) -> dtensor.Layout:
        return dtensor.Layout(spec, self.mesh)

    def replicated(self, rank: int) -> dtensor.Layout:
        return dtensor.Layout.replicated(self.mesh, rank)

    def put(self, value: Any, layout: dtensor.Layout | None = None) -> tf.Tensor:
        """A value every client holds whole, onto the mesh (replicated, then laid out as `layout`)."""
        value = tf.convert_to_tensor(value)
        on_mesh = dtensor.copy_to_mesh(value, self.replicated(value.shape.rank))
        return on_mesh if layout is None else dtensor.relayout(on_mesh, layout)

    def pack_batch(self, rows: np.ndarray, per_coord: int) -> tf.Tensor:
        """This client's rows [coords_per_client * per_coord, ...] as its part of a batch sharded on `batch`: each
        local device gets the `per_coord` rows of its batch coordinate."""
        parts = [tf.constant(rows[k * per_coord:(k + 1) * per_coord]) for k in self.coords]
        return dtensor.pack(parts, self.layout([BATCH] + [U] * (rows.ndim - 1)))

    def local_rows(self, tensor: tf.Tensor) -> np.ndarray:
        """This client's rows of a batch-sharded result, in `pack_batch`'s order (one device per coordinate)."""
        parts = dtensor.unpack(dtensor.relayout(tensor, self.layout([BATCH] + [U] * (tensor.shape.rank - 1))))
        first = {}
        for device, coord in enumerate(self.coords):
            first.setdefault(coord, device)
        return np.concatenate([parts[first[coord]].numpy() for coord in sorted(first)])

    def over_clients(self, values: list[float], op: str) -> list[float]:
        """The sum (op "sum") or max ("max") of `values` over the clients (collective: every client calls)."""
        local = np.array([values], np.float64)
        if op == "sum":  # this client's values once, on its first device
            parts = [local] + [np.zeros_like(local)] * (self.dims.devices_per_client - 1)
        else:
            parts = [local] * self.dims.devices_per_client
        packed = dtensor.pack([tf.constant(p) for p in parts], dtensor.Layout([WORLD, U], self.world))
        total = tf.reduce_sum(packed, axis=0) if op == "sum" else tf.reduce_max(packed, axis=0)
        return dtensor.unpack(total)[0].numpy().tolist()

    def scalar(self, value: Any, dtype: Any = tf.float32) -> tf.Tensor:
        return self.put(tf.constant(value, dtype))

    def whole(self, variable: tf.Variable) -> np.ndarray:
        """A variable's whole value (collective: gathering a sharded one moves its shards)."""
        value = variable.read_value()
        return dtensor.unpack(dtensor.relayout(value, self.replicated(value.shape.rank)))[0].numpy()

    def assign_whole(self, variable: tf.Variable, value: np.ndarray) -> None:
        variable.assign(self.put(value.astype(variable.dtype.as_numpy_dtype), variable.layout))

    def variable(self, value: Any, layout: dtensor.Layout, trainable: bool = True, name: str | None = None) -> Any:
        return dtensor.DVariable(self.put(value, layout), trainable=trainable, name=name)

    def zeros_like(self, variable: tf.Variable) -> Any:
        """A zero-filled DTensor variable laid out as `variable` (optimizer slots)."""
        return dtensor.DVariable(tf.zeros_like(variable.read_value()), trainable=False)


def layer_specs(model: Classifier) -> list[dict[str, list[str]]]:
    """Per layer of `model.layers()`, each variable's sharding spec: Dense layers by `dense_plan`, a BatchNorm
    like the features it follows (sharded after a column-parallel layer)."""
    plan = iter(dense_plan(len(model.dense)))
    specs, features_sharded = [], False
    for layer in model.layers():
        if isinstance(layer, Dense):
            kind = next(plan)
            kernel = [U, MODEL] if kind == COLUMN else ([MODEL, U] if kind == ROW else [U, U])
            specs.append({"kernel": kernel, "bias": [MODEL] if kind == COLUMN else [U]})
            features_sharded = kind == COLUMN
        elif isinstance(layer, BatchNorm):
            spec = [MODEL] if features_sharded else [U]
            specs.append({name: spec for name in ("gamma", "beta", "moving_mean", "moving_variance")})
    return specs


def parallelize_dtensor(model: Classifier, mesh: DTensorMesh) -> Classifier:
    """Replace each of the model's variables by a DTensor variable of the same value, laid out by the plan
    (`layer_specs`): on a `model` dimension of 1 every weight is replicated (data parallelism)."""
    for layer, specs in zip(model.layers(), layer_specs(model)):
        for name, spec in specs.items():
            old = getattr(layer, name)
            setattr(layer, name, mesh.variable(old.numpy(), mesh.layout(spec), old.trainable, old.name.split(":")[0]))
    return model


def device_bytes(variables: list[Any]) -> int:
    """Bytes the variables take on this client's first device (its component of each)."""
    return sum(int(np.prod(dtensor.unpack(v.read_value())[0].shape)) * v.dtype.size for v in variables)
