"""Ordered data shards (trainers/data_split.py) on a real Ray head, read from real Parquet files."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import ray_init_on
from trainers.data_split import OrderedSplit, split_config

pytestmark = pytest.mark.slow  # starts Ray

FILES, ROWS_PER_FILE = 8, 64


@pytest.fixture
def ray_driver(ray_head):
    import ray

    ray_init_on(ray_head, log_to_driver=False)
    yield
    ray.shutdown()


def rows_of(iterator) -> list[int]:
    return [int(r) for batch in iterator.iter_batches(batch_size=100, batch_format="numpy") for r in batch["row"]]


def read_rows(folder) -> object:
    """The files as the pipelines read them (pipelines/data/readers.py)."""
    from pipelines.data.readers import read_parquet

    paths = []
    for f in range(FILES):
        rows = list(range(f * ROWS_PER_FILE, (f + 1) * ROWS_PER_FILE))
        paths.append(str(folder / f"part-{f:05d}.parquet"))
        pq.write_table(pa.table({"row": rows}), paths[-1])
    return read_parquet(paths)


def test_each_rank_gets_its_contiguous_part_in_file_order_every_time(tmp_path, ray_driver):
    total = FILES * ROWS_PER_FILE
    for _ in range(2):  # a restarted run (or the next run) configures again: same rows, same order
        shards = OrderedSplit(dp=2).configure({"train": read_rows(tmp_path)}, world_size=2, worker_handles=None,
                                               worker_node_ids=None)
        assert rows_of(shards[0]["train"]) == list(range(total // 2))
        assert rows_of(shards[1]["train"]) == list(range(total // 2, total))


def test_datasets_the_driver_materialised_split_the_same(tmp_path, ray_driver):
    """pipelines/fit.py reads cached data in the driver while it builds the trainer (`Materializing`): the ranks
    get the same contiguous rows as from the lazy dataset, and a failed read is raised by `result()`."""
    from ray.data.dataset import MaterializedDataset

    from pipelines.data.readers import Materializing, read_parquet

    total = FILES * ROWS_PER_FILE
    datasets = Materializing({"train": read_rows(tmp_path)}).result()
    assert isinstance(datasets["train"], MaterializedDataset)
    shards = OrderedSplit(dp=2).configure(datasets, world_size=2, worker_handles=None, worker_node_ids=None)
    assert rows_of(shards[0]["train"]) == list(range(total // 2))
    assert rows_of(shards[1]["train"]) == list(range(total // 2, total))
    (tmp_path / "part-00003.parquet").write_bytes(b"PAR1 cut short")
    reading = Materializing({"train": read_parquet(sorted(str(p) for p in tmp_path.glob("part-*.parquet")))})
    with pytest.raises(Exception, match="part-00003"):
        reading.result()


def test_ranks_of_one_tp_group_read_the_same_shard(tmp_path, ray_driver):
    shards = OrderedSplit(dp=2, group=2).configure({"train": read_rows(tmp_path)}, world_size=4, worker_handles=None,
                                                 worker_node_ids=None)
    rows = [rows_of(s["train"]) for s in shards]
    assert rows[0] == rows[1] and rows[2] == rows[3]
    assert sorted(rows[0] + rows[2]) == list(range(FILES * ROWS_PER_FILE))


def test_streaming_data_keeps_rays_streaming_split_and_tp_always_orders():
    assert type(split_config(2, cache_in_worker=False)).__name__ == "DataConfig"
    assert isinstance(split_config(2, cache_in_worker=True), OrderedSplit)
    assert isinstance(split_config(4, cache_in_worker=False, group=2), OrderedSplit)
    with pytest.raises(ValueError, match="dp\\*group=4 != world_size=3"):
        OrderedSplit(dp=2, group=2).configure({}, world_size=3, worker_handles=None, worker_node_ids=None)
