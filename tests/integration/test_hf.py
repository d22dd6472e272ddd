"""A Hugging Face Transformers model end to end, as a user fine-tunes a local checkpoint: a tiny BERT folder (written
by `save_pretrained`, its tokenizer beside it) and a CSV of reviews, prepared with that tokenizer by `rtp prepare
table`, trained by `rtp train model=hf` through ddp on 2 Ray workers into the MLflow server (the run's artifacts
holding the Transformers folder too), scored by `rtp evaluate`, used by `rtp predict` on raw texts, and written out
by `rtp export`: the folder loads with `from_pretrained` alone, its tokenizer gives the training data's ids, and its
logits give the predictions `rtp predict` made. A folder that is not there: one line, exit 2."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.conftest import check_finished_run, pipeline_env, run_id_from
from tests.integration.test_user_project import rtp
from tests.support.hf_models import save_tiny
from tests.support.imdb_fixtures import FILLER, NEGATIVE, POSITIVE, review

pytestmark = pytest.mark.slow


def reviews_csv(path: Path, rows: int) -> Path:
    rng = np.random.default_rng(4)
    lines = [f"\"{review(rng, bool(i % 2))}\",{'pos' if i % 2 else 'neg'}" for i in range(rows)]
    path.write_text("\n".join(["review,sentiment", *lines]) + "\n")
    return path


def test_a_transformers_checkpoint_is_fine_tuned_predicts_and_exports(tmp_path: Path, mlflow_server: str,
                                                                       ray_head: dict[str, str]) -> None:
    env = pipeline_env(mlflow_server, ray_head)
    words = [*POSITIVE, *NEGATIVE, *FILLER, "br", "<", ">", "/", ".", "!"]
    checkpoint = save_tiny("bert", tmp_path / "tiny-bert", tokenizer_words=words)
    data = tmp_path / "reviews"
    rtp(["prepare", "table", "--source", str(reviews_csv(tmp_path / "reviews.csv", 480)), "--text", "review",
         "--label", "sentiment", "--tokenizer", str(checkpoint), "--max-len", "32", "--out", str(data)], tmp_path, env)

    absent = rtp(["train", "model=hf", f"model.path={tmp_path / 'absent'}", f"data.path={data}"], tmp_path, env,
                 check=False)
    assert absent.returncode == 2 and absent.stderr.splitlines() == [
        f"error: model.path: {tmp_path / 'absent'} has no config.json (a folder written by save_pretrained; models "
        f"are never downloaded)"]
    proc = rtp(["train", "model=hf", f"model.path={checkpoint}", f"data.path={data}", "trainer=ddp",
                "trainer.num_workers=2", "trainer.epochs=6", "trainer.batch_size=16", "trainer.lr=0.01",
                "run.system_metrics=false", f"run.storage_path={tmp_path / 'ray'}"], tmp_path, env)
    run_id = run_id_from(proc.stdout)
    client = MlflowClient(mlflow_server)
    check_finished_run(client, run_id, "ddp", 6)
    metrics = client.get_run(run_id).data.metrics
    assert metrics["test_accuracy"] > 0.8, metrics  # the sentiment words decide
    assert metrics["tflops_per_rank"] > 0  # its FLOPs counted
    logged = {artifact.path for artifact in client.list_artifacts(run_id, "exported_model")}
    assert {"exported_model/config.json", "exported_model/model.safetensors",
            "exported_model/tokenizer.json"} <= logged

    evaluation = client.get_run(run_id_from(rtp(["evaluate", f"model={run_id}", "data.split=test"], tmp_path,
                                                env).stdout))
    assert evaluation.data.metrics["test_accuracy"] == pytest.approx(metrics["final_test_accuracy"])

    texts = ["a wonderful superb film", "the worst and most boring movie", "it was dull", "loved it really"]
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n")
    output = tmp_path / "predictions.parquet"
    rtp(["predict", f"model={run_id}", "input=texts.txt", f"output={output}"], tmp_path, env)
    predictions = pq.read_table(output).to_pydict()
    assert predictions["label"] == ["pos", "neg", "neg", "pos"]

    out = tmp_path / "exported"
    assert rtp(["export", f"model={run_id}", f"out={out}"], tmp_path, env).stdout.splitlines()[-1] == \
        f"exported={out}"
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        probabilities = model(**batch).logits.softmax(-1)
    torch.testing.assert_close(probabilities, torch.tensor(predictions["probabilities"]), rtol=1e-5, atol=1e-5)
    assert [model.config.id2label[int(i)] for i in probabilities.argmax(-1)] == predictions["label"]

    again = rtp(["export", f"model={run_id}", f"out={out}"], tmp_path, env, check=False)
    assert again.returncode == 2 and again.stderr.splitlines() == [f"error: out: {out} exists and is not an empty "
                                                                   f"folder"]
