"""MNIST classifiers. Inputs are normalised float images, either [B, 784] or [B, 1, 28, 28]."""
from __future__ import annotations

import torch
from torch import nn

from trainers.models.portable_init import mlp_weights


class MLP(nn.Module):
    """`init_seed`: the initial weights of `portable_init.mlp_weights` (Keras' MLP starts from the same ones);
    None: PyTorch's default initialisation."""

    def __init__(self, hidden: list[int], dropout: float = 0.0, in_features: int = 784, classes: int = 10,
                 init_seed: int | None = None):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU(), nn.Dropout(dropout)]
            width = size
        layers.append(nn.Linear(width, classes))
        self.net = nn.Sequential(*layers)
        if init_seed is not None:
            self.load_portable_init(init_seed, [in_features, *hidden, classes])

    @torch.no_grad()
    def load_portable_init(self, seed: int, sizes: list[int]) -> None:
        weights = mlp_weights(sizes, seed)
        linears = [m for m in self.net if isinstance(m, nn.Linear)]
        for linear, kernel, bias in zip(linears, weights[0::2], weights[1::2]):
            linear.weight.copy_(torch.from_numpy(kernel.T))  # Keras' kernel is [in, out], Linear's [out, in]
            linear.bias.copy_(torch.from_numpy(bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))  # (B, 784) -> (B, classes)


class CNN(nn.Module):
    """Two conv-pool-relu blocks then a dense head; small enough to train on CPUs.

    Pooling before the ReLU gives the same numbers as the usual conv-relu-pool (the max of a window commutes with
    a ReLU, and so do the gradients: bit for bit, tests/unit/test_models.py) with the ReLU on a quarter of the
    values, a faster training step on CPUs (benchmarks/README.md, scaling)."""

    def __init__(self, channels: list[int], hidden: int = 128, dropout: float = 0.25, classes: int = 10):
        super().__init__()
        c1, c2 = channels
        self.features = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1), nn.MaxPool2d(2), nn.ReLU(inplace=True),   # (B, c1, 14, 14)
            nn.Conv2d(c1, c2, 3, padding=1), nn.MaxPool2d(2), nn.ReLU(inplace=True),  # (B, c2, 7, 7)
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout), nn.Linear(c2 * 7 * 7, hidden), nn.ReLU(),
            nn.Dropout(dropout), nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.reshape(-1, 1, 28, 28)))
