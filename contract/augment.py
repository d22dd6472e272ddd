"""Randomness for augmenting training batches that is reproducible and resumes exactly: every sample gets a key, a
function of the run's seed, the epoch and the sample's position in its epoch (`sample_keys`), and draws its random
numbers from that key alone (`uniform`). The same seed gives the same augmented batches run after run, and a run
resumed inside an epoch augments its remaining samples as the uninterrupted run would have, however the batches
around them were made. Framework-free (numpy).

An augmentation is a model spec's `augment(columns, keys, schema) -> columns` (contract/registry.py `ModelSpec`),
applied to training batches when `data.augment=true`: `columns` the batch's stored columns as numpy arrays (features
[B, width] in the dtype workers hold, contract/data.py FEATURE_DTYPES), `keys` [B] uint64, `schema` the data's
`DataSchema`; it returns the columns with the same shapes and dtypes."""
from __future__ import annotations

from typing import Callable

import numpy as np

from contract.data import DataSchema

Augment = Callable[[dict[str, np.ndarray], np.ndarray, DataSchema], dict[str, np.ndarray]]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: uint64 -> well-spread uint64, elementwise (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = values + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def sample_keys(seed: int, epoch: int, positions: np.ndarray) -> np.ndarray:
    """One key per sample [B] uint64, from the seed, the epoch and each sample's position in the epoch."""
    base = _mix(_mix(np.array([seed], dtype=np.uint64)) ^ np.uint64(epoch))
    return _mix(base ^ np.asarray(positions, dtype=np.uint64))


def uniform(keys: np.ndarray, count: int) -> np.ndarray:
    """[B, count] floats in [0, 1), row i a function of keys[i] alone."""
    with np.errstate(over="ignore"):
        counters = keys[:, None] * np.uint64(count) + np.arange(count, dtype=np.uint64)
    return (_mix(_mix(counters)) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
