"""Streamed data (`data.cache_in_worker=false`, trainers/streamed.py) read by Ray Data from real Parquet files:
a rank's batches are the files' rows in the order contract/stream_order.py says, every row once an epoch, the same
global batches at 1 and 2 ranks; and a run through `rtp train` on a generated dataset several times a deliberately
small object store finishes, each worker's memory bounded by the window, not the dataset; a streamed TensorFlow run
resumes inside an epoch."""
from __future__ import annotations

import json
import os
from collections import defaultdict

import numpy as np
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from contract.augment import sample_keys
from contract.data import DataSchema
from contract.stream_order import StreamOrder
from pipelines.prepare import main as prepare_main
from tests.conftest import check_finished_run, pipeline_env, ray_init_on, run_id_from, run_pipeline
from tests.support.local_ray import started_ray_head
from trainers.streamed import Augmenting, SplitFiles, StreamedRows, ray_read

pytestmark = pytest.mark.slow  # starts Ray


@pytest.fixture
def ray_driver(ray_head):
    import ray

    ray_init_on(ray_head, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_data_hands_each_rank_its_part_of_the_same_global_batches(tmp_path, ray_driver):
    assert prepare_main(["synthetic", "--rows", "3000", "--features", "4", "--rows-per-shard", "300",
                         "--out", str(tmp_path)]) == 0
    files = SplitFiles.of_split(str(tmp_path), "train")
    assert len(files.paths) == 8  # 2400 train rows
    order = StreamOrder(files.rows, 500, seed=3)
    on_disk = {path: pq.read_table(path).column("row").to_numpy() for path in files.paths}

    def global_batches(dp: int, skip: int = 0) -> list[np.ndarray]:
        ranks = [list(StreamedRows(files, ["row"], order, 64 // dp, dp, rank, read=ray_read).epoch(2, skip))
                 for rank in range(dp)]
        return [np.concatenate([r[step]["row"] for r in ranks]) for step in range(len(ranks[0]))]

    one = global_batches(1)
    assert len(one) == 38 and sorted(np.concatenate(one).tolist()) == list(range(2400))  # 2400 = 37 x 64 + 32
    # What the order says, from the files read here: window by window, each in its permutation.
    expected = np.concatenate([np.concatenate([on_disk[files.paths[f]] for f in w.files])
                               [order.window_order(2, w, i, 64)] for i, w in enumerate(order.windows(2))])
    np.testing.assert_array_equal(np.concatenate(one), expected)
    for mine, theirs in zip(global_batches(2), one):
        np.testing.assert_array_equal(mine, theirs)
    for mine, theirs in zip(global_batches(2, skip=20), one[20:]):  # a resumed epoch reads from its window
        np.testing.assert_array_equal(mine, theirs)


AUGMENT_PLUGIN = '''
import os
import numpy as np

def add_keys(columns, keys, schema):
    """Each row's features plus its key modulo 1000, and the process that augmented it."""
    return {**columns, "features": columns["features"] + (keys % 1000).astype(np.float32)[:, None],
            "pid": np.full(len(keys), os.getpid())}
'''


def test_read_tasks_send_each_rank_its_rows_only_augmented_where_read(tmp_path, ray_driver):
    """Each rank's Ray Data tasks read the files, keep the rank's rows and augment them (a plugin's function, from a
    folder only the plugin's roots name): the ranks receive disjoint parts whose union is the global batches, each
    row's features shifted by its position's key, in processes other than the rank's."""
    data, plugins = tmp_path / "data", tmp_path / "plugins"
    assert prepare_main(["synthetic", "--rows", "1500", "--features", "4", "--rows-per-shard", "150",
                         "--out", str(data)]) == 0
    plugins.mkdir()
    (plugins / "row_keys_plugin.py").write_text(AUGMENT_PLUGIN)
    files = SplitFiles.of_split(str(data), "train")
    schema = DataSchema.from_manifest(json.loads((data / "manifest.json").read_text()))
    order = StreamOrder(files.rows, 300, seed=5)
    augment = Augmenting("row_keys_plugin:add_keys", schema, (str(plugins),))
    columns = ["row", "features", "label"]
    ranks = [list(StreamedRows(files, columns, order, 16, 2, rank, read=ray_read, stored=schema.stored_columns,
                               augment=augment).epoch(1)) for rank in range(2)]
    plain = list(StreamedRows(files, columns, order, 32, 1, 0, read=ray_read, stored=schema.stored_columns).epoch(1))
    assert len(ranks[0]) == len(ranks[1]) == len(plain) == 38  # 1200 rows = 37 x 32 + 16
    for step, (a, b, whole) in enumerate(zip(*ranks, plain)):
        np.testing.assert_array_equal(np.concatenate([a["row"], b["row"]]), whole["row"])
        keys = sample_keys(5, 1, np.arange(step * 32, step * 32 + len(whole["row"])))
        got = np.concatenate([a["features"], b["features"]])
        np.testing.assert_allclose(got, whole["features"] + (keys % 1000).astype(np.float32)[:, None], rtol=1e-6)
        assert os.getpid() not in np.concatenate([a["pid"], b["pid"]])


@pytest.fixture
def small_object_store(tmp_path):
    """A Ray head of its own whose object store holds 200 MB."""
    with started_ray_head(tmp_path / "ray_state", 4, RAY_OBJECT_STORE_MEMORY=str(200 * 2**20)) as values:
        yield values


def test_a_dataset_five_times_the_object_store_streams_in_less_memory_than_the_dataset(tmp_path, small_object_store,
                                                                                      mlflow_server):
    """1.07 GB of generated rows (65,536 train rows of 4,096 float32 features, in files of 1,024 rows), one DDP
    worker streaming it through an object store of 200 MB with windows of 2,048 rows (32 MB), `auto` choosing to
    stream it: the run finishes, and the worker's peak memory (its libraries included) stays under 1 GiB, less
    than the data it would hold in memory."""
    data = tmp_path / "data"
    assert prepare_main(["synthetic", "--rows", "81920", "--features", "4096", "--rows-per-shard", "1024",
                         "--out", str(data)]) == 0
    train_bytes = sum(p.stat().st_size for p in data.glob("train-*.parquet"))
    assert train_bytes > 5 * 200 * 2**20
    done = run_pipeline([f"data.path={data}", "model=mlp", "model.hidden=[32]", "trainer.epochs=1",
                         "trainer.num_workers=1", "trainer.batch_size=256", "data.cache_max_bytes=268435456",
                         "data.shuffle_buffer=2048", f"run.storage_path={tmp_path / 'ray'}"],
                        pipeline_env(mlflow_server, small_object_store))
    assert done.returncode == 0, done.stderr[-3000:]
    run = MlflowClient(mlflow_server).get_run(run_id_from(done.stdout))
    assert run.info.status == "FINISHED" and run.data.params["data.cache_in_worker"] == "False"  # auto: too big
    assert run.data.metrics["test_accuracy"] > 0.2, run.data.metrics  # it learned (10 classes: 0.1 by chance)
    assert run.data.metrics["peak_memory_bytes"] < min(2**30, train_bytes), run.data.metrics


def test_tf_mwms_streams_on_two_workers_and_resumes_inside_an_epoch(tmp_path, mlflow_server, ray_head):
    """tf_mwms's custom loop on 2 workers streaming a generated dataset (`data.cache_in_worker=false`), a checkpoint
    every 10 steps; the last worker fails before step 19 (compiled calls of up to 8 steps: 11-18, 19-20) and both
    restart from step 10's checkpoint. The run keeps the contract every backend keeps, the replicas end identical,
    the steps trained twice have the same losses (the same batches again, streamed from step 10), and the model
    learned the data's rule."""
    data, marker = tmp_path / "data", tmp_path / "failed-once"
    assert prepare_main(["synthetic", "--rows", "3000", "--features", "8", "--classes", "2", "--rows-per-shard", "300",
                         "--out", str(data)]) == 0
    done = run_pipeline([f"data.path={data}", "trainer=tf_mwms", "trainer.tf_loop=custom",
                         "trainer.tf_communication=ring", "trainer.threads_per_worker=1", "trainer.batch_size=32",
                         "trainer.epochs=2", "model=mlp", "model.hidden=[32]", "data.cache_in_worker=false",
                         "data.shuffle_buffer=500", "trainer.log_every_n_steps=1", "run.checkpoint_every_n_steps=10",
                         "fault.max_failures=1", "fault.inject_at_step=19", f"fault.inject_marker={marker}",
                         f"run.dump_params_dir={tmp_path / 'params'}", f"run.storage_path={tmp_path / 'ray'}"],
                        pipeline_env(mlflow_server, ray_head))
    assert done.returncode == 0, done.stderr[-3000:]
    assert marker.read_text() == "failed at step 19 in rank 1\n"
    client = MlflowClient(mlflow_server)
    run_id = run_id_from(done.stdout)
    check_finished_run(client, run_id, "tf_mwms", 2)
    run = client.get_run(run_id)
    assert run.data.params["data.cache_in_worker"] == "False"
    assert run.data.tags["resumed_from_step"] == "epoch 1 step 10"
    losses: dict[int, list[float]] = defaultdict(list)
    for m in client.get_metric_history(run_id, "step_loss"):
        losses[m.step].append(m.value)
    assert sorted(losses) == list(range(1, 2 * 37 + 1))  # 2,400 train rows: 37 global batches of 64 an epoch
    for step, values in losses.items():
        np.testing.assert_allclose(values, values[0], rtol=1e-6, err_msg=f"step {step}")
    rank0, rank1 = (np.load(tmp_path / "params" / f"rank{r}.npz") for r in (0, 1))
    for key in rank0.files:
        np.testing.assert_array_equal(rank0[key], rank1[key])
    assert run.data.metrics["test_accuracy"] > 0.7, run.data.metrics  # a linear rule of 2 classes
