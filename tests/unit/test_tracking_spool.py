"""A worker's MLflow writes while the server is away (contract/tracking/spool.py TrackingSpool): kept in the spool
folder, never raised, and sent later exactly once, against a real MLflow store."""
from __future__ import annotations

import threading
from pathlib import Path

import mlflow

from contract.tracking import EpochLogger, TrackingSpool, flush_spools, spooled
from tests.conftest import free_port


def test_records_wait_in_the_spool_and_go_out_once(tmp_path, monkeypatch):
    for name, value in (("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0"), ("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")):
        monkeypatch.setenv(name, value)  # what TrackingSpool sets in a worker, undone after the test
    monkeypatch.chdir(tmp_path)  # the local store keeps its artifacts under the working directory
    store = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(store)
    run_id = client.create_run(client.create_experiment("spool")).info.run_id
    client.log_metric(run_id, "train_loss", 0.9, step=1)  # epoch 1 reached the server before it went away

    away = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    folder = tmp_path / "spool"
    logger = EpochLogger(TrackingSpool(away, run_id, folder, "rank0"))
    logger.log(1, {"train_loss": 0.9, "test_accuracy": 0.5})  # a replayed epoch: must stay logged once
    logger.log(2, {"train_loss": 0.7, "test_accuracy": 0.6})
    logger.log_step_loss(40, 0.65)
    logger.resumed_from(1)
    profile = tmp_path / "profile"
    profile.mkdir()
    (profile / "trace_rank0.json").write_text("{}")
    logger.log_artifacts(str(profile), "profile")
    assert spooled(folder) == 5  # nothing raised, nothing lost

    assert flush_spools(away, run_id, folder) == 5  # still away: kept
    assert flush_spools(store, run_id, folder) == 0  # back (here: the store the server serves)
    assert flush_spools(store, run_id, folder) == 0 and list(folder.iterdir()) == []
    steps = lambda key: sorted(m.step for m in client.get_metric_history(run_id, key))
    assert steps("train_loss") == [1, 2] and steps("test_accuracy") == [2] and steps("step_loss") == [40]
    assert client.get_run(run_id).data.tags["resumed_from_epoch"] == "1"
    assert [a.path for a in client.list_artifacts(run_id, "profile")] == ["profile/trace_rank0.json"]


def test_step_losses_go_out_together_not_one_request_each(tmp_path, monkeypatch):
    """Kept until the epoch's end (or STEP_LOSS_SEND_S after the oldest, then by the logger's own thread), then
    sent in order in one record."""
    from contract.tracking import logger as tracking_logger

    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(store)
    run_id = client.create_run(client.create_experiment("steps")).info.run_id
    logger = EpochLogger(TrackingSpool(store, run_id, tmp_path / "spool", "rank0"))
    history = lambda: [(m.step, m.value) for m in client.get_metric_history(run_id, "step_loss")]
    for step in (10, 20, 30):
        logger.log_step_loss(step, step / 64)
    assert history() == []  # kept
    logger.log(1, {"train_loss": 0.75, "test_accuracy": 0.5})
    assert sorted(history()) == [(10, 10 / 64), (20, 20 / 64), (30, 30 / 64)]
    monkeypatch.setattr(tracking_logger, "STEP_LOSS_SEND_S", 0.0)
    senders, write = [], logger.spool.write
    monkeypatch.setattr(logger.spool, "write", lambda record: (senders.append(threading.current_thread()),
                                                               write(record)))
    logger.log_step_loss(40, 0.5)  # the oldest kept loss is STEP_LOSS_SEND_S old: its send starts at once...
    logger.flush()  # (waits for it)
    assert sorted(history())[-1] == (40, 0.5)
    assert len(senders) == 1 and senders[0] is not threading.current_thread()  # ...off the training thread


def read_scalars(folder) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} from the TensorBoard event files in `folder` (TFRecord framing: length, its CRC, the
    Event proto, its CRC)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def test_tensorboard_event_files_hold_the_logged_metrics_and_become_artifacts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(store)
    run_id = client.create_run(client.create_experiment("board")).info.run_id
    board = tmp_path / "run" / "tensorboard"
    logger = EpochLogger(TrackingSpool(store, run_id, tmp_path / "spool", "rank0"), board)
    logger.log_step_loss(10, 0.875)
    logger.log(1, {"train_loss": 0.75, "test_accuracy": 0.5})
    logger.log_step_loss(20, 0.625)
    logger.log(2, {"train_loss": 0.5625, "test_accuracy": 0.625})
    expected = {"step_loss": {10: 0.875, 20: 0.625}, "train_loss": {1: 0.75, 2: 0.5625},
                "test_accuracy": {1: 0.5, 2: 0.625}}
    assert read_scalars(board) == expected  # exact: each value is a float32 here
    [artifact] = client.list_artifacts(run_id, "tensorboard")
    local = client.download_artifacts(run_id, artifact.path, str(tmp_path / "download"))
    assert read_scalars(Path(local).parent) == expected  # the epoch-2 upload holds it all
