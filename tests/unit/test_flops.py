"""FLOPs per sample against analytic counts, and the peak table's lookups."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from contract.data import imdb_schema, mnist_schema
from contract.flops import peak_flops, utilisation
from contract.registry import MODELS
from trainers.flops import flops_per_sample
from trainers.models import build_model
from trainers.models.specs import bert_flops
from trainers.torch.flops import training_flops_per_sample


def model_cfg(name: str, **keys):
    spec = MODELS.get(name)
    return OmegaConf.merge(OmegaConf.structured(spec.config), {"name": name, **keys})


def test_the_mlp_is_counted_to_the_digit():
    """2 FLOPs per multiply-add: forward 2 x in x out per layer; backward the same for each weight's gradient, and
    for each layer's input gradient except the first layer's (the images need none)."""
    sizes = [784, 512, 256, 10]
    products = [2 * a * b for a, b in zip(sizes, sizes[1:])]
    assert flops_per_sample(model_cfg("mlp", hidden=[512, 256]), mnist_schema()) == 3 * sum(products) - products[0]


def test_bert_tiny_is_given_by_its_spec_and_agrees_with_the_counter():
    """BERT's spec gives its count (contract: 3 x the forward's products); torch's counter on the model itself
    sees every projection, the MLPs and the classifier, but not the fused attention kernel on CPUs: the two agree
    once attention's two products per block (4 T^2 h forward) are added back."""
    cfg, inputs = model_cfg("bert", flavour="tiny"), imdb_schema(1000, 64)
    layers, hidden, tokens = 2, 128, 64
    attention = 3 * layers * 4 * tokens ** 2 * hidden
    assert flops_per_sample(cfg, inputs) == bert_flops(cfg, inputs)
    torch.manual_seed(0)
    counted = training_flops_per_sample(build_model(cfg, inputs, seed=0), inputs)
    assert counted + attention == bert_flops(cfg, inputs)
    assert bert_flops(cfg, inputs) == 3 * (layers * (24 * tokens * hidden ** 2 + 4 * tokens ** 2 * hidden)
                                           + 2 * hidden * 2)


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
