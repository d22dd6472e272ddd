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
