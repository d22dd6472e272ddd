"""`data.bucket_by_length`: batches of rows of similar length (contract.data.bucketed_order), the same order in
PyTorch and TensorFlow, and a text batch cut to its longest row giving the model's outputs unchanged."""
from __future__ import annotations

import numpy as np
import torch

from pipelines.data.imdb import imdb_schema
from contract.data import BUCKET_BATCHES, bucketed_order, shuffled_order
from tests.support.loop_harness import imdb_columns

BATCH = 8


def _runs_and_batches(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lengths = np.random.default_rng(7).integers(1, 513, size=rows)
    order = shuffled_order(rows, seed)
    return lengths, order, bucketed_order(order, lengths, BATCH, seed)


def test_each_batch_holds_neighbours_in_length_from_one_run_of_the_shuffle():
    rows = 2 * BATCH * BUCKET_BATCHES + 203  # two full runs, then 203 rows: 25 batches and a short one of 3
    lengths, order, bucketed = _runs_and_batches(rows, seed=3)
    np.testing.assert_array_equal(np.sort(bucketed), np.arange(rows))  # a permutation: every row once
    run_of = np.empty(rows, dtype=np.int64)
    run_of[order] = np.arange(rows) // (BATCH * BUCKET_BATCHES)  # which run of the plain shuffle a row is in
    full = rows // BATCH
    batches = bucketed[:full * BATCH].reshape(full, BATCH)
    assert all(len(set(run_of[batch])) == 1 for batch in batches)
    for run in range(3):  # within a run, batches do not overlap in length: the run was sorted, then cut
        spans = sorted((lengths[b].min(), lengths[b].max()) for b in batches if run_of[b[0]] == run)
        assert all(high <= next_low for (_, high), (next_low, _) in zip(spans, spans[1:]))
    last_run = order[2 * BATCH * BUCKET_BATCHES:]
    np.testing.assert_array_equal(np.sort(lengths[bucketed[full * BATCH:]]), np.sort(lengths[last_run])[-3:])
    assert list(run_of[batches[:, 0]]) != sorted(run_of[batches[:, 0]])  # batches are shuffled across runs
    plain_padded = sum(lengths[order[i:i + BATCH]].max() for i in range(0, full * BATCH, BATCH))
    assert sum(lengths[b].max() for b in batches) < 0.7 * plain_padded  # the point: less padding to compute


def test_the_order_depends_on_the_seed_only():
    _, _, first = _runs_and_batches(1000, seed=5)
    np.testing.assert_array_equal(first, _runs_and_batches(1000, seed=5)[2])
    assert not np.array_equal(first, _runs_and_batches(1000, seed=6)[2])


def test_pytorch_and_tensorflow_batch_the_same_rows():
    from trainers.tf.data import ShardArrays
    from trainers.torch.data import ShardBatches

    columns = imdb_columns(200, vocab=50, max_len=32)
    columns["input_ids"][:, 1] = 1000 + np.arange(200)  # each row names itself in its second token
    torch_batches = ShardBatches.from_columns({k: torch.from_numpy(v) for k, v in columns.items()},
                                              imdb_schema(50, 32), BATCH, seed=11, bucket_by_length=True, trim=True)
    arrays = ShardArrays.from_columns(columns, imdb_schema(50, 32))
    arrays.bucket_rows = BATCH  # what the Keras and DTensor adapters set under data.bucket_by_length
    for epoch in range(2):
        rows = torch.cat([inputs[0][:, 1] - 1000 for inputs, _, _ in torch_batches.epoch(epoch)])
        np.testing.assert_array_equal(rows.numpy(), arrays.order(11 + epoch))
        assert not np.array_equal(rows.numpy(), shuffled_order(200, 11 + epoch))  # grouped, not the plain shuffle


def test_a_batch_cut_to_its_longest_row_gives_the_same_logits():
    from trainers.models.bert import BertClassifier, bert_config
    from trainers.torch.data import ShardBatches

    columns = {k: torch.from_numpy(v) for k, v in imdb_columns(6, vocab=50, max_len=32).items()}
    columns["length"][:] = torch.tensor([3, 7, 10, 5, 9, 4])
    columns["input_ids"][torch.arange(32)[None, :] >= columns["length"][:, None]] = 0
    cut = ShardBatches.from_columns(columns, imdb_schema(50, 32), 6, seed=0, trim=True)
    padded = ShardBatches.from_columns(columns, imdb_schema(50, 32), 6, seed=0)
    (cut_inputs, labels, tokens), = cut.epoch(0, shuffle=False)
    (padded_inputs, padded_labels, padded_tokens), = padded.epoch(0, shuffle=False)
    assert cut_inputs[0].shape == (6, 10) and padded_inputs[0].shape == (6, 32)
    assert torch.equal(labels, padded_labels) and tokens == padded_tokens == 38
    torch.manual_seed(0)
    model = BertClassifier(bert_config("tiny", vocab_size=50, max_len=32, hidden=16, heads=2)).double().eval()
    torch.testing.assert_close(model(*cut_inputs), model(*padded_inputs), rtol=1e-12, atol=1e-12)
