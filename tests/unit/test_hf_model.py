"""`model=hf` before anything starts: a folder that is not a saved Transformers model, a layout its architecture
cannot take, data outside its vocabulary or positions, each one line naming the key; the logged model's padding
mask; and the exported tokenizer, read back by Transformers, giving the training data's ids."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipelines.config import ConfigError
from pipelines.data.imdb import imdb_schema
from tests.support.hf_models import save_tiny
from tests.support.loop_harness import config
from tests.unit.test_cli import rtp


def load_config(overrides: list[str]):
    """The validated config of `overrides` on token data not known yet (as `rtp config` checks before any data)."""
    import tempfile

    return config(Path(tempfile.mkdtemp()), ["data=imdb", *overrides])


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Path:
    return save_tiny("bert", tmp_path_factory.mktemp("hf") / "bert", tokenizer_words=["good", "bad", "movie"])


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("hf") / "llama")


def _check(folder: Path, *overrides: str, inputs=imdb_schema(64, 32)) -> None:
    """The model spec's check of `model=hf` at `folder` once the data (`inputs`) is known, as a run does it."""
    from trainers.models.specs import check_hf

    cfg = load_config(["model=hf", f"model.path={folder}", *overrides])
    check_hf(cfg.model, inputs, cfg.trainer)


def test_a_folder_that_is_no_saved_model_is_one_line(tmp_path: Path, bert: Path) -> None:
    with pytest.raises(ConfigError, match=r"^model\.path: name the folder"):
        load_config(["model=hf"])
    with pytest.raises(ValueError, match=rf"^model\.path: {tmp_path / 'absent'} has no config\.json \(a folder "
                                         r"written by save_pretrained; models are never downloaded\)$"):
        _check(tmp_path / "absent")
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text((bert / "config.json").read_text())
    with pytest.raises(ValueError, match=r"^model\.path: \S+ has no weights \(model\.safetensors\); "
                                         r"model\.from_scratch=true"):
        _check(config_only)
    _check(config_only, "model.from_scratch=true")
    with pytest.raises(ConfigError, match=r"^model\.task: 'causal_lm' is not trained here"):
        load_config(["model=hf", f"model.path={bert}", "model.task=causal_lm"])


def test_tp_takes_an_architecture_with_a_plan_whose_heads_it_divides(bert: Path, llama: Path) -> None:
    with pytest.raises(ValueError, match=r"^trainer\.tp: BertModel has no tensor-parallel plan in Transformers "
                                         r"\(base_model_tp_plan\); train it with tp=1"):
        _check(bert, "trainer=tp", "trainer.tp=2")
    _check(llama, "trainer=tp", "trainer.tp=2")
    with pytest.raises(ValueError, match=r"^trainer\.tp: tp=4 does not divide the model's num_attention_heads=2"):
        _check(llama, "trainer=tp", "trainer.tp=4", "trainer.num_workers=4")


def test_pipeline_stages_take_a_decoder_whose_layers_split_evenly(bert: Path, llama: Path) -> None:
    pipeline = ["trainer=fsdp", "trainer.num_workers=2", "trainer.pp=2", "trainer.batch_size=8"]
    _check(llama, *pipeline)
    with pytest.raises(ValueError, match=r"^trainer\.pp: BertForSequenceClassification does not split into pipeline "
                                         r"stages here \(decoders whose base_model_pp_plan names"):
        _check(bert, *pipeline)
    with pytest.raises(ValueError, match=r"^trainer\.pp: 2 layers do not split into 4 equal pipeline stages "
                                         r"\(pp=2, schedule interleaved_1f1b\)$"):
        _check(llama, *pipeline, "trainer.pp_schedule=interleaved_1f1b")


def test_a_decoders_pipeline_stages_in_a_row_give_its_logits(llama: Path) -> None:
    """Stage 0 (the embedding, layer 0) then stage 1 (layer 1, the norm, the head, pooling by the mask): the
    whole model's logits (Transformers pools by the ids), each weight held by one stage under its dense name."""
    from trainers.models import build_model
    from trainers.models.hf_pipeline import split_stage

    model = build_model(load_config(["model=hf", f"model.path={llama}"]).model, imdb_schema(64, 16)).eval()
    first, last = (split_stage(model, stage, 2) for stage in (0, 1))
    names = [set(dict(part.named_parameters())) for part in (first, last)]
    assert not names[0] & names[1] and names[0] | names[1] == set(dict(model.named_parameters()))
    ids = torch.randint(1, 64, (4, 16))
    mask = torch.arange(16) < torch.tensor([[16], [9], [3], [12]])
    ids[~mask] = 0
    with torch.no_grad():
        torch.testing.assert_close(last(first(ids, mask), mask), model(ids, mask), rtol=1e-6, atol=1e-6)


