from __future__ import annotations

import torch
from omegaconf import OmegaConf

from trainers.models import build_model


def test_mlp_and_cnn_accept_flat_or_image_batches():
    for spec in ({"name": "mlp", "hidden": [32], "dropout": 0.0},
                 {"name": "cnn", "channels": [4, 8], "hidden": 16, "dropout": 0.0}):
        model = build_model(OmegaConf.create(spec))
        flat = torch.randn(3, 784)
        out_flat, out_img = model(flat), model(flat.reshape(3, 1, 28, 28))
        assert out_flat.shape == (3, 10)
        torch.testing.assert_close(out_flat, out_img)


def test_embed_pool_ignores_padding_and_averages_real_tokens():
    model = build_model(OmegaConf.create({"name": "embed_pool", "embed_dim": 8, "hidden": 8, "dropout": 0.0}),
                        {"vocab_size": 50, "max_len": 12}).eval()
    ids = torch.tensor([[5, 6, 7, 0, 0, 0], [9, 0, 0, 0, 0, 0]])
    mask = ids != 0
    garbage = ids.clone()
    garbage[~mask] = 11  # what sits in padded positions must not matter
    torch.testing.assert_close(model(garbage, mask), model(ids, mask))
    # The pooled vector is the plain mean of the real tokens' embeddings.
    expected = model.head(model.embed(torch.tensor([5, 6, 7])).mean(dim=0, keepdim=True))
    torch.testing.assert_close(model(ids[:1], mask[:1]), expected)
