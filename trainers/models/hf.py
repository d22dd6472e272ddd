"""Hugging Face Transformers models (`model=hf`): a model from a local folder written by `save_pretrained`, as a
plain classifier of the shared loop (token ids and a mask in, logits out), with the parallel plans the model itself
carries (its `base_model_tp_plan`, its `_no_split_modules`), and written back out as a Transformers folder.

Never a download: the folder is read with `local_files_only`, and the hub is offline wherever Transformers is used
here (`offline_transformers`)."""
from __future__ import annotations

import fnmatch
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from contract.data import PAD_ID, DataSchema
from trainers.models.hf_config import offline_transformers
from trainers.models.text import trailing_padding_mask
from trainers.torch.parallel.plans import styles_plan

# Transformers' tensor-parallel style names (a model's `base_model_tp_plan`) as torch `ParallelStyle`s.
TP_STYLES = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),  # vocab-parallel embedding
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                   "tokenizer.model", "merges.txt", "vocab.json")


class HFClassifier(nn.Module):
    """A Transformers `...ForSequenceClassification` model as the loop calls a model: (ids [B, T], mask [B, T]) ->
    logits [B, classes] (or [B, 1] for regression). `source`: the folder it was built from."""

    def __init__(self, hf: nn.Module, source: str):
        super().__init__()
        self.hf = hf
        self.source = source

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = trailing_padding_mask(input_ids)
        return self.hf(input_ids=input_ids, attention_mask=attention_mask).logits


def build_hf(cfg: Any, inputs: DataSchema, seed: int | None = None) -> HFClassifier:
    """The folder's model with a classification head sized from the data (its own weights unless
    `model.from_scratch`; the head, when new or of another size, from torch's global generator, seeded by the
    caller), in torch's default dtype whatever the folder holds (float32: the loop's precision is autocast's), its
    classes named in `id2label`. Rows are padded with id 0, so id 0 is the model's `pad_token_id` (a decoder pools
    the last token that is not one)."""
    transformers = offline_transformers()

    classes = list(inputs.target.classes) if inputs.target.task == "classification" else ["value"]
    labels = {"num_labels": len(classes), "id2label": dict(enumerate(classes)),
              "label2id": {name: i for i, name in enumerate(classes)}, "pad_token_id": PAD_ID,
              "problem_type": "single_label_classification" if len(classes) > 1 else "regression"}
    if cfg.from_scratch or torch.get_default_device().type == "meta":  # meta: counting FLOPs, no weights to read
        config = transformers.AutoConfig.from_pretrained(cfg.path, local_files_only=True, **labels)
        hf = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.get_default_dtype())
    else:
        hf, loading = transformers.AutoModelForSequenceClassification.from_pretrained(
            cfg.path, local_files_only=True, dtype=torch.get_default_dtype(), ignore_mismatched_sizes=True,
            output_loading_info=True, **labels)
        report_loading(cfg.path, loading)
    return HFClassifier(hf, str(Path(cfg.path).resolve()))


def report_loading(folder: str, loading: dict[str, Any]) -> None:
    """One line on stderr naming the weights drawn anew (absent from the folder, or of another shape there: the new
    head) and how many of the folder's were left out (another head's)."""
    new = sorted(set(loading["missing_keys"]) | {str(key[0] if isinstance(key, tuple) else key)
                                                  for key in loading["mismatched_keys"]})
    unused = len(loading["unexpected_keys"])
    if new or unused:
        print(f"model.path={folder}: drawn anew: {', '.join(new) or 'nothing'}"
              + (f"; {unused} of its weights unused" if unused else ""), file=sys.stderr)


class _Unmasked(nn.Module):
    """The model called without a mask: every position a real token, as the FLOP count assumes."""

    def __init__(self, model: HFClassifier):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.hf(input_ids=input_ids).logits


def flops_per_sample(cfg: Any, inputs: DataSchema) -> float:
    """Training FLOPs of one sample, counted on the meta device as for any model (trainers/torch/flop_counter.py),
    without a mask: Transformers reads a mask's values to build its attention mask, which meta tensors lack."""
    from trainers.torch.flop_counter import training_flops_per_sample

    return training_flops_per_sample(lambda: _Unmasked(build_hf(cfg, inputs)), inputs)


