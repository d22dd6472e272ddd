"""`trainers.tf.data.EpochStream`: the custom TF loops (tf_mwms custom, horovod tf) read an attempt's epochs
through one iterator, each epoch in its own order. The TF datasets themselves: tests/unit/test_loop_backends.py
(stop/resume and loss parity over two epochs)."""
from __future__ import annotations

from trainers.tf.data import EpochStream

STEPS = 4


class Batches(list):
    """Stands in for a `tf.data.Dataset`: what EpochStream asks of one is `concatenate`."""

    def concatenate(self, other: "Batches") -> "Batches":
        return Batches(self + other)


def epoch_dataset(epoch: int, skip: int = 0) -> Batches:
    return Batches((epoch, step) for step in range(skip, STEPS))


def batches(epochs: EpochStream, epoch: int, skip: int, count: int):
    """The batches of `epochs.turns`, each taken in Python as a custom loop's step takes it."""
    for iterator in epochs.turns(epoch, skip, count):
        yield next(iterator)


def stream(last_epoch: int) -> tuple[EpochStream, list]:
    opened = []

    def open_iterator(make):
        opened.append(make())
        return iter(opened[-1])
    return EpochStream(epoch_dataset, last_epoch, open_iterator), opened


def test_an_attempt_reads_all_its_epochs_through_one_iterator():
    epochs, opened = stream(last_epoch=3)
    for epoch in (1, 2, 3):
        assert list(batches(epochs, epoch, 0, STEPS)) == epoch_dataset(epoch)
    assert opened == [epoch_dataset(1) + epoch_dataset(2) + epoch_dataset(3)]


def test_a_resumed_epoch_starts_after_its_done_steps_and_the_next_ones_follow_on():
    epochs, opened = stream(last_epoch=3)
    assert list(batches(epochs, 2, 3, STEPS - 3)) == [(2, 3)]
    assert list(batches(epochs, 3, 0, STEPS)) == epoch_dataset(3)
    assert opened == [[(2, 3), *epoch_dataset(3)]]


def test_an_epoch_left_unfinished_or_out_of_turn_opens_a_new_iterator():
    epochs, opened = stream(last_epoch=2)
    unfinished = batches(epochs, 1, 0, STEPS)
    assert [next(unfinished), next(unfinished)] == [(1, 0), (1, 1)]  # the loop stopped here
    assert list(batches(epochs, 1, 2, STEPS - 2)) == [(1, 2), (1, 3)]  # its restart
    assert list(batches(epochs, 2, 0, STEPS)) == epoch_dataset(2)
    assert list(batches(epochs, 3, 0, STEPS)) == epoch_dataset(3)  # past last_epoch: on its own
    assert len(opened) == 3 and opened[2] == epoch_dataset(3)
