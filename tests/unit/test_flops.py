"""FLOPs per sample against analytic counts, and the peak table's lookups."""
from __future__ import annotations

from dataclasses import replace

import pytest
from omegaconf import OmegaConf

from pipelines.data.imdb import imdb_schema
from pipelines.data.mnist import mnist_schema
from contract.mfu import peak_flops, utilisation
from contract.registry import MODELS
from trainers.model_flops import flops_per_sample


def model_cfg(name: str, **keys):
    spec = MODELS.get(name)
    return OmegaConf.merge(OmegaConf.structured(spec.config), {"name": name, **keys})


def test_the_mlp_is_counted_to_the_digit():
    """2 FLOPs per multiply-add: forward 2 x in x out per layer; backward the same for each weight's gradient, and
    for each layer's input gradient except the first layer's (the images need none)."""
    sizes = [784, 512, 256, 10]
    products = [2 * a * b for a, b in zip(sizes, sizes[1:])]
    assert flops_per_sample(model_cfg("mlp", hidden=[512, 256]), mnist_schema()) == 3 * sum(products) - products[0]


def test_bert_tiny_is_counted_to_the_analytic_count_attention_included():
    """3 x the forward's products (the backward computes the gradients of both operands; the embeddings' output
    needs one too): per block the Q, K, V and output projections (8 T h^2), the MLP (16 T h^2, 4h wide) and
    attention's two products (4 T^2 h), then the classifier (2 h C). On the meta device the counter sees attention
    through its reference decomposition; on a CPU's fused kernel it would not."""
    layers, hidden, tokens, classes = 2, 128, 64, 2
    forward = layers * (24 * tokens * hidden ** 2 + 4 * tokens ** 2 * hidden) + 2 * hidden * classes
    assert flops_per_sample(model_cfg("bert", flavour="tiny"), imdb_schema(1000, tokens)) == 3 * forward


def test_a_specs_own_figure_comes_first(monkeypatch):
    """A model the counter cannot run (an operator without a meta kernel) gives its figure in its spec."""
    spec = MODELS.get("mlp")
    monkeypatch.setitem(MODELS.specs, "mlp", replace(spec, flops_per_sample=lambda cfg, inputs: 1234.0))
    assert flops_per_sample(model_cfg("mlp", hidden=[8]), mnist_schema()) == 1234.0


def test_a_keras_only_model_has_no_count():
    assert flops_per_sample(model_cfg("tfidf"), imdb_schema(1000, 64)) is None


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12), ("NVIDIA H100 PCIe", "bf16", 756.5e12),
    ("NVIDIA H200", "fp32", 66.9e12), ("NVIDIA A100-SXM4-80GB", "bf16", 312e12), ("NVIDIA A10", "bf16", 125e12),
    ("NVIDIA L40S", "fp16", 362.05e12), ("NVIDIA L4", "fp32", 30.3e12), ("Tesla V100-SXM2-16GB", "bf16", None),
    ("AMD EPYC 7B13", "fp32", None),
])
def test_peaks_by_device_name_and_precision(name, precision, peak):
    assert peak_flops(name, precision) == peak


def test_utilisation_shares_the_runs_flops_over_its_ranks():
    assert utilisation(2e9, 1000.0, 4, 1e12) == {"tflops_per_rank": 0.5, "mfu": 0.5}
    assert utilisation(2e9, 1000.0, 4, None) == {"tflops_per_rank": 0.5}
