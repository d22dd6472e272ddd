"""Initial MLP weights drawn by numpy, so that one seed gives the same starting model in PyTorch and in Keras:
the loss-parity gate (tests/unit/test_loop_backends.py, benchmarks/loss_parity.py) compares backends of both
frameworks step for step from there. Glorot-uniform kernels and zero biases, Keras' own Dense default (PyTorch's
Linear default draws from another range and a bias too). The CNN and the text models keep their framework's
initialisation: their layouts differ between the two (NCHW against NHWC kernels and flattening)."""
from __future__ import annotations

import numpy as np


def mlp_weights(sizes: list[int], seed: int) -> list[np.ndarray]:
    """float32 [kernel [in, out], bias [out]] per layer of an MLP with layer widths `sizes` (inputs first), in
    Keras' `get_weights` order."""
    rng = np.random.default_rng(seed)
    weights = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        weights += [rng.uniform(-limit, limit, (fan_in, fan_out)).astype(np.float32), np.zeros(fan_out, np.float32)]
    return weights
