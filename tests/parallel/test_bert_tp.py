"""The whole BERT classifier under tensor parallelism (both implementations), 2D dp x tp, and checkpoints.

Tolerances: see tests/support/parallel_checks.py (float64, atol 1e-10 / rtol 1e-8). Checkpoint copies are exact.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from tests.support.parallel_checks import check_grads, close, local
from tests.support.dist_utils import RankPools, seeded_float64
from trainers.models.bert import BertClassifier, BertConfig
from trainers.torch.parallel.grad_norm import clip_grad_norm
from trainers.torch.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
from trainers.torch.parallel.mesh import ParallelDims, build_mesh, rank_coords
from trainers.models.bert_parallel import parallelize_bert
from trainers.torch.parallel.plans import shard_state_dict, unshard_state_dict


def tiny_config(num_classes: int = 2) -> BertConfig:
    return BertConfig(vocab_size=50, max_len=8, hidden=32, layers=2, heads=4, dropout=0.0, num_classes=num_classes)


def make_batch(batch: int, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ids with trailing padding of varying length (row i has i % 4 pads), and labels."""
    ids = torch.randint(1, 50, (batch, seq))
    lengths = seq - torch.arange(batch) % 4
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask, torch.randint(0, 2, (batch,))


def dense_and_parallel(impl: str, mesh: DeviceMesh, num_classes: int = 2) -> tuple[BertClassifier, BertClassifier]:
    seeded_float64()
    dense = BertClassifier(tiny_config(num_classes))
    twin = BertClassifier(tiny_config(num_classes))
    twin.load_state_dict(dense.state_dict())
    return dense, parallelize_bert(twin, mesh, impl=impl)


