from __future__ import annotations

import torch
from omegaconf import OmegaConf

from pipelines.data.imdb import imdb_schema
from pipelines.data.mnist import mnist_schema
from trainers.models import build_model


def test_mlp_and_cnn_accept_flat_or_image_batches():
    for spec in ({"name": "mlp", "hidden": [32], "dropout": 0.0},
                 {"name": "cnn", "channels": [4, 8], "hidden": 16, "dropout": 0.0}):
        model = build_model(OmegaConf.create(spec), mnist_schema())
        flat = torch.randn(3, 784)
        out_flat, out_img = model(flat), model(flat.reshape(3, 1, 28, 28))
        assert out_flat.shape == (3, 10)
        torch.testing.assert_close(out_flat, out_img)



def test_cnn_pools_before_its_relu_with_the_numbers_of_conv_relu_pool():
    """The CNN's conv-pool-relu order (the faster one) trains exactly like the textbook conv-relu-pool: the same
    logits and the same gradients, bit for bit, in channels-last as trainer=ddp trains it."""
    torch.manual_seed(0)
    model = build_model(OmegaConf.create({"name": "cnn", "channels": [4, 8], "hidden": 16, "dropout": 0.0}),
                        mnist_schema())
    model = model.to(memory_format=torch.channels_last)
    conv1, conv2 = (m for m in model.features if isinstance(m, torch.nn.Conv2d))

    def textbook(x: torch.Tensor) -> torch.Tensor:
        pool = torch.nn.functional.max_pool2d
        x = pool(torch.relu(conv1(x)), 2)
        return model.head(pool(torch.relu(conv2(x)), 2))

    images = torch.randn(16, 1, 28, 28).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 10, (16,))
    results = []
    for forward in (model, textbook):
        model.zero_grad()
        logits = forward(images)
        torch.nn.functional.cross_entropy(logits, labels).backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)

def test_embed_pool_ignores_padding_and_averages_real_tokens():
    model = build_model(OmegaConf.create({"name": "embed_pool", "embed_dim": 8, "hidden": 8, "dropout": 0.0}),
                        imdb_schema(50, 12)).eval()
    ids = torch.tensor([[5, 6, 7, 0, 0, 0], [9, 0, 0, 0, 0, 0]])
    mask = ids != 0
    garbage = ids.clone()
    garbage[~mask] = 11  # what sits in padded positions must not matter
    torch.testing.assert_close(model(garbage, mask), model(ids, mask))
    # The pooled vector is the plain mean of the real tokens' embeddings.
    expected = model.head(model.embed(torch.tensor([5, 6, 7])).mean(dim=0, keepdim=True))
    torch.testing.assert_close(model(ids[:1], mask[:1]), expected)