def test_a_regression_table_gets_a_head_of_one_value(llama: Path) -> None:
    """A table prepared with `--task regression`: one output per row, Transformers' regression problem type."""
    from dataclasses import replace

    from contract.data import Target
    from trainers.models import build_model

    schema = replace(imdb_schema(64, 16), target=Target("label", "regression", ()))
    model = build_model(load_config(["model=hf", f"model.path={llama}"]).model, schema)
    ids = torch.randint(1, 64, (3, 16))
    assert model(ids, torch.ones(3, 16, dtype=torch.bool)).shape == (3, 1)
    assert model.hf.config.problem_type == "regression" and model.hf.config.id2label == {0: "value"}


def test_the_data_must_fit_the_models_vocabulary_and_positions(bert: Path) -> None:
    _check(bert, inputs=imdb_schema(64, 32))
    with pytest.raises(ValueError, match=r"^model\.path: the data's token ids go up to 99; the model's vocabulary "
                                         r"has 64 \(prepare the data with the model's tokenizer"):
        _check(bert, inputs=imdb_schema(100, 32))
    with pytest.raises(ValueError, match=r"^model\.path: the data's rows are 48 tokens; the model takes at most "
                                         r"32 \(prepare it with --max-len 32\)"):
        _check(bert, inputs=imdb_schema(64, 48))


def test_without_transformers_model_hf_is_one_line_naming_the_extra(tmp_path: Path, bert: Path) -> None:
    out = rtp(["config", "data=imdb", "model=hf", f"model.path={bert}"], tmp_path, blocked="transformers")
    assert out.returncode == 2
    assert out.stderr.splitlines() == ["error: model.name: model 'hf' needs Hugging Face Transformers, not installed "
                                       "in this environment: pip install 'ray-train-pipelines[hf]'"]


def test_the_logged_model_masks_the_padding_at_a_rows_end_only() -> None:
    from trainers.models.text import trailing_padding_mask

    ids = torch.tensor([[7, 0, 9, 0, 0], [3, 4, 5, 6, 0], [0, 0, 0, 0, 0]])
    assert trailing_padding_mask(ids).tolist() == [[True, True, True, False, False],
                                                   [True, True, True, True, False],
                                                   [False] * 5]


def test_the_exported_tokenizer_gives_the_training_datas_ids_and_pads_with_id_0(tmp_path: Path, bert: Path) -> None:
    """A folder whose tokenizer is not the one the data was made with: the export carries the data's (its padding
    token id 0, BERT's special tokens by name)."""
    from transformers import AutoTokenizer

    from pipelines.data.imdb import imdb_schema as schema
    from pipelines.data.tokenize import wordpiece_tokenizer
    from trainers.models import build_model
    from trainers.models.hf import export_hf

    data_tokenizer = wordpiece_tokenizer(["great", "awful", "film", "plot"])
    cfg = load_config(["model=hf", f"model.path={bert}"])
    export_hf(build_model(cfg.model, schema(64, 16)).eval(), tmp_path / "out", data_tokenizer.to_str())
    loaded = AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "great film, awful plot"
    assert loaded(text)["input_ids"] == data_tokenizer.encode(text).ids
    assert loaded.pad_token_id == 0 and loaded.cls_token == "[CLS]"
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["id2label"] == {"0": "neg", "1": "pos"} and config["pad_token_id"] == 0


def test_a_transformers_models_flops_are_counted(bert: Path, llama: Path) -> None:
    """MFU needs them: about 6 FLOPs per non-embedding parameter per token, plus attention's products."""
    from trainers.model_flops import flops_per_sample
    from trainers.models import build_model

    for folder in (bert, llama):
        cfg = load_config(["model=hf", f"model.path={folder}"])
        weights = sum(p.numel() for name, p in build_model(cfg.model, imdb_schema(64, 16)).named_parameters()
                      if "embed" not in name)
        assert 6 * weights * 16 < flops_per_sample(cfg.model, imdb_schema(64, 16)) < 1.3 * 6 * weights * 16


def test_loading_a_folder_says_in_one_line_what_is_drawn_anew(bert: Path, capsys) -> None:
    """The base model's folder has no classification head: the head is new, and that is all the load says."""
    from trainers.models import build_model

    build_model(load_config(["model=hf", f"model.path={bert}"]).model, imdb_schema(64, 16))
    assert capsys.readouterr().err.splitlines() == [f"model.path={bert}: drawn anew: classifier.bias, "
                                                    f"classifier.weight"]