def tp_plan(model: HFClassifier) -> dict[str, str]:
    """The model's tensor-parallel plan by module-name pattern (the architecture's `base_model_tp_plan` under its
    base model's prefix, and its own additions), named from our wrapper."""
    hf = model.hf
    plan = dict(getattr(hf, "tp_plan", None) or getattr(hf, "_tp_plan", None) or {})
    if not plan and hf.config.base_model_tp_plan:
        plan = {f"{hf.base_model_prefix}.{key}": style for key, style in hf.config.base_model_tp_plan.items()}
    return {f"hf.{key}": style for key, style in plan.items()}


def parallelize_hf(model: HFClassifier, mesh: DeviceMesh, impl: str = "dtensor") -> HFClassifier:
    """Shard `model` over mesh["tp"] by its own plan (torch's `parallelize_module`: the "dtensor" implementation);
    the classification head stays replicated. A pipeline stage (trainers/models/hf_pipeline.py) takes the plan's
    entries for the modules it holds."""
    names = [name for name, _ in model.named_modules()]
    plan = {pattern: style for pattern, style in tp_plan(model).items() if fnmatch.filter(names, pattern)}
    if not plan:
        raise ValueError(f"{type(model.hf).__name__} has no tensor-parallel plan (base_model_tp_plan)")
    styles: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        if style not in TP_STYLES:
            raise ValueError(f"{type(model.hf).__name__}: tensor-parallel style '{style}' of '{pattern}' is not "
                             f"supported (supported: {', '.join(TP_STYLES)})")
        styles[pattern] = TP_STYLES[style]()
    return styles_plan(styles)(model, mesh, impl)


def fsdp_blocks(model: HFClassifier) -> tuple[type, ...]:
    """The module classes the model names as never to be split (`_no_split_modules`: its layers, its embeddings):
    FSDP shards each of them as one unit."""
    names = set(model.hf._no_split_modules or ())
    return tuple({type(module) for module in model.modules() if type(module).__name__ in names})


def export_hf(model: HFClassifier, out: Path, tokenizer_json: str | None) -> None:
    """Write `model` (trained, dense, on the CPU) into `out` as a Transformers folder: `config.json` (the classes
    in `id2label`), `model.safetensors`, and the tokenizer the training data was made with (`tokenizer_json`; the
    source folder's own tokenizer when it is that one), padding with id 0's token as the data does; loadable with
    `from_pretrained` alone."""
    out.mkdir(parents=True, exist_ok=True)
    model.hf.save_pretrained(out)
    tokenizer = _data_tokenizer(Path(model.source), tokenizer_json)
    if tokenizer is not None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(PAD_ID)
        tokenizer.save_pretrained(out)


def _data_tokenizer(source: Path, tokenizer_json: str | None) -> Any:
    """The Transformers tokenizer of the training data: the source folder's (its class and settings kept) when its
    tokenizer.json is the data's, or with none given; else the data's JSON (`_fast_tokenizer`); None if neither."""
    if tokenizer_json is None or _same_tokenizer(source / "tokenizer.json", tokenizer_json):
        has_own = any((source / name).is_file() for name in TOKENIZER_FILES)
        return offline_transformers().AutoTokenizer.from_pretrained(source, local_files_only=True) if has_own else None
    return _fast_tokenizer(tokenizer_json, source)


def _same_tokenizer(path: Path, tokenizer_json: str) -> bool:
    from tokenizers import Tokenizer

    return path.is_file() and Tokenizer.from_file(str(path)).to_str() == Tokenizer.from_str(tokenizer_json).to_str()


def _fast_tokenizer(tokenizer_json: str, source: Path) -> Any:
    """The training data's tokenizer as Transformers loads it: its special tokens the source folder's
    (`tokenizer_config.json`), or BERT's names where the vocabulary has them."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    config_path = source / "tokenizer_config.json"
    named = json.loads(config_path.read_text()) if config_path.is_file() else {}
    special = {key: value for key, value in named.items() if key.endswith("_token") and isinstance(value, str)}
    for key, token in (("unk_token", "[UNK]"), ("cls_token", "[CLS]"), ("sep_token", "[SEP]"),
                       ("mask_token", "[MASK]")):
        if key not in special and tokenizer.token_to_id(token) is not None:
            special[key] = token
    return offline_transformers().PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special)
