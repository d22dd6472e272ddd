"""Facts about the prepared datasets that training code needs (the preparation itself is pipelines/data/)."""
from __future__ import annotations

import numpy as np

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # the usual MNIST train-set statistics; workers normalise with them
PAD_ID = 0  # IMDb token shards: [PAD] is id 0, so a row's real tokens are its first `length` ids
FEATURE_COLUMNS = {"mnist": "image", "imdb": "input_ids"}  # the model's input column in each dataset's shards


def model_input(dataset: str, column: np.ndarray) -> np.ndarray:
    """A shard column as a logged model takes it: MNIST images normalised to float32 [N, 784] (what the workers
    feed), IMDb token ids [N, T] as stored ([PAD] marks the padding)."""
    features = np.stack(column) if column.dtype == object else np.asarray(column)  # fixed-size lists, as Ray gives
    if dataset == "mnist":
        return ((features.astype(np.float32) / 255.0 - MNIST_MEAN) / MNIST_STD).astype(np.float32)
    return features


def shuffled_order(rows: int, seed: int) -> np.ndarray:
    """The row order of a shuffled epoch, the same in every framework for one seed (the loss-parity gate)."""
    return np.random.default_rng(seed).permutation(rows)


BUCKET_BATCHES = 50  # batches per run sorted by length (the "megabatch" of HF Trainer's group_by_length)


def bucketed_order(order: np.ndarray, lengths: np.ndarray, batch_size: int, seed: int) -> np.ndarray:
    """`order` (a shuffled epoch) regrouped so each batch of `batch_size` consecutive rows holds rows of similar
    length: each run of BUCKET_BATCHES batches is sorted by length, then the full batches are shuffled (a short
    last batch stays last). A batch cut to its longest row then pads little: IMDb's reviews average 258 of 512
    tokens, and nearly every random batch of 32 holds one of the 12% that fill all 512. Every framework orders a
    shard this way for one seed, as `shuffled_order`."""
    run = batch_size * BUCKET_BATCHES
    rows = np.concatenate([part[np.argsort(lengths[part], kind="stable")]
                           for part in np.split(order, range(run, len(order), run))])
    full = len(rows) // batch_size
    batches = rows[:full * batch_size].reshape(full, batch_size)
    shuffled = batches[np.random.default_rng([seed, 1]).permutation(full)]  # not the generator of `order`
    return np.concatenate([shuffled.ravel(), rows[full * batch_size:]])
