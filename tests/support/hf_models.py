"""Tiny random Hugging Face Transformers models written to a folder with `save_pretrained`, as a user's pretrained
checkpoint is: a BERT encoder and a Llama decoder (an architecture with a tensor-parallel plan), dropout off."""
from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SIZES = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 2, "max_position_embeddings": 32}


def save_tiny(architecture: str, folder: Path, seed: int = 0, tokenizer_words: list[str] | None = None) -> Path:
    """A base model (no classification head: fine-tuning adds one) of `architecture` (bert | llama) in `folder`;
    with `tokenizer_words`, a WordPiece tokenizer over them beside it (tokenizer.json, tokenizer_config.json)."""
    import torch
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    if architecture == "bert":
        model = BertModel(BertConfig(**SIZES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    else:
        model = LlamaModel(LlamaConfig(**SIZES, num_key_value_heads=2))
    model.save_pretrained(folder)
    if tokenizer_words is not None:
        save_tokenizer(tokenizer_words, folder)
    return folder


def save_tokenizer(words: list[str], folder: Path) -> None:
    """The BERT-style WordPiece tokenizer `rtp prepare` trains, over `words`, as Transformers saves one."""
    from transformers import PreTrainedTokenizerFast

    from pipelines.data.tokenize import wordpiece_tokenizer

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=wordpiece_tokenizer(words), pad_token="[PAD]",
                                        unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    tokenizer.save_pretrained(folder)
