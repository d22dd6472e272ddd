"""Facts about the prepared datasets that training code needs (the preparation itself is pipelines/data/)."""
from __future__ import annotations

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # the usual MNIST train-set statistics; workers normalise with them
PAD_ID = 0  # IMDb token shards: [PAD] is id 0, so a row's real tokens are its first `length` ids
