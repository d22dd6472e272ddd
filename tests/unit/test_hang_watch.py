"""The hang watchdog without Ray: the verdict's naming of stuck ranks, the positions' files on shared storage, and
the watcher thread itself in a process of its own that hangs (it must end that process, keeping the stacks)."""
from __future__ import annotations

import json
import subprocess
import sys
import threading

from contract.files import write_atomically
from contract.hang import HANG_EXIT_CODE, HangVerdict, Position, publish, read_positions, read_verdicts
from tests.conftest import ROOT


def test_the_ranks_furthest_behind_are_the_stuck_ones():
    # Rank 1 never reached step 4's gradient all-reduce, where ranks 0 and 2 wait for it.
    verdict = HangVerdict(31.4, 3, {0: Position(2, 4, "step"), 1: Position(2, 4, "data"), 2: Position(2, 4, "step")})
    assert verdict.stuck == [1]
    assert verdict.line() == ("hang: no rank advanced for 31 s; stuck: rank 1 (rank 0 at epoch 2 step 4 (step); "
                              "rank 1 at epoch 2 step 4 (data); rank 2 at epoch 2 step 4 (step)); stacks: the run's "
                              "hang/ artifacts")
    # An earlier step counts before any phase; the epoch before the step.
    assert HangVerdict(5, 2, {0: Position(1, 9, "checkpoint"), 1: Position(2, 1, "data")}).stuck == [0]
    assert HangVerdict(5, 2, {0: Position(3, 2, "data"), 1: Position(3, 1, "step")}).stuck == [1]


def test_every_rank_at_the_same_point_or_missing_ranks():
    same = HangVerdict(12, 2, {0: Position(1, 3, "metrics"), 1: Position(1, 3, "metrics")})
    assert same.stuck == [0, 1] and "stuck: every rank (" in same.line()
    missing = HangVerdict(12, 3, {0: Position(1, 1, "step")})
    assert missing.stuck == [1, 2]
    assert "stuck: ranks 1, 2 (rank 0 at epoch 1 step 1 (step); rank 1 never reached the training loop; " in \
        missing.line()


def test_positions_of_another_attempt_are_skipped(tmp_path):
    publish(tmp_path, 0, "new", Position(1, 2, "step"))
    publish(tmp_path, 1, "old", Position(3, 7, "data"))  # left by the attempt before a restart
    assert read_positions(tmp_path, "new", 2) == {0: Position(1, 2, "step")}
    publish(tmp_path, 1, "new", Position(1, 2, "data"))
    assert read_positions(tmp_path, "new", 2) == {0: Position(1, 2, "step"), 1: Position(1, 2, "data")}


def test_verdicts_are_read_oldest_first(tmp_path):
    for attempt, idle in (("a", 10), ("b", 20)):
        verdict = HangVerdict(idle, 1, {0: Position(1, 1, "step")})
        write_atomically(tmp_path / "hang" / f"verdict-{attempt}.json", json.dumps(verdict.to_dict()))
    assert [v["idle_s"] for v in read_verdicts(tmp_path)] == [10, 20]
    assert read_verdicts(tmp_path / "nothing") == []


def test_ranks_writing_one_file_at_once_all_succeed_and_leave_a_whole_file(tmp_path):
    # Every rank's watcher may reach the same verdict in the same moment and write it together.
    verdict, errors, start = tmp_path / "hang" / "verdict-a.json", [], threading.Barrier(2)
    texts = [json.dumps({"rank": rank, "line": str(rank) * 200}) for rank in (0, 1)]

    def write(text: str) -> None:
        start.wait()
        for _ in range(300):
            try:
                write_atomically(verdict, text)
            except OSError as err:
                errors.append(err)
    writers = [threading.Thread(target=write, args=(text,)) for text in texts]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert errors == []
    assert verdict.read_text() in texts and list(verdict.parent.iterdir()) == [verdict]  # no partial file left


HANGING = """
import sys, threading
from pathlib import Path
from contract.hang import Progress
from trainers.hang_watch import HangWatch

def stuck_in_a_collective(event):
    event.wait()  # nobody sets it

def flight_recorder(folder, rank):  # what a backend adds to the stacks (NCCL's record, on GPUs)
    (folder / f"extra_rank_{rank}").write_text("collectives")

def broken(folder, rank):
    raise RuntimeError("no record here")

progress = Progress()
progress.on_hang += [broken, flight_recorder]
progress.at(1, 3, "step")
HangWatch(progress, Path(sys.argv[1]), 0, 1, 1.0, "attempt").start()
stuck_in_a_collective(threading.Event())
"""


def test_the_watcher_dumps_the_stacks_and_ends_a_process_that_hangs(tmp_path):
    proc = subprocess.run([sys.executable, "-c", HANGING, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr[-2000:]
    assert proc.stdout.startswith("hang: no rank advanced for 1 s; stuck: rank 0 (rank 0 at epoch 1 step 3 (step))")
    stacks = (tmp_path / "hang" / "rank0.txt").read_text()
    assert "in stuck_in_a_collective" in stacks  # the main thread's frame where it blocks
    assert "(broken failed: RuntimeError: no record here)" in stacks  # a backend's extra is best effort ...
    assert (tmp_path / "hang" / "extra_rank_0").read_text() == "collectives"  # ... and the next one still runs
    [verdict] = read_verdicts(tmp_path)
    assert verdict["stuck"] == [0] and verdict["positions"] == {"0": [1, 3, "step"]}
    assert json.loads((tmp_path / "progress" / "rank0.json").read_text())["where"] == [1, 3, "step"]
