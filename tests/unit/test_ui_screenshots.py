"""pipelines.sweep.screenshots refuses, in one line and before a browser starts, what cannot show a UI (the browser
run itself: tests/integration/test_sweep.py)."""
from __future__ import annotations

import re

import pytest

from pipelines.sweep.screenshots import main
from tests.conftest import free_port


@pytest.mark.parametrize("uri, message", [
    ("sqlite:///{tmp}/mlflow.db", r"^error: MLFLOW_TRACKING_URI=sqlite:///\S+: the UI needs a tracking server"),
    ("http://127.0.0.1:{port}", r"^error: .*127\.0\.0\.1:\d+"),
])
def test_no_tracking_server_is_exit_2(tmp_path, monkeypatch, capsys, uri, message):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri.format(tmp=tmp_path, port=free_port()))
    assert main(["0" * 32, "--out", str(tmp_path / "shots")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert re.match(message, err), err
    assert not (tmp_path / "shots").exists()
