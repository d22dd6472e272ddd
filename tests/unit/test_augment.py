"""Augmentation of training batches (`data.augment`, contract/augment.py): per-sample keys of the seed, the epoch and
the sample's position; the CNN's random shifts against a per-image reference; and the batches of every input path
(PyTorch held and streamed, TensorFlow held and streamed) augmented reproducibly, a resumed epoch's as the
uninterrupted one's, and streamed ones alike at any number of ranks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from contract.augment import sample_keys, uniform
from contract.stream_order import StreamOrder
from pipelines.data.mnist import mnist_schema
from tests.support.loop_harness import mnist_columns
from trainers.models.augment import MAX_SHIFT, random_shift
from tests.support.streamed import in_process
from trainers.streamed import Augmenting, SplitFiles, StreamedRows
from trainers.torch.data import ShardBatches, StreamedBatches

FILE_ROWS = [40, 25, 60, 35]  # 160 rows


def test_keys_are_a_function_of_seed_epoch_and_position_and_draw_uniform_numbers():
    keys = sample_keys(3, 1, np.arange(100_000))
    assert keys.dtype == np.uint64 and len(np.unique(keys)) == len(keys)
    np.testing.assert_array_equal(sample_keys(3, 1, np.arange(50, 60)), keys[50:60])
    assert not np.intersect1d(sample_keys(3, 2, np.arange(1000)), keys[:1000]).size  # another epoch
    assert not np.intersect1d(sample_keys(4, 1, np.arange(1000)), keys[:1000]).size  # another seed
    draws = uniform(keys, 3)
    assert draws.shape == (100_000, 3) and draws.min() >= 0 and draws.max() < 1
    assert abs(draws.mean() - 0.5) < 0.01 and abs(np.corrcoef(draws[:, 0], draws[:, 1])[0, 1]) < 0.02
    np.testing.assert_array_equal(uniform(keys[7:8], 3)[0], draws[7])  # a row's numbers depend on its key alone


@pytest.mark.parametrize("shape", [(28, 28), (6, 5, 3)])
def test_random_shift_moves_each_image_by_its_own_shift_filling_zeros(shape):
    from contract.data import DataSchema, Features, Target

    schema = DataSchema("x", Features("image", "image", shape), Target("label", "classification", ("0", "1")))
    rng = np.random.default_rng(0)
    images = rng.integers(1, 256, size=(400, int(np.prod(shape)))).astype(np.uint8)
    keys = sample_keys(0, 0, np.arange(400))
    moved = random_shift({"image": images, "label": np.zeros(400)}, keys, schema)["image"]
    assert moved.dtype == np.uint8 and moved.shape == images.shape
    shifts = np.floor(uniform(keys, 2) * (2 * MAX_SHIFT + 1)).astype(int) - MAX_SHIFT
    assert {tuple(s) for s in shifts} == {(dy, dx) for dy in range(-2, 3) for dx in range(-2, 3)}
    for image, out, (dy, dx) in zip(images, moved, shifts):  # the reference: roll, then clear what wrapped round
        want = np.roll(image.reshape(shape[0], shape[1], -1), (dy, dx), axis=(0, 1))
        if dy > 0:
            want[:dy] = 0
        elif dy < 0:
            want[dy:] = 0
        if dx > 0:
            want[:, :dx] = 0
        elif dx < 0:
            want[:, dx:] = 0
        np.testing.assert_array_equal(out.reshape(want.shape), want)


def _count(batch) -> int:
    return len(batch[1])


def test_held_batches_are_augmented_per_epoch_and_a_resumed_epoch_alike():
    schema, columns = mnist_schema(), mnist_columns(200)
    held = {c: torch.from_numpy(v) for c, v in columns.items()}
    plain = ShardBatches.from_columns(held, schema, 32, seed=5)
    shifted = ShardBatches.from_columns(held, schema, 32, seed=5, augment=random_shift)
    for epoch in (0, 1):
        batches, reference = list(shifted.epoch(epoch)), list(plain.epoch(epoch))
        start = 0
        for (inputs, labels, _), (plain_inputs, plain_labels, _) in zip(batches, reference):
            torch.testing.assert_close(labels, plain_labels)
            raw = ((plain_inputs[0] * schema.features.std[0] + schema.features.mean[0]) * 255).round().to(torch.uint8)
            keys = sample_keys(5, epoch, np.arange(start, start + len(labels)))
            expected = random_shift({"image": raw.numpy(), "label": labels.numpy()}, keys, schema)["image"]
            want = (torch.from_numpy(expected).float() / 255 - schema.features.mean[0]) / schema.features.std[0]
            torch.testing.assert_close(inputs[0], want)
            start += len(labels)
        for (inputs, _, _), (again, _, _) in zip(batches[3:], shifted.epoch(epoch, skip=3)):
            torch.testing.assert_close(inputs[0], again[0], rtol=0, atol=0)
    assert not torch.equal(next(iter(shifted.epoch(0)))[0][0], next(iter(shifted.epoch(1)))[0][0])
    (evaluated, _, _), (plain_eval, _, _) = next(iter(shifted.epoch(0, shuffle=False))), \
        next(iter(plain.epoch(0, shuffle=False)))
    torch.testing.assert_close(evaluated[0], plain_eval[0], rtol=0, atol=0)  # evaluation is not augmented


def _streamed(dp: int, rank: int, columns: dict[str, np.ndarray], augment: bool = True) -> StreamedBatches:
    starts = np.cumsum([0, *FILE_ROWS])
    paths = [f"f{i}" for i in range(len(FILE_ROWS))]
    held = {p: {c: v[starts[i]:starts[i + 1]] for c, v in columns.items()} for i, p in enumerate(paths)}

    def read(names: list[str], wanted: list[str]):
        for name in names:
            yield {c: held[name][c] for c in wanted}
    rows = StreamedRows(SplitFiles(paths, FILE_ROWS), ["image", "label"], StreamOrder(FILE_ROWS, 50, 9), 16 // dp,
                        dp, rank, read=in_process(read), stored=mnist_schema().stored_columns,
                        augment=Augmenting.of(random_shift, mnist_schema()) if augment else None)
    return StreamedBatches(rows, mnist_schema())


def test_streamed_batches_are_augmented_alike_at_any_rank_count_and_on_resume():
    columns = mnist_columns(160, seed=1)

    def global_batches(dp: int, skip: int = 0, augment: bool = True) -> list[torch.Tensor]:
        ranks = [list(_streamed(dp, rank, columns, augment).epoch(2, skip=skip)) for rank in range(dp)]
        return [torch.cat([r[step][0][0] for r in ranks]) for step in range(len(ranks[0]))]

    one = global_batches(1)
    assert len(one) == 10
    for mine, theirs in zip(global_batches(2), one):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    for mine, theirs in zip(global_batches(2, skip=4), one[4:]):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    # The reference: each step's rows (found by streaming their indices in place of the images), shifted by the
    # keys of their positions in the epoch.
    indices = {**columns, "image": np.repeat(np.arange(160, dtype=np.uint8)[:, None], 784, axis=1)}
    which = [step["image"][:, 0] for step in _streamed(1, 0, indices, augment=False).rows.epoch(2)]
    for step, (got, rows) in enumerate(zip(_streamed(1, 0, columns).rows.epoch(2), which)):
        positions = np.arange(step * 16, step * 16 + len(rows))
        want = random_shift({"image": columns["image"][rows], "label": columns["label"][rows]},
                            sample_keys(9, 2, positions), mnist_schema())
        np.testing.assert_array_equal(got["label"], columns["label"][rows])
        np.testing.assert_array_equal(got["image"], want["image"])
        assert not np.array_equal(got["image"], columns["image"][rows])  # the shifts changed the images


def test_tensorflow_batches_are_the_same_augmentation_of_the_same_rows():
    import tensorflow as tf

    from trainers.tf.data import ShardArrays

    schema, columns = mnist_schema(), mnist_columns(200, seed=2)
    arrays = ShardArrays.from_columns(columns, schema)
    arrays.augment = random_shift
    order = arrays.order(11 + 1)
    got = [(x.numpy(), y.numpy()) for x, y in arrays.dataset(tf, 32, seed=11, epoch=1, steps=6, skip=2)]
    assert len(got) == 4
    for index, (features, labels) in enumerate(got, start=2):
        rows = order[index * 32:(index + 1) * 32]
        keys = sample_keys(11, 1, np.arange(index * 32, (index + 1) * 32))
        raw = random_shift({"image": columns["image"][rows], "label": columns["label"][rows]}, keys, schema)
        np.testing.assert_array_equal(labels, columns["label"][rows])
        np.testing.assert_allclose(features, (raw["image"].astype(np.float32) / 255 - schema.features.mean[0])
                                   / schema.features.std[0], rtol=1e-6)
