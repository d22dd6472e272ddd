"""Built-in augmentations of training batches (`ModelSpec.augment`, applied with `data.augment=true`;
contract/augment.py says what they are given)."""
from __future__ import annotations

import numpy as np

from contract.augment import uniform
from contract.data import DataSchema

MAX_SHIFT = 2  # pixels an image moves at most, along each axis


def random_shift(columns: dict[str, np.ndarray], keys: np.ndarray, schema: DataSchema) -> dict[str, np.ndarray]:
    """Each image moved by its own whole-pixel shift of at most MAX_SHIFT rows and columns, the pixels it uncovers
    zero (MNIST's background): the CNN's augmentation, as in the classic MNIST recipes."""
    column, shape = schema.features.column, schema.features.shape
    images = columns[column].reshape(len(keys), shape[0], shape[1], -1)  # (B, H, W, C)
    height, width = shape[0], shape[1]
    shifts = np.floor(uniform(keys, 2) * (2 * MAX_SHIFT + 1)).astype(np.int64) - MAX_SHIFT  # (B, 2) in -2..2
    padded = np.pad(images, ((0, 0), (MAX_SHIFT, MAX_SHIFT), (MAX_SHIFT, MAX_SHIFT), (0, 0)))
    rows = (np.arange(height)[None, :] + MAX_SHIFT - shifts[:, :1])[:, :, None]   # (B, H, 1)
    cols = (np.arange(width)[None, :] + MAX_SHIFT - shifts[:, 1:])[:, None, :]    # (B, 1, W)
    moved = padded[np.arange(len(keys))[:, None, None], rows, cols]                # (B, H, W, C)
    return {**columns, column: moved.reshape(columns[column].shape)}
