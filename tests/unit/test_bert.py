"""The plain BERT classifier: shapes, padding, attention scale and head-count inference (float64, CPU)."""
from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from pipelines.data.imdb import imdb_schema
from contract.data import PAD_ID
from trainers.models import build_model
from trainers.models.bert import BERT_FLAVOURS, BertClassifier, BertConfig, SelfAttention, bert_config
from trainers.models.text import EmbedPool

# float64 and tiny sizes: identical math up to summation order gives ~1e-15 differences.
TOL = {"atol": 1e-10, "rtol": 1e-8}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_model(**overrides) -> BertClassifier:
    torch.manual_seed(0)
    cfg = BertConfig(**{"vocab_size": 50, "max_len": 8, "hidden": 32, "layers": 2, "heads": 4, "dropout": 0.0,
                        **overrides})
    return BertClassifier(cfg).double().eval()


def test_logits_shape_and_flavours() -> None:
    model = tiny_model(num_classes=3)
    ids = torch.randint(1, 50, (4, 8))
    assert model(ids).shape == (4, 3)
    assert model(ids[:, :5], torch.ones(4, 5)).shape == (4, 3)  # shorter than max_len is fine
    cfg = bert_config("small", vocab_size=100, max_len=16, dropout=0.0)
    assert (cfg.layers, cfg.hidden, cfg.heads, cfg.dropout) == (4, 256, 4, 0.0)
    assert set(BERT_FLAVOURS) == {"tiny", "small", "base", "large"}
    with pytest.raises(ValueError, match="unknown BERT flavour"):
        bert_config("huge", vocab_size=10, max_len=4)
    with pytest.raises(ValueError, match="hidden=30 is not a multiple of heads=4"):
        BertConfig(vocab_size=10, max_len=4, hidden=30, layers=1, heads=4)
    with pytest.raises(ValueError, match="exceeds max_len"):
        model(torch.ones(1, 9, dtype=torch.long))


def test_tokens_at_masked_positions_do_not_change_logits() -> None:
    model = tiny_model()
    ids = torch.randint(1, 50, (3, 8))
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3, [1] * 2 + [0] * 6])
    other = ids.clone()
    other[mask == 0] = torch.randint(1, 50, (int((mask == 0).sum()),))  # garbage where the mask is 0
    assert not torch.equal(other, ids)
    torch.testing.assert_close(model(other, mask), model(ids, mask), **TOL)
    # An all-padding row must not produce NaN (it may attend anywhere; pooling ignores it).
    assert torch.isfinite(model(ids, torch.zeros_like(mask))).all()


@pytest.mark.parametrize("name", ["bert", "embed_pool"])
def test_without_a_mask_the_pad_ids_are_the_padding(name: str) -> None:
    """What a logged model sees (MLflow passes token ids only): the same logits as training's explicit mask."""
    torch.manual_seed(0)
    model = tiny_model() if name == "bert" else EmbedPool(50, 16, 16, 0.0).double().eval()
    lengths = torch.tensor([8, 5, 2])
    mask = torch.arange(8) < lengths[:, None]
    ids = torch.randint(1, 50, (3, 8)).masked_fill(~mask, PAD_ID)
    torch.testing.assert_close(model(ids), model(ids, mask), **TOL)
    assert not torch.allclose(model(ids), model(ids, torch.ones_like(mask)))  # the padding does matter


def test_attention_scales_by_sqrt_head_dim() -> None:
    torch.manual_seed(0)
    attn = SelfAttention(32, 4).double()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    key_mask = torch.tensor([[True] * 5, [True, True, True, False, False]])

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(2, 5, 4, 8).transpose(1, 2)  # (B, nh, T, hd)

    q, k, v = heads(attn.q_proj(x)), heads(attn.k_proj(x)), heads(attn.v_proj(x))
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)  # head_dim = 32 / 4 = 8, not sqrt(hidden)
    scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    expected = attn.out_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 5, 32))
    torch.testing.assert_close(attn(x, key_mask), expected, **TOL)


def _half_heads(attn: SelfAttention, half: int) -> SelfAttention:
    """A copy holding only heads [2*half, 2*half+2) of 4: what TP rank `half` of 2 holds."""
    part = SelfAttention(32, 4).double()
    rows = slice(16 * half, 16 * (half + 1))
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            sliced = nn.Linear(32, 16).double()
            sliced.weight.copy_(getattr(attn, name).weight[rows])
            sliced.bias.copy_(getattr(attn, name).bias[rows])
            setattr(part, name, sliced)
        part.out_proj = nn.Linear(16, 32, bias=False).double()
        part.out_proj.weight.copy_(attn.out_proj.weight[:, rows])
    return part


def test_attention_infers_local_head_count_from_shapes() -> None:
    torch.manual_seed(0)
    attn = SelfAttention(32, 4).double()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    key_mask = torch.ones(2, 5, dtype=torch.bool)
    halves = [_half_heads(attn, h)(x, key_mask) for h in (0, 1)]  # each runs 2 heads of width 8
    assert halves[0].shape == (2, 5, 32)
    # Heads are independent, so the two halves plus the bias rebuild the full output (the TP identity).
    torch.testing.assert_close(halves[0] + halves[1] + attn.out_proj.bias, attn(x, key_mask), **TOL)


def test_attention_dropout_is_its_own_setting() -> None:
    """`dropout` acts on embeddings, the residual stream and the MLP; `attention_dropout` on attention alone."""
    cfg = bert_config("tiny", vocab_size=50, max_len=8, dropout=0.0, attention_dropout=0.5)
    model = BertClassifier(cfg).train()
    assert [block.attn.dropout for block in model.blocks] == [0.5, 0.5]
    ids = torch.randint(1, 50, (4, 8))
    assert not torch.equal(model(ids), model(ids))  # only attention drops anything here
    model.eval()
    assert torch.equal(model(ids), model(ids))
    plain = BertClassifier(bert_config("tiny", vocab_size=50, max_len=8, dropout=0.1)).train()
    assert [block.attn.dropout for block in plain.blocks] == [0.0, 0.0]
    assert plain.emb_drop.p == 0.1 and plain.blocks[0].mlp.drop.p == 0.1
    # The config key reaches the model (`build_model`, what every torch backend builds from).
    spec = {"name": "bert", "flavour": "tiny", "dropout": 0.1, "attention_dropout": 0.3,
            "hidden": None, "layers": None, "heads": None}
    built = build_model(OmegaConf.create(spec), imdb_schema(50, 8))
    assert [block.attn.dropout for block in built.blocks] == [0.3, 0.3] and built.emb_drop.p == 0.1
