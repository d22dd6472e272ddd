"""The TensorFlow DTensor mesh of `trainer=tf_dtensor`, framework-free (config validation reads it before any
TensorFlow import): its two dimensions, which Ray worker (DTensor client) holds which devices and data, and which
weights the `model` dimension shards.

The mesh is `batch x model` devices, row-major: device d sits at batch coordinate d // model and model coordinate
d % model. Client c (Ray world rank c) holds devices c * D .. c * D + D - 1 (D devices per client). So a client
either holds whole model groups (model <= D: it feeds D / model batch coordinates of its own), or a model group
spans model / D clients that all feed the same batch coordinate (they read the same data shard, like a TP group).

Layouts, named by the mesh's shape: `data` (batch > 1, model = 1: the batch dimension sharded, every weight
replicated), `model` (batch = 1: weights sharded on `model`, the whole batch on every device) and `2d` (both).
"""
from __future__ import annotations

from dataclasses import dataclass

COLUMN, ROW, REPLICATED = "column", "row", "replicated"


@dataclass(frozen=True)
class MeshDims:
    batch: int    # devices along the batch dimension: each holds 1/batch of every batch
    model: int    # devices along the model dimension: each holds 1/model of every sharded weight
    clients: int  # Ray workers, one DTensor client each
    devices_per_client: int

    @property
    def devices(self) -> int:
        return self.batch * self.model

    def problem(self) -> str | None:
        """Why this mesh cannot be laid out over the clients' devices, or None."""
        if self.devices != self.clients * self.devices_per_client:
            return (f"the mesh has batch x model = {self.batch} x {self.model} = {self.devices} devices, the workers "
                    f"hold num_workers x devices_per_worker = {self.clients} x {self.devices_per_client} = "
                    f"{self.clients * self.devices_per_client}")
        d, m = self.devices_per_client, self.model
        if d % m and m % d:
            return (f"a model group of {m} devices must fill whole workers or be filled by them "
                    f"(devices_per_worker={d})")
        return None

    @property
    def layout_name(self) -> str:
        if self.model == 1:
            return "data"
        return "model" if self.batch == 1 else "2d"

    @property
    def clients_per_group(self) -> int:
        """Clients that feed the same batch coordinate (a model group spanning workers), else 1."""
        return max(1, self.model // self.devices_per_client)

    @property
    def data_groups(self) -> int:
        """Different data shards: one per group of clients that read the same rows."""
        return self.clients // self.clients_per_group

    @property
    def coords_per_client(self) -> int:
        """Batch coordinates a client feeds: its rows per step are that many batches."""
        return max(1, self.devices_per_client // self.model)

    def local_coords(self, client: int) -> list[int]:
        """For each of the client's devices, in order, which of its own batches (0 .. coords_per_client - 1) it
        holds (devices along `model` hold the same one)."""
        first = client * self.devices_per_client
        return [(first + j) // self.model - first // self.model for j in range(self.devices_per_client)]


def dense_plan(dense_layers: int) -> list[str]:
    """Megatron's pairing for a stack of Dense layers: a column-parallel layer (output features sharded on
    `model`) feeds a row-parallel one (input features sharded; DTensor sums the partial products), so each pair
    costs one all-reduce of activations. The logits layer is row-parallel when it closes a pair, else
    replicated. A layer between them (BatchNorm) is sharded like the features it normalises."""
    plan = []
    for i in range(dense_layers):
        last = i == dense_layers - 1
        plan.append(ROW if i % 2 else (REPLICATED if last else COLUMN))
    return plan


def sharded_widths(layer_sizes: list[int]) -> list[int]:
    """The feature widths the `model` dimension splits, for Dense layers of widths `layer_sizes` (inputs first):
    each column-parallel layer's output features. The mesh's `model` size must divide every one."""
    plan = dense_plan(len(layer_sizes) - 1)
    return [layer_sizes[i + 1] for i, kind in enumerate(plan) if kind == COLUMN]
