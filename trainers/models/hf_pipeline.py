"""Pipeline stages of a Transformers decoder (`model=hf` with `trainer.pp`): the architecture's own
`base_model_pp_plan` names its embedding, its layers and its final norm, and a stage holds the embedding (the
first), a run of the layers, or the norm and the classification head (the last).

A stage is the whole model with what other stages hold removed, as for any model here
(trainers/torch/parallel/pipeline.py): the embedding gone, the layers of other stages passing the hidden states
through, the norm an identity and the head gone before the last stage; every weight keeps its dense name. Each
stage runs the base model's own forward (rotary positions and the causal mask built from the padding mask every
stage receives; later stages are given `inputs_embeds`). The last stage pools each row's last real token itself:
Transformers finds it from the token ids (the last one that is not id 0), which only the first stage has; the mask
names the same token unless a row's last real token is itself id 0.

Architectures split here: decoders whose plan is (embedding, layers, norm), whose base model holds no other weights
(GPT-2's position embeddings, added to `inputs_embeds` on every call, rule it out), with Transformers' `score`
head. Others are refused in one line by the config checks.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from trainers.models.hf import HFClassifier
from trainers.torch.parallel.pipeline import stage_blocks


class PassThrough(nn.Module):
    """A decoder layer another stage holds: the hidden states go through unchanged."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


class HFStage(HFClassifier):
    """One pipeline stage: (token ids on the first stage, else the hidden states [B, T, H]; the padding mask
    [B, T]) -> the hidden states, or on the last stage the logits of each row's last real token."""

    def __init__(self, hf: nn.Module, source: str, embedding: str):
        super().__init__(hf, source)
        self.embedding = embedding

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        base = self.hf.base_model
        inputs = {"input_ids": x} if getattr(base, self.embedding) is not None else {"inputs_embeds": x}
        hidden = base(**inputs, attention_mask=attention_mask, use_cache=False).last_hidden_state
        if self.hf.score is None:
            return hidden
        logits = self.hf.score(hidden)
        positions = torch.arange(attention_mask.shape[1], device=logits.device)
        last = (positions * attention_mask.to(positions.dtype)).argmax(-1)
        return logits[torch.arange(len(logits), device=logits.device), last]


def pipeline_parts(hf: nn.Module) -> tuple[str, str, str]:
    """(embedding, layers, final norm): the names the architecture's `base_model_pp_plan` gives them; a ValueError
    naming the architecture where it does not split here."""
    architecture = type(hf).__name__
    plan = list(getattr(hf.config, "base_model_pp_plan", None) or {})
    base = hf.base_model
    if (len(plan) != 3 or not isinstance(getattr(base, plan[1], None), nn.ModuleList)
            or not isinstance(getattr(hf, "score", None), nn.Linear)):
        raise ValueError(f"trainer.pp: {architecture} does not split into pipeline stages here (decoders whose "
                         f"base_model_pp_plan names their embedding, layers and final norm, with a score head, do: "
                         f"Llama, Mistral, Qwen and the like); train it with pp=1")
    others = [name for name, child in base.named_children()
              if name not in plan and any(True for _ in child.parameters())]
    if others:
        raise ValueError(f"trainer.pp: {architecture} has weights outside its pipeline plan ({', '.join(others)}); "
                         f"train it with pp=1")
    return plan[0], plan[1], plan[2]


def split_stage(model: HFClassifier, stage: int, n_stages: int) -> HFStage:
    """The `pipeline_split` of the spec: a copy of `model` holding only `stage`'s parts (dense names kept)."""
    hf = copy.deepcopy(model.hf)
    embedding, layers, norm = pipeline_parts(hf)
    base, blocks = hf.base_model, getattr(hf.base_model, layers)
    owned = stage_blocks(len(blocks), n_stages, stage)
    for i in range(len(blocks)):
        if i not in owned:
            blocks[i] = PassThrough()
    if stage > 0:
        setattr(base, embedding, None)
    if stage < n_stages - 1:
        setattr(base, norm, nn.Identity())
        hf.score = None
    return HFStage(hf, model.source, embedding)