def _check_is_sharded(par: BertClassifier, impl: str, n: int) -> None:
    """Guard against a plan that silently does nothing (the comparisons would then pass trivially)."""
    for block in par.blocks:
        assert local(block.attn.q_proj.weight).shape == (32 // n, 32)  # heads/tp whole heads of width 8
        assert local(block.mlp.fc_out.weight).shape == (32, 128 // n)
    sharded_head = impl == "megatron" and par.cfg.num_classes % n == 0
    assert isinstance(par.classifier, ColumnParallelLinear) == sharded_head
    assert isinstance(par.tok_emb, VocabParallelEmbedding) == (impl == "megatron")


def _full_model(rank: int, n: int, impl: str, num_classes: int) -> None:
    dense, par = dense_and_parallel(impl, build_mesh(ParallelDims(dp=1, tp=n)), num_classes)
    _check_is_sharded(par, impl, n)
    ids, mask, labels = make_batch(4)
    labels = labels % num_classes
    logits_dense, logits_par = dense(ids, mask), par(ids, mask)
    close(local(logits_par), logits_dense, "logits")
    F.cross_entropy(logits_dense, labels).backward()
    F.cross_entropy(logits_par, labels).backward()
    check_grads(dense, par)  # includes the token-embedding (input) gradient
    # One SGD step, then the gathered (unsharded) weights must equal the dense model's.
    torch.optim.SGD(dense.parameters(), lr=0.5).step()
    torch.optim.SGD(par.parameters(), lr=0.5).step()
    for name, value in unshard_state_dict(par).items():
        close(value, dense.state_dict()[name], f"{name} after SGD step")


@pytest.mark.parametrize("impl", ["megatron", "dtensor"])
@pytest.mark.parametrize("world_size,num_classes", [(2, 2), (4, 4), (4, 2)])
def test_bert_tensor_parallel_matches_dense(run_ranks: RankPools, impl: str, world_size: int,
                                            num_classes: int) -> None:
    # (4, 2): two classes cannot be split four ways, so the megatron classifier stays replicated.
    run_ranks(_full_model, world_size, impl, num_classes)


def _unshard_round_trip(rank: int, n: int) -> None:
    """Shard at tp=4, gather, reload the dense weights and shard them at tp=2: still the same function."""
    dense, par4 = dense_and_parallel("megatron", build_mesh(ParallelDims(dp=1, tp=4)))
    saved = unshard_state_dict(par4)
    assert saved.keys() == dense.state_dict().keys()
    for name, value in saved.items():
        assert value.shape == dense.state_dict()[name].shape, name
        assert torch.equal(value, dense.state_dict()[name]), name  # pure copies: exact
    resumed = BertClassifier(tiny_config())
    resumed.load_state_dict(saved)
    par2 = parallelize_bert(resumed, build_mesh(ParallelDims(dp=2, tp=2)), impl="megatron")
    ids, mask, _ = make_batch(3)
    close(par2(ids, mask), dense(ids, mask), "logits at tp=2 from a tp=4 checkpoint")
    # The inverse direction: this rank's shards of a dense state load straight into a megatron model.
    par2.load_state_dict(shard_state_dict(par2, dense.state_dict()))
    _, par_dt = dense_and_parallel("dtensor", build_mesh(ParallelDims(dp=1, tp=4)))
    for name, value in unshard_state_dict(par_dt).items():
        assert torch.equal(value, dense.state_dict()[name]), f"dtensor {name}"


def test_unshard_round_trip_across_tp_sizes(run_ranks: RankPools) -> None:
    run_ranks(_unshard_round_trip, 4)


def _check_mesh_layout(rank: int, mesh: DeviceMesh) -> tuple[int, int]:
    dp_rank, tp_rank = rank_coords(rank, dp=2, tp=2)
    assert tuple(mesh.get_coordinate()) == (dp_rank, tp_rank)
    assert dist.get_process_group_ranks(mesh.get_group("tp")) == [2 * dp_rank, 2 * dp_rank + 1]  # consecutive
    assert dist.get_process_group_ranks(mesh.get_group("dp")) == [tp_rank, tp_rank + 2]  # strided
    return dp_rank, tp_rank


def _check_batches(micro: torch.Tensor, mesh: DeviceMesh) -> None:
    """Identical micro-batches inside a TP group, different ones across the DP group."""
    for dim, same in (("tp", True), ("dp", False)):
        group = mesh.get_group(dim)
        parts = [torch.empty_like(micro) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, micro, group=group)
        assert torch.equal(parts[0], parts[1]) == same, f"{dim} group: expected identical batches={same}"


def _data_and_tensor_parallel(rank: int, n: int, impl: str) -> None:
    mesh = build_mesh(ParallelDims(dp=2, tp=2))
    dp_rank, _ = _check_mesh_layout(rank, mesh)
    dense, par = dense_and_parallel(impl, mesh)
    _check_is_sharded(par, impl, 2)
    ids, mask, labels = make_batch(4)  # the global batch, the same on every rank (same seed)
    own = slice(2 * dp_rank, 2 * dp_rank + 2)  # this DP rank's micro-batch; both TP ranks take the same one
    _check_batches(ids[own], mesh)
    F.cross_entropy(dense(ids, mask), labels).backward()
    F.cross_entropy(par(ids[own], mask[own]), labels[own]).backward()
    dp_group = mesh.get_group("dp")
    for p in par.parameters():  # DP sync: average over replicas (equal micro-batches -> mean of means)
        grad = local(p.grad)  # a DTensor's to_local() is its local tensor itself, so in-place ops stick
        dist.all_reduce(grad, group=dp_group)
        grad /= 2
    check_grads(dense, par)
    # Clipping by the global norm: the dense gradient's, not the norm of this rank's pieces (sharded parameters
    # summed over the TP group, replicated ones counted once). Clipped to half of it, so clipping acts.
    dense_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), float("inf"))
    torch.nn.utils.clip_grad_norm_(dense.parameters(), float(dense_norm) / 2)
    close(clip_grad_norm(par, float(dense_norm) / 2, mesh.get_group("tp")), dense_norm, "global gradient norm")
    check_grads(dense, par)


@pytest.mark.parametrize("impl", ["megatron", "dtensor"])
def test_2d_data_and_tensor_parallel_matches_dense_on_the_whole_batch_and_clips_by_its_norm(run_ranks: RankPools,
                                                                                              impl: str) -> None:
    run_ranks(_data_and_tensor_parallel, 4, impl)
