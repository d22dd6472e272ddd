"""What the config checks ask of a Transformers architecture, without building a model: its tensor-parallel plan.
Imports Transformers (and torch with it): only a run with tp > 1 of `model=hf` asks."""
from __future__ import annotations

import os
from pathlib import Path


def tp_plan_of(folder: Path) -> dict[str, str]:
    """The `base_model_tp_plan` of the architecture the folder's config.json names ({} where it has none)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig

    return dict(AutoConfig.from_pretrained(folder, local_files_only=True).base_model_tp_plan or {})
