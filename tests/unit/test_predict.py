"""Prediction input without Ray: raw images and reviews read as the prepared shards hold them (the same pixels,
the same token ids as `prepare` wrote), and bad input as one line with exit 2; the tokenising actors made as the
scoring ones, and the TF-IDF model's own layer as a logged model brings it to a scoring process. The Ray Data path
(tokenising and scoring actors) runs end to end in tests/integration/test_sweep.py (IMDb: the tokenising step
too)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from contract.registry import DATASETS, resolve
from pipelines import predict, scoring
from pipelines.data.imdb import imdb_schema
from pipelines.data.idx import DataError
from pipelines.data.raw_inputs import read_images, read_texts
from pipelines.data.shards import read_manifest
from pipelines.data.tokenize import Tokenise
from tests.conftest import ROOT, make_mnist_like, read_split


def test_images_from_idx_and_from_a_folder_of_files(tmp_path):
    raw = make_mnist_like(tmp_path / "raw", 4, 6)
    sources, images = read_images(raw / "t10k-images-idx3-ubyte.gz")
    assert images.shape == (6, 784) and images.dtype == np.uint8
    assert sources[0] == "t10k-images-idx3-ubyte.gz[0]"
    folder = tmp_path / "pngs"
    folder.mkdir()
    for i, image in enumerate(images[:3]):  # 28x28 grayscale files come back as the same pixels
        Image.fromarray(image.reshape(28, 28)).save(folder / f"digit{i}.png")
    Image.fromarray(np.full((56, 56, 3), 200, np.uint8)).save(folder / "z_big_rgb.jpg")  # converted, resized
    sources, from_files = read_images(folder)
    assert sources == ["digit0.png", "digit1.png", "digit2.png", "z_big_rgb.jpg"]
    np.testing.assert_array_equal(from_files[:3], images[:3])
    assert np.all(np.abs(from_files[3].astype(int) - 200) <= 1)


def test_reviews_from_lines_csv_and_folders_tokenise_as_prepare_did(tmp_path, tiny_imdb):
    """Raw texts are cleaned as their dataset's preparation cleaned its texts: IMDb's `clean_text` (its spec's), a
    table's texts (`prepare table --text`) as they are."""
    clean = resolve(DATASETS.get("imdb").clean_text)
    lines = tmp_path / "reviews.txt"
    lines.write_text("A great film.<br />Loved it!\nDull and   boring.\n")
    assert read_texts(lines, clean=clean) == (["reviews.txt:1", "reviews.txt:2"],
                                              ["A great film. Loved it!", "Dull and boring."])
    assert read_texts(lines)[1] == ["A great film.<br />Loved it!", "Dull and   boring."]
    table = tmp_path / "reviews.csv"
    table.write_text('id,text\n7,"Superb, moving."\n')
    assert read_texts(table, clean=clean) == (["reviews.csv[0]"], ["Superb, moving."])

    # The generated aclImdb folder the tiny IMDb shards were prepared from: every review, tokenised with the
    # shards' tokenizer as `predict` does, gives exactly the token ids `prepare` stored (train + validation).
    sources, texts = read_texts(tiny_imdb.parent / "src", clean=clean)
    assert len(texts) == 320 and not any("urls_" in s for s in sources)
    head_tokens = read_manifest(tiny_imdb)["head_tokens"]
    tokenised = Tokenise((tiny_imdb / "tokenizer.json").read_text(), 48, head_tokens)(pa.table({"text": texts}))
    ours = sorted(map(tuple, np.stack(tokenised.column("input_ids").to_numpy(zero_copy_only=False))))
    stored = [read_split(tiny_imdb, split)[0] for split in ("train", "validation")]
    assert ours == sorted(map(tuple, np.concatenate(stored)))


def corrupt_png(folder):
    (folder / "x.png").write_bytes(b"not a png")
    return folder


@pytest.mark.parametrize("make, message", [
    (lambda folder: folder, r"no image files"),
    (corrupt_png, r"x.png: not a readable image"),
    (lambda folder: folder / "nothing.idx", r"nothing.idx: not found"),
])
def test_bad_images_are_data_errors(tmp_path, make, message):
    with pytest.raises(DataError, match=message):
        read_images(make(tmp_path))


def test_blank_lines_of_a_text_file_separate_texts(tmp_path):
    (tmp_path / "r.txt").write_text("good\n\n  \nalso good\n")
    assert read_texts(tmp_path / "r.txt") == (["r.txt:1", "r.txt:4"], ["good", "also good"])


@pytest.mark.parametrize("content, name, message", [
    ("text,label\ngood,1\n\"\",0\n", "r.csv", r"1 empty review\(s\) \(first: r.csv\[1\]\)"),
    ("review,label\nfine,1\n", "r.csv", r"no column 'text'"),
    ("", "r.txt", r"no reviews"),
])
def test_bad_reviews_are_data_errors(tmp_path, content, name, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=message):
        read_texts(tmp_path / name)


@pytest.mark.parametrize("args, expected", [
    (["model=m", "input=i", "output=o.parquet", "bogus=1"], r"^error: bogus: Key 'bogus' not in 'PredictConfig'"),
    (["model=m", "output=o.parquet"], r"^error: input: Missing mandatory value"),
    (["model=m", "input=i", "output=predictions.csv"], r"^error: output: \S+ must be a .parquet file"),
    (["model=m", "input=i", "output=/no/such/folder/p.parquet"], r"^error: output: \S+ must be a .parquet file"),
    (["model=m", "input=rows.parquet", "output=./rows.parquet"], r"^error: output: ./rows.parquet is the input "
                                                                 r"\(rows.parquet\); write the predictions elsewhere"),
    (["model=m", "input=.", "output=p.parquet"], r"^error: output: p.parquet is inside the input \(.\)"),
    (["model=0123456789abcdef0123456789abcdef", "input=i", "output=o.parquet"],
     r"^error: model: runs:/0123456789abcdef0123456789abcdef/model: Run with id=\S+ not found"),
])
def test_bad_arguments_are_one_line_and_exit_2(args, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.chdir(tmp_path)
    assert predict.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.match(expected, err), err
    assert not list(tmp_path.glob("*.parquet"))


def test_tokenising_actors_are_made_as_the_scoring_ones(monkeypatch):
    """The tokenising actors of a text model's prediction are not restarted by Ray either
    (`scoring.map_batches_without_restarts`): restarting ones would have Ray Core log its error-level line about
    their constructor arguments in the object store (ray-project/ray#57733)."""
    import ray.data

    made, scored = [], []
    monkeypatch.setattr(ray.data, "from_arrow", lambda table: "rows")
    monkeypatch.setattr(scoring, "map_batches_without_restarts",
                        lambda ds, fn, **options: made.append((ds, fn, options["fn_constructor_args"])) or "tokens")
    monkeypatch.setattr(scoring, "score", lambda ds, *args, key: scored.append(ds) or (
        np.array([1, 0]), np.array([[0.0, 1.0], [2.0, 0.0]])))
    tokenizer = ("{}", 8, None, "input_ids")
    rows = pa.table({"row": [0, 1], "source": ["a.txt", "b.txt"], "text": ["good", "bad"]})
    plan = predict.Plan(SimpleNamespace(batch_size=4, concurrency=1, use_gpu=False), "runs:/r/model",
                        imdb_schema(40, 8), rows, tokenizer)
    table = predict.predict(plan, "sqlite:///m.db")
    assert made == [("rows", Tokenise, tokenizer)] and scored == ["tokens"]
    assert table.column("label").to_pylist() == ["neg", "pos"]


# As MLflow's tensorflow flavour keeps a Keras model's custom objects: cloudpickled, which copies our locally
# defined layer class by value, its methods with only the globals their code uses.
SAVE_CUSTOM_OBJECTS = """
import sys
import cloudpickle
import tf_keras
from trainers.models.keras_models import custom_objects
with open(sys.argv[1], "wb") as out:
    cloudpickle.dump(custom_objects(tf_keras), out)
"""
PREDICT_WITH_THEM = """
import json, logging, sys
import cloudpickle, numpy as np, tensorflow as tf, tf_keras
records = []
handler = logging.Handler()
handler.emit = records.append
tf.get_logger().addHandler(handler)
with open(sys.argv[1], "rb") as f:
    layer = cloudpickle.load(f)["TokenFeatures"](50, 16)
model = tf_keras.Sequential([tf_keras.Input(shape=(8,), dtype="int32"), layer])
layer.idf.assign(np.linspace(0.0, 2.0, 66, dtype=np.float32))
ids = np.random.default_rng(0).integers(0, 50, size=(4, 8)).astype(np.int32)
predicted = model.predict(ids, verbose=0)
from trainers.models.tf_modules import tfidf_features
print(json.dumps({"autograph": [r.getMessage() for r in records if "AutoGraph" in r.getMessage()],
                  "same": bool(np.allclose(predicted, tfidf_features(ids, layer.idf, 16).numpy(), atol=1e-6))}))
"""


@pytest.mark.slow  # TensorFlow in two processes of its own
def test_tfidf_features_layer_converts_in_a_scoring_process(tmp_path):
    """The TF-IDF model's `TokenFeatures` as a logged model brings it to a scoring actor (its custom objects saved
    in one process, loaded in another): Keras' predict converts its `call` with AutoGraph without "AutoGraph could
    not transform ... name 'Any' is not defined" (which `rtp predict` printed), and gives the TF-IDF vectors. Fresh
    processes: tf-keras needs TF_USE_LEGACY_KERAS=1 before TensorFlow is imported, and in the process that pickled
    the class cloudpickle would hand back the class itself."""
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}
    saved = tmp_path / "custom_objects.cloudpickle"
    for code in (SAVE_CUSTOM_OBJECTS, PREDICT_WITH_THEM):
        proc = subprocess.run([sys.executable, "-c", code, str(saved)], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"autograph": [], "same": True}, result
