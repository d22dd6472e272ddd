"""`rtp prepare` when the input or the machine fails it: one line each, the exit code of its kind, before Ray
starts where the input is at fault, and the dataset already at `--out` left as it was."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pandas as pd

from pipelines import prepare
from tests.conftest import ROOT
from tests.support.imdb_fixtures import make_aclimdb


def test_a_tokenizer_file_that_is_none_is_one_line_before_ray(tmp_path, capsys):
    make_aclimdb(tmp_path / "src", per_label=3)
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    code = prepare.main(["imdb", "--source", str(tmp_path / "src" / "aclImdb"), "--out", str(tmp_path / "out"),
                         "--tokenizer", str(tmp_path / "tokenizer.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"data error: {tmp_path / 'tokenizer.json'}: not a tokenizer.json"), err
    assert len(err.splitlines()) == 1
    assert "ray" not in sys.modules or not __import__("ray").is_initialized()
    assert not (tmp_path / "out").exists()


def test_a_write_the_machine_refuses_is_one_line_and_keeps_the_old_dataset(tmp_path):
    """A file size limit (RLIMIT_FSIZE, with SIGXFSZ ignored: the write fails with EFBIG, as on a full disk with
    ENOSPC) stops `prepare table` while it writes its shards: exit 1, one line, the earlier dataset intact."""
    rng = np.random.default_rng(0)
    pd.DataFrame({"a": rng.normal(size=20_000), "b": rng.normal(size=20_000),
                  "y": rng.integers(0, 3, 20_000)}).to_csv(tmp_path / "t.csv", index=False)
    args = ["table", "--source", str(tmp_path / "t.csv"), "--features", "a", "b", "--label", "y",
            "--out", str(tmp_path / "out")]
    assert prepare.main(args) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    limited = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, 50_000)); from pipelines import prepare; "
               f"sys.exit(prepare.main({args!r} + ['--shards', '1']))")
    proc = subprocess.run([sys.executable, "-c", limited], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "previous dataset" in err, err
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []  # no staging folder left


def test_a_table_without_numeric_columns_is_one_line_and_exit_2(tmp_path, capsys):
    """Without --features the features are the numeric columns; a table with none but the label says so."""
    pd.DataFrame({"name": ["a", "b", "c", "d"], "y": [0, 1, 0, 1]}).to_csv(tmp_path / "t.csv", index=False)
    code = prepare.main(["table", "--source", str(tmp_path / "t.csv"), "--label", "y", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"data error: {tmp_path / 't.csv'}: no numeric column left"), err
    assert len(err.splitlines()) == 1 and "--features" in err
    assert not (tmp_path / "out").exists()


DATASET_PLUGIN = '''
from contract.registry import DatasetSpec, register_dataset


def options(parser):
    parser.add_argument("--out")  # declared without type=Path
    parser.add_argument("--rows", type=int, default=3)


def broken_options(parser):
    raise KeyError("rows")


def prepare(args):
    if args.rows < 1:
        raise ValueError(f"--rows: must be >= 1, got {args.rows}")
    return None  # forgot to return the manifest


register_dataset(DatasetSpec("{name}", prepare, {options}, "a user's dataset"))
'''


def test_a_plugin_datasets_mistakes_are_one_line_and_exit_2(tmp_path, monkeypatch, forget_plugins, capsys):
    """A user's DatasetSpec whose options cannot be added, whose `prepare` refuses its input (ValueError) or returns
    no manifest, with `--out` declared as a plain string: one line and exit 2 each, no traceback."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "rows_data.py").write_text(DATASET_PLUGIN.replace("{name}", "rows").replace("{options}", "options"))
    (tmp_path / "bad_options.py").write_text(DATASET_PLUGIN.replace("{name}", "bad").replace("{options}",
                                                                                             "broken_options"))
    out = str(tmp_path / "out")
    assert prepare.main(["--plugin", "rows_data", "rows", "--out", out, "--rows", "0"]) == 2
    assert capsys.readouterr().err.strip() == "data error: --rows: must be >= 1, got 0"
    assert prepare.main(["--plugin", "rows_data", "rows", "--out", out]) == 2
    assert capsys.readouterr().err.strip() == ("error: dataset 'rows': its prepare returned NoneType, not the manifest "
                                               "it wrote (pipelines.data.shards.write_manifest's)")
    assert prepare.main(["--plugin", "bad_options", "bad", "--out", out]) == 2
    assert capsys.readouterr().err.strip() == ("error: dataset 'bad': add_arguments=bad_options:broken_options failed "
                                               "(KeyError: 'rows')")
