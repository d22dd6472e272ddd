"""The MLP and the CNN, for any image or numeric features and any number of outputs. Inputs come flat,
[B, width] (normalised floats, contract/data.py `Features`); the CNN reshapes them to the image's (H, W[, C])."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from contract.data import DataSchema
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
        return self.net(x.flatten(1))  # (B, in_features) -> (B, classes)


class CNN(nn.Module):
    """Two conv-pool-relu blocks then a dense head; small enough to train on CPUs. `image`: (H, W) or (H, W, C).

    Pooling before the ReLU gives the same numbers as the usual conv-relu-pool (the max of a window commutes with
    a ReLU, and so do the gradients: bit for bit, tests/unit/test_models.py) with the ReLU on a quarter of the
    values, a faster training step on CPUs (benchmarks/README.md, scaling)."""

    def __init__(self, channels: list[int], hidden: int = 128, dropout: float = 0.25, classes: int = 10,
                 image: tuple[int, ...] = (28, 28)):
        super().__init__()
        self.image = tuple(image)
        height, width = image[:2]
        c0 = image[2] if len(image) == 3 else 1
        c1, c2 = channels
        self.features = nn.Sequential(
            nn.Conv2d(c0, c1, 3, padding=1), nn.MaxPool2d(2), nn.ReLU(inplace=True),  # (B, c1, H/2, W/2)
            nn.Conv2d(c1, c2, 3, padding=1), nn.MaxPool2d(2), nn.ReLU(inplace=True),  # (B, c2, H/4, W/4)
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout), nn.Linear(c2 * (height // 4) * (width // 4), hidden), nn.ReLU(),
            nn.Dropout(dropout), nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.image) == 3:  # channels last, as stored: (B, H, W, C) -> (B, C, H, W)
            x = x.reshape(-1, *self.image).permute(0, 3, 1, 2)
        else:
            x = x.reshape(-1, 1, *self.image)
        return self.head(self.features(x))


def build_mlp(cfg: Any, inputs: DataSchema, seed: int | None = None) -> MLP:
    """`seed`: the initial weights Keras' MLP starts from with that seed (`portable_init`)."""
    return MLP(list(cfg.hidden), cfg.dropout, inputs.features.width, inputs.target.outputs, init_seed=seed)


def build_cnn(cfg: Any, inputs: DataSchema, seed: int | None = None) -> CNN:
    """Draws its weights from torch's global generator (seeded by the caller)."""
    return CNN(list(cfg.channels), cfg.hidden, cfg.dropout, inputs.target.outputs, inputs.features.shape)
