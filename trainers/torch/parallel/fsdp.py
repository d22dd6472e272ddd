"""Sharded data parallelism with FSDP2 (`torch.distributed.fsdp.fully_shard`, DTensor parameters).

Every rank holds 1/N of each parameter (dim 0, over the mesh's shard dimension). Each repeated block (the
modules of the classes its spec's `fsdp_blocks` names, else the entries of the model's `nn.ModuleList`s: BERT's
encoder blocks) is its own FSDP unit, so only one block's full
parameters exist at a time in forward and backward; the root unit takes the rest (embeddings, head). Gradients
are reduce-scattered (averaged) over the ranks, so the optimizer steps on shards. With "dp_replicate" (HSDP) the
model is sharded inside a replica group and gradients are also all-reduced across them. With "tp" the model is
first tensor-parallel (its spec's plan, trainers/torch/parallel/plans.py) and FSDP shards those DTensors further
over the data-parallel dimensions (2D parameters: FSDP x TP).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The part of `mesh` FSDP shards (and, with "dp_replicate", replicates) over."""
    names = mesh.mesh_dim_names or ()
    return mesh["dp_replicate", "dp_shard"] if "dp_replicate" in names else mesh["dp_shard"]


def fsdp_units(model: nn.Module, blocks: tuple[type, ...] = ()) -> list[nn.Module]:
    """The blocks that get their own FSDP unit: the modules of the classes `blocks` (outermost ones), else every
    entry of every `nn.ModuleList` in the model; only those that hold parameters (a pipeline stage's placeholders
    for other stages' blocks hold none)."""
    if blocks:
        found: list[nn.Module] = []
        _outermost(model, blocks, found)
    else:
        found = [block for module in model.modules() if isinstance(module, nn.ModuleList) for block in module]
    return [block for block in found if any(True for _ in block.parameters())]


def _outermost(module: nn.Module, blocks: tuple[type, ...], found: list[nn.Module]) -> None:
    for child in module.children():
        if isinstance(getattr(child, "_checkpoint_wrapped_module", child), blocks):  # a block, or its checkpointing
            found.append(child)
        else:
            _outermost(child, blocks, found)


def apply_activation_checkpointing(model: nn.Module, blocks: tuple[type, ...] = ()) -> nn.Module:
    """Wrap every FSDP unit block (`fsdp_units`) so that backward recomputes its activations instead of keeping
    them from forward (torch's non-reentrant checkpoint, RNG state preserved: dropout draws the same masks).
    Before `parallelize_fsdp`, so each wrapper becomes the unit. DCP's state-dict helpers drop the wrapper from
    parameter names, so checkpoints and the dense export keep the plain model's names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    units = {id(block) for block in fsdp_units(model, blocks)}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in units:
                setattr(parent, name, checkpoint_wrapper(child))
    return model


def parallelize_fsdp(model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool = True,
                     param_dtype: torch.dtype | None = None, blocks: tuple[type, ...] = ()) -> nn.Module:
    """Shard `model` in place over `mesh` (blocks first, then the root); returns it. `reshard_after_forward`:
    free each unit's gathered parameters after its forward and gather them again for backward (ZeRO-3), or keep
    them until backward (ZeRO-2: less communication, more memory). `param_dtype` (bf16): FSDP's mixed precision,
    parameters gathered and computed in that dtype, gradients reduced in float32 into the float32 shards the
    optimizer steps on, and the root's outputs (logits, or a pipeline stage's activations) cast to float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def policy(root: bool) -> MixedPrecisionPolicy:
        if param_dtype is None:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                    output_dtype=torch.float32 if root else None)

    for block in fsdp_units(model, blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy(False))
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy(True))
    return model
