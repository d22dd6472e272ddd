"""A local tracking store (sqlite, file): opened once before a run, created (or migrated) by one process at a time,
and a store that an interrupted creation left half-made named in one line saying how to recover it."""
from __future__ import annotations

import fcntl
import time
import warnings
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Iterator

from contract.tracking.server import TrackingUnavailable, mlflow_client


def check_local_store(uri: str) -> None:
    """Open a local store (sqlite, file) once, so that a refused one is a config error and not a traceback. A new
    sqlite store is created (or migrated) here, one process at a time: MLflow's tracking store creates its tables
    without a lock, and two runs that create one store at once leave it half-migrated for good."""
    import logging

    for name in ("mlflow.store.db.utils", "alembic"):  # "Creating initial MLflow database tables..." and such:
        logging.getLogger(name).setLevel(logging.WARNING)  # a new local store is no news worth two lines
    db = Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None
    try:
        if db is None:
            mlflow_client(uri).search_experiments(max_results=1)
        else:
            with exclusive_lock(db.with_name(db.name + ".lock"), STORE_LOCK_TIMEOUT_S, "the MLflow store's lock"), \
                    warnings.catch_warnings():
                warnings.filterwarnings("ignore", module="alembic")  # its notes on the tables it rebuilds
                mlflow_client(uri).search_experiments(max_results=1)
    except TrackingUnavailable:
        raise
    except Exception as err:  # which store refuses how is MLflow's business; the user needs one line
        broken = _half_created(db) if db is not None else None
        if broken:
            raise TrackingUnavailable(broken) from err
        first = str(err).split(". ", 1)[0].strip().splitlines()[0]
        hint = ("; MLflow 3 opens file stores only with MLFLOW_ALLOW_FILE_STORE=true: use sqlite:///mlflow.db"
                if "MLFLOW_ALLOW_FILE_STORE" in str(err) else "")
        raise TrackingUnavailable(f"MLflow tracking URI {uri} cannot be opened ({first}){hint}") from err


STORE_LOCK_TIMEOUT_S = 120.0  # creating a store takes seconds; a holder past this is stuck


@contextmanager
def exclusive_lock(path: Path, timeout_s: float, what: str) -> Iterator[None]:
    """Hold an exclusive `flock` on `path` (created if missing) while the block runs; wait at most `timeout_s` for
    it, then raise TrackingUnavailable naming the lock."""
    with open(path, "a") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TrackingUnavailable(f"{what} {path} is held by another process for over {timeout_s:g} s")
                time.sleep(0.1)  # a poll of the lock, bounded by the deadline
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _half_created(db: Path) -> str | None:
    """The one line to print when the sqlite store at `db` was left half-created (the leftovers of an interrupted
    migration in it), saying how to recover; None when it is not."""
    import sqlite3

    try:
        with closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)) as conn:
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            runs = conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] if "runs" in tables else 0
    except sqlite3.Error:
        return None
    leftovers = sorted(t for t in tables if t.startswith("_alembic_tmp_"))
    if not leftovers:
        return None
    if runs == 0:
        return (f"the MLflow store {db} was left half-created (by runs that created it at the same time) and holds "
                f"no runs: move it aside (mv {db} {db}.broken) and run again to create a new one")
    drops = "; ".join(f"DROP TABLE {t}" for t in leftovers)
    return (f"the MLflow store {db} holds {runs} runs and an interrupted schema migration: back it up, then run "
            f"sqlite3 {db} '{drops}' and mlflow db upgrade sqlite:///{db}")
