"""Transformers as this project uses it (the hub offline), and what the config checks ask of an architecture without
building a model: its tensor-parallel plan. Transformers (and torch with it) is imported only when called."""
from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType


def offline_transformers() -> ModuleType:
    """The `transformers` module with the hub offline: `HF_HUB_OFFLINE=1` (unless set), which huggingface_hub reads
    when first imported, so that nothing is ever downloaded; and quiet: no progress bars, no loading report (a table
    per process; `build_hf` says in one line what it drew anew)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    return transformers


def tp_plan_of(folder: Path) -> dict[str, str]:
    """The `base_model_tp_plan` of the architecture the folder's config.json names ({} where it has none)."""
    config = offline_transformers().AutoConfig.from_pretrained(folder, local_files_only=True)
    return dict(config.base_model_tp_plan or {})
