"""The shared loop (trainers/loop.py) in-process, no Ray cluster: stop agreement, resume point, metric set and
checkpoint schema with a pure-Python adapter, then stop/resume parity for the PyTorch DDP adapter."""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from pipelines.data.mnist import mnist_schema
from contract.checkpoint import STATE_FILE, EpochTotals, TrainState
from contract.metrics import PendingReduce
from tests.support.loop_harness import (STOP_AT, Recorder, check_metric_set, check_stop_resume_parity, config,
                                make_context, mnist_columns, run_attempt, with_callbacks)
from contract.recipe import Monitor
from contract.resume import StepChecks
from contract.startup import STARTUP_PARTS, STARTUP_TOTAL, StartupMarks
from trainers.adapter import Adapter
from trainers.callbacks.mfu import Utilisation
from trainers.callbacks.profiling import Profiling
from trainers.callbacks.startup import StartupMetrics
from trainers.callbacks.step_bar import StepBars
from trainers.callbacks.world_sizes import WorldSizes
from trainers.loop import TrainLoop


class LineAdapter(Adapter):
    """Fits y = w x by SGD on a fixed data stream; the state is w (and the step count), in a JSON file.
    `passes` > 1 accumulates gradients like Horovod's backward_passes_per_step. One rank: reductions are the
    identity."""

    load_s = 0.25

    def __init__(self, steps: int = 25, passes: int = 1, text: bool = False):
        self.w, self.grad, self.pending, self.updates = 0.0, 0.0, 0, 0
        self.steps, self.passes, self.text = steps, passes, text

    def steps_per_epoch(self) -> int:
        return self.steps

    def batches(self, epoch: int, skip: int) -> Iterator[tuple[float, float]]:
        rng = np.random.default_rng(epoch)
        data = [(float(x), 3.0 * float(x)) for x in rng.normal(size=self.steps)]
        return iter(data[skip:])

    def train_step(self, batch: tuple[float, float]) -> tuple[float, int, int]:
        x, y = batch
        loss = (self.w * x - y) ** 2
        self.grad += 2 * (self.w * x - y) * x / self.passes
        self.pending += 1
        if self.pending == self.passes:
            self.finish_epoch()
        return loss, 4, 7 if self.text else 0

    def at_update_boundary(self) -> bool:
        return self.pending == 0

    def finish_epoch(self) -> None:
        if self.pending:
            self.w -= 0.05 * self.grad
            self.grad, self.pending, self.updates = 0.0, 0, self.updates + 1

    def evaluate(self, epoch: int) -> tuple[int, int]:
        return int(abs(self.w - 3.0) < 0.5), 1

    def reduce(self, values: list[float], op: str) -> list[float]:
        return values

    def reduce_later(self, values: list[float], op: str) -> PendingReduce:
        return lambda: list(values)

    def peak_memory_bytes(self) -> float:
        return 1.0

    def epoch_extras(self) -> dict[str, float]:
        return {"rank0.w": self.w}

    def save(self, directory: str) -> None:
        Path(directory, "line.json").write_text(json.dumps({"w": self.w, "updates": self.updates}))

    def load(self, directory: str) -> None:
        state = json.loads(Path(directory, "line.json").read_text())
        self.w, self.updates = state["w"], state["updates"]


@pytest.mark.parametrize("text", [False, True])
def test_loop_stop_resume_parity_and_metric_set(tmp_path, text):
    """Contract on a pure-Python adapter: stop at step 10 with a checkpoint, resume skipping the trained steps,
    the same curve, the exact metric set (tokens_per_s for text), extras logged, the epoch's totals continued."""
    runs = check_stop_resume_parity(lambda ctx: TrainLoop(LineAdapter(text=text), ctx).run(), tmp_path,
                                    epochs=3, text=text)
    straight = runs["straight"]
    assert straight.recorder.extras[3]["rank0.w"] == pytest.approx(3.0, abs=0.5)
    assert straight.recorder.epochs[1]["data_load_s"] == 0.25
    if text:
        epoch = straight.recorder.epochs[1]
        assert epoch["tokens_per_s"] == pytest.approx(25 * 7 / epoch["epoch_time_s"])


def test_rank0_prints_a_progress_line_per_epoch(tmp_path, capsys):
    """One line per epoch from rank 0 (the driver shows it through Ray's log), with the epoch's logged metrics;
    other ranks stay quiet."""
    quiet = run_attempt(lambda ctx: TrainLoop(LineAdapter(), ctx).run(), 1, 2, 2, tmp_path / "rank1")
    assert quiet.finished and capsys.readouterr().out == ""
    attempt = run_attempt(lambda ctx: TrainLoop(LineAdapter(), ctx).run(), 0, 1, 2, tmp_path / "rank0")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["epoch 1/2", "epoch 2/2"]
    for line, epoch in zip(lines, (1, 2)):
        metrics = attempt.recorder.epochs[epoch]
        assert f"train_loss {metrics['train_loss']:.4f}, test_accuracy {metrics['test_accuracy']:.4f}," in line


class BarRecord:
    """A `StepBar` that keeps what it was asked to show."""

    def __init__(self, description: str, total: int, done: int):
        self.description, self.total, self.shown, self.closed = description, total, done, False

    def update(self, n: int = 1) -> None:
        assert not self.closed
        self.shown += n

    def close(self) -> None:
        self.closed = True


def test_rank0_shows_each_epochs_steps_on_a_bar_a_resumed_epoch_from_its_stop(tmp_path):
    """`run.progress`: one bar per epoch over its steps, each step shown once and the bar closed at the epoch's end;
    the stopped epoch's bar closes at the stop, and the resumed one starts at the steps already trained."""
    bars: list[BarRecord] = []

    def run(ctx):
        def step_bar(description: str, total: int, done: int) -> BarRecord:
            bars.append(BarRecord(description, total, done))
            return bars[-1]
        return TrainLoop(LineAdapter(), with_callbacks(ctx, StepBars(step_bar))).run()

    straight = run_attempt(run, 0, 1, 2, tmp_path / "a")
    assert straight.finished
    assert [(b.description, b.total, b.shown, b.closed) for b in bars] == [("train epoch 1/2", 25, 25, True),
                                                                         ("train epoch 2/2", 25, 25, True)]
    bars.clear()
    stopped = run_attempt(run, 0, 1, 2, tmp_path / "b", stop=True)
    resumed = run_attempt(run, 0, 1, 2, tmp_path / "c", restored=stopped.checkpoint)
    assert resumed.finished
    assert [(b.description, b.shown, b.closed) for b in bars] == [("train epoch 1/2", STOP_AT, True),
                                                                 ("train epoch 1/2", 25, True),
                                                                 ("train epoch 2/2", 25, True)]


def test_a_call_of_several_steps_ends_before_a_step_a_callback_acts_at(tmp_path):
    """An adapter training 4 steps a call (a compiled TF loop's) begins a call at the step a fault is injected at
    (`FaultInjection.steps_to_boundary`), so it fires at that very step; the other calls stay 4 steps long."""
    from omegaconf import OmegaConf

    from trainers.callbacks.base import LoopCallback
    from trainers.callbacks.faults import FaultInjection

    class CallStarts(LoopCallback):
        def __init__(self):
            self.starts: list[int] = []

        def on_step_start(self, epoch: int, step: int) -> None:
            self.starts.append(step)

    fault = OmegaConf.create({"inject_at_step": 7, "inject_hang_at_step": None, "inject_at_epoch": None,
                              "inject_marker": str(tmp_path / "marker")})
    injection = FaultInjection(fault, 0, 2)  # rank 0 of 2: the fault is the last rank's, so it never fires here
    assert (injection.steps_to_boundary(5), injection.steps_to_boundary(7)) == (2, None)
    adapter, starts = LineAdapter(steps=13), CallStarts()
    adapter.steps_per_call = 4
    run = lambda ctx: TrainLoop(adapter, with_callbacks(ctx, injection, starts)).run()  # noqa: E731
    assert run_attempt(run, 0, 1, 1, tmp_path / "a").finished
    assert starts.starts == [1, 5, 7, 11]


def test_rank0_logs_where_the_startup_went_once_after_its_first_step(tmp_path):
    """`startup.*` (contract/startup.py): the driver's and the workers' parts from the marks, the data part from
    the adapter's load time, the model part up to the loop, the first step; logged once, at epoch 1, summing to
    the total."""
    now = time.time()
    marks = StartupMarks(asked=now - 10.0, trainer_built=now - 7.0, worker_began=now - 2.0)
    run = lambda ctx: TrainLoop(LineAdapter(), with_callbacks(ctx, StartupMetrics(marks))).run()  # noqa: E731
    extras = run_attempt(run, 0, 1, 2, tmp_path / "a").recorder.extras
    startup = {name: value for name, value in extras[1].items() if name.startswith("startup.")}
    assert sorted(startup) == sorted([*STARTUP_PARTS, STARTUP_TOTAL])
    driver, workers, data = (startup[f"startup.{part}_s"] for part in ("driver", "workers", "data"))
    assert (driver, workers, data) == (pytest.approx(3.0), pytest.approx(5.0), 0.25)
    assert 1.75 <= startup["startup.model_s"] < 60 and 0 <= startup["startup.first_step_s"] < 60
    assert sum(startup[name] for name in STARTUP_PARTS) == pytest.approx(startup[STARTUP_TOTAL])
    assert not [name for name in extras[2] if name.startswith("startup.")]  # once
    # no marks (other ranks, a restarted attempt): nothing
    plain = run_attempt(lambda ctx: TrainLoop(LineAdapter(), ctx).run(), 0, 1, 1, tmp_path / "b").recorder.extras
    assert not [name for name in plain[1] if name.startswith("startup.")]


def test_rank0_logs_the_achieved_flops_and_mfu_each_epoch(tmp_path):
    """`tflops_per_rank` from the model's FLOPs per sample and the epoch's samples/s; `mfu` only with a peak."""
    run = lambda ctx: TrainLoop(LineAdapter(), with_callbacks(ctx, Utilisation(3e9, 1e12))).run()  # noqa: E731
    attempt = run_attempt(run, 0, 1, 2, tmp_path / "a")
    for epoch in (1, 2):
        achieved = 3e9 * attempt.recorder.epochs[epoch]["samples_per_s"]
        assert attempt.recorder.extras[epoch]["tflops_per_rank"] == pytest.approx(achieved / 1e12)
        assert attempt.recorder.extras[epoch]["mfu"] == pytest.approx(achieved / 1e12)
    run = lambda ctx: TrainLoop(LineAdapter(), with_callbacks(ctx, Utilisation(3e9))).run()  # noqa: E731
    extras = run_attempt(run, 0, 1, 1, tmp_path / "b").recorder.extras[1]
    assert "tflops_per_rank" in extras and "mfu" not in extras  # a CPU: no peak to divide by


def test_checkpoint_schema_of_a_stopped_epoch(tmp_path):
    """train_state.json: the last finished epoch, its metrics, and the stopped epoch's totals."""
    run = lambda ctx: TrainLoop(LineAdapter(), ctx).run()  # noqa: E731
    first = run_attempt(run, 0, 1, 3, tmp_path / "a")
    stopped = run_attempt(run, 0, 1, 3, tmp_path / "b", restored=first.checkpoint, stop=False)
    assert stopped.finished and stopped.reports == []  # all epochs already done: nothing to train
    epoch2 = run_attempt(run, 0, 1, 2, tmp_path / "c")
    halted = run_attempt(run, 0, 1, 3, tmp_path / "d", restored=epoch2.checkpoint, stop=True)
    state = TrainState.read(halted.checkpoint)
    assert (state.epoch, state.partial.steps, state.partial.samples) == (2, STOP_AT, 4 * STOP_AT)
    assert state.metrics == epoch2.recorder.epochs[2]
    assert (halted.checkpoint / STATE_FILE).is_file() and (halted.checkpoint / "line.json").is_file()
    assert TrainState.read(halted.checkpoint).totals_for(3) == state.partial
    # another rank continues only its step count and the time: rank 0 holds the sums over all ranks
    assert TrainState.read(halted.checkpoint).totals_for(3, rank=1) == EpochTotals(steps=STOP_AT,
                                                                                   train_s=state.partial.train_s)
    assert TrainState.read(halted.checkpoint).totals_for(4) == EpochTotals()


def test_best_epoch_and_early_stopping(tmp_path):
    """The state keeps the best epoch of `run.monitor`; `run.patience` epochs without a better value end the run
    (finished, not stopped), and a restart from that checkpoint trains no more."""
    monitor = Monitor("train_loss", "max", patience=2)  # the loss falls every epoch: epoch 1 stays the best
    run = lambda ctx: TrainLoop(LineAdapter(), replace(ctx, monitor=monitor)).run()  # noqa: E731
    attempt = run_attempt(run, 0, 1, 6, tmp_path / "a")
    assert attempt.finished and sorted(attempt.recorder.epochs) == [1, 2, 3]
    state = TrainState.read(attempt.checkpoint)
    assert (state.epoch, state.best_epoch, state.best_value) == (3, 1, attempt.recorder.epochs[1]["train_loss"])
    again = run_attempt(run, 0, 1, 6, tmp_path / "b", restored=attempt.checkpoint)
    assert again.finished and again.reports == []
    # The default monitor, test_accuracy (max): the best is the latest of the epochs with the top value.
    plain = run_attempt(lambda ctx: TrainLoop(LineAdapter(), ctx).run(), 0, 1, 3, tmp_path / "c")
    accuracy = [plain.recorder.epochs[e]["test_accuracy"] for e in (1, 2, 3)]
    assert TrainState.read(plain.checkpoint).best_epoch == max((a, e + 1) for e, a in enumerate(accuracy))[1]


def test_stop_waits_for_the_update_boundary(tmp_path):
    """With 3 batches per update the agreement at step 10 falls inside an update: the loop goes on to the next
    multiple of the check that is a boundary (step 30... here the epoch's end), never losing gradients."""
    adapter = LineAdapter(steps=25, passes=3)
    attempt = run_attempt(lambda ctx: TrainLoop(adapter, ctx).run(), 0, 1, 1, tmp_path, stop=True)
    # 10 and 20 are not multiples of 3: no stop inside epoch 1, which finishes (and flushes the 25th batch).
    assert attempt.finished and adapter.updates == 9


def test_stop_and_timed_checkpoints_are_agreed_every_few_steps_step_counted_ones_need_no_collective(tmp_path):
    """A rank that has not seen STOP yet, or whose clock says no checkpoint is due, acts with the others (max over
    ranks), only every `every` steps; a checkpoint every n steps is due on every rank alike, with no collective."""
    calls = []

    def reduce(values, op):
        calls.append((values, op))
        return [max(values[0], 1.0), values[1]]  # another rank sees the file

    checks = StepChecks(tmp_path / "STOP", reduce, every=5)
    assert [checks(step, step)[0] for step in range(1, 11)] == [False] * 4 + [True] + [False] * 4 + [True]
    assert calls == [([0.0, 0.0], "max")] * 2
    assert StepChecks(None, reduce, every=1)(5, 5) == (False, False) and len(calls) == 2
    counted = StepChecks(None, reduce, every=5, every_n_steps=4)
    assert [counted(step, step)[1] for step in range(1, 5)] == [False, False, False, True]
    counted.checkpointed(4)
    assert counted.steps_to_next(5, 5) == 3 and not counted(7, 7)[1] and counted(8, 8)[1]
    assert len(calls) == 2
    timed = StepChecks(None, lambda values, op: [values[0], 1.0], every=5, every_s=3600.0)  # another rank is due
    assert timed(4, 4) == (False, False) and timed(5, 5) == (False, True)


def test_step_loss_all_reduce_runs_while_the_next_steps_train(tmp_path):
    """A logged step's all-reduce starts at that step and is waited for only at the next logged step, or at the
    epoch's end: the steps between train while it is in flight. Each step loss is still logged once, in order,
    at its value (the mean over one rank here)."""
    events, losses = [], {}

    class Recording(LineAdapter):
        def train_step(self, batch):
            loss, samples, tokens = super().train_step(batch)
            losses[len(losses) + 1] = loss
            events.append(f"step {len(losses)}")
            return loss, samples, tokens

        def reduce_later(self, values, op):
            step = len(losses)
            events.append(f"start {step}")
            return lambda: events.append(f"wait {step}") or values

    recorder = Recorder()
    ctx = make_context(0, 1, 2, tmp_path, recorder, [], log_every_n_steps=4)
    assert TrainLoop(Recording(steps=10), ctx).run()
    reductions = [event for event in events if not event.startswith("step")]
    assert reductions == ["start 4", "wait 4", "start 8", "wait 8",  # epoch 1 (steps 1-10) ends with 8's wait
                          "start 12", "wait 12", "start 16", "wait 16", "start 20", "wait 20"]
    for step in (4, 8, 12, 16):  # waited for at the next logged step, or (8) after the epoch's last step
        assert events.index(f"wait {step}") > events.index(f"step {step + (2 if step == 8 else 4)}")
    assert recorder.step_losses == {step: losses[step] for step in (4, 8, 12, 16, 20)}


def test_a_checkpoint_records_what_wrote_it(tmp_path):
    """The backend, model and number of workers of the run (`WorkerContext.origin`) and the size of every file
    beside the state, which a run resuming from it is checked against (pipelines/checks.py)."""
    from contract.checkpoint import checkpoint_mismatch, checkpoint_origin

    ctx = replace(make_context(0, 1, 1, tmp_path, Recorder(), []), origin=checkpoint_origin("ddp", "line", 3))
    assert TrainLoop(LineAdapter(), ctx).run()
    origin = json.loads((tmp_path / "checkpoint_1" / STATE_FILE).read_text())["origin"]
    files = {p.name: p.stat().st_size for p in (tmp_path / "checkpoint_1").iterdir() if p.name != STATE_FILE}
    assert origin == {"backend": "ddp", "model": "line", "world_size": 3, "files": files} and files
    assert checkpoint_mismatch(tmp_path / "checkpoint_1", "ddp", "line") is None
    assert "written by trainer=ddp model=line" in checkpoint_mismatch(tmp_path / "checkpoint_1", "fsdp", "line")
    # An elastic run's group taking over from it says its size, where it took over and why (`workers` tag).
    recorder = Recorder()
    resumed = with_callbacks(make_context(0, 1, 2, tmp_path / "resumed", recorder, [],
                                          restored=tmp_path / "checkpoint_1"), WorldSizes())
    assert TrainLoop(LineAdapter(), resumed).run()
    assert recorder.tags["workers"] == "1 from epoch 2 step 0 (shrunk from 3: workers lost)"


class DivergingAdapter(LineAdapter):
    """LineAdapter whose loss is NaN from its `bad`-th step on (a learning rate that blew the weights up)."""

    def __init__(self, bad: int):
        super().__init__()
        self.bad, self.trained = bad, 0

    def train_step(self, batch: tuple[float, float]) -> tuple[float, int, int]:
        loss, samples, tokens = super().train_step(batch)
        self.trained += 1
        return (float("nan") if self.trained >= self.bad else loss), samples, tokens


@pytest.mark.parametrize("log_every, where", [(1, (2.0, 32.0)), (4, (2.0, 40.0)), (0, (2.0, 0.0))])
def test_a_loss_that_is_no_number_ends_the_run_without_a_checkpoint_of_it(tmp_path, log_every, where):
    """From step 30 on (epoch 2 of 25-step epochs) the loss is NaN: after `nan_patience` logged step losses in a
    row (steps 30-32; every 4th step: 32, 36, 40), or without step losses at the epoch's mean, every rank reports
    where and trains no more. The last checkpoint is epoch 1's, the last finite state; no epoch 2 is logged."""
    recorder, reports = Recorder(), []
    ctx = replace(make_context(0, 1, 3, tmp_path, recorder, reports, log_every_n_steps=log_every), nan_patience=3)
    adapter = DivergingAdapter(bad=30)
    assert TrainLoop(adapter, ctx).run()
    assert len(reports) == 2 and (reports[1]["diverged_at_epoch"], reports[1]["diverged_at_step"]) == where
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_1"]  # epoch 1's; none after it
    assert list(recorder.epochs) == [1]
    # a logged step's all-reduce is settled at the next logged step: the loop notices one logged step later
    assert adapter.trained == {1: 33, 4: 44, 0: 50}[log_every]


def test_ddp_adapter_stop_resume_parity(tmp_path):
    """The PyTorch adapter (one rank; DDP's loop) with SGD momentum, a cosine schedule with warmup, clipping and
    2 batches per update: the resumed run restores weights, momentum buffers, the schedule's position and the
    epoch's totals, and its loss curve equals the uninterrupted one exactly."""
    from trainers.adapter import WorkerData
    from trainers.torch.adapter import DENSE_STATE_FILE
    from trainers.torch.ddp import DDP
    from trainers.torch.data import ShardBatches

    cfg = config(tmp_path, ["trainer.batch_size=16", "trainer.optimizer=sgd", "trainer.lr=0.01", "model.hidden=[32]",
                            "model.dropout=0", "trainer.epochs=2", "trainer.num_workers=1",
                            # the recipe: the schedule's position must survive the stop (at update 5 of 20)
                            "trainer.lr_schedule=cosine", "trainer.warmup_steps=3", "trainer.grad_clip=1.0",
                            "trainer.grad_accum=2"])
    columns = {k: torch.from_numpy(v) for k, v in mnist_columns(320).items()}
    evaluation = {k: torch.from_numpy(v) for k, v in mnist_columns(64, seed=1).items()}

    def data(seed):
        return (ShardBatches.from_columns(columns, mnist_schema(), 16, seed),
                ShardBatches.from_columns(evaluation, mnist_schema(), 64, seed))

    def run(ctx):
        return DDP().run_worker(cfg, ctx, WorkerData(mnist_schema(), data))

    runs = check_stop_resume_parity(run, tmp_path, rtol=0, atol=0)
    assert len(runs["straight"].recorder.step_losses) == 40  # 320 rows / 16 x 2 epochs
    state = torch.load(runs["stopped"].checkpoint / DENSE_STATE_FILE, weights_only=False)
    assert {"momentum_buffer"} <= set(state["optimizer"]["state"][0])
    assert state["scheduler"]["last_epoch"] == STOP_AT // 2  # updates taken before the stop
    check_metric_set(runs["resumed"].recorder, 2, text=False)


def test_an_augmented_cnn_resumes_its_shifted_batches_exactly(tmp_path):
    """`model=cnn data.augment=true` (random shifts): the run stopped at step 10 and resumed trains the uninterrupted
    run's loss curve exactly (each sample's shift comes from its key, whichever attempt draws it), which is not the
    curve of the same run without shifts."""
    from trainers.adapter import WorkerData
    from trainers.models import training_augment
    from trainers.torch.ddp import DDP
    from trainers.torch.data import ShardBatches

    overrides = ["model=cnn", "model.channels=[4,8]", "model.hidden=16", "model.dropout=0", "trainer.batch_size=16",
                 "trainer.optimizer=sgd", "trainer.lr=0.05", "trainer.epochs=2", "trainer.num_workers=1"]
    columns = {k: torch.from_numpy(v) for k, v in mnist_columns(320).items()}
    evaluation = {k: torch.from_numpy(v) for k, v in mnist_columns(64, seed=1).items()}

    def runner(cfg):
        def data(seed):
            return (ShardBatches.from_columns(columns, mnist_schema(), 16, seed, augment=training_augment(cfg)),
                    ShardBatches.from_columns(evaluation, mnist_schema(), 64, seed))
        return lambda ctx: DDP().run_worker(cfg, ctx, WorkerData(mnist_schema(), data))

    augmented = config(tmp_path / "augmented", [*overrides, "data.augment=true"])
    runs = check_stop_resume_parity(runner(augmented), tmp_path / "augmented", rtol=0, atol=0)
    plain = run_attempt(runner(config(tmp_path / "plain", overrides)), 0, 1, 2, tmp_path / "plain")
    shifted = runs["straight"].recorder.step_losses
    assert len(shifted) == 40 and all(shifted[step] != plain.recorder.step_losses[step] for step in range(1, 41))


def test_rank0_profiles_its_first_steps_into_the_run(tmp_path):
    """`trainer.profile_steps=3` with the PyTorch adapter: rank 0 records 3 training steps (forward, backward,
    optimizer) after a warmup step with torch.profiler, writes a Chrome trace and hands the folder to its logger for the
    run's `profile/` artifacts; training goes on unprofiled."""
    from trainers.adapter import WorkerData
    from trainers.torch.data import ShardBatches
    from trainers.torch.ddp import DDP

    cfg = config(tmp_path, ["trainer.batch_size=16", "trainer.optimizer=sgd", "model.hidden=[16]",
                            "trainer.epochs=1", "trainer.num_workers=1", "trainer.profile_steps=3"])
    columns = {k: torch.from_numpy(v) for k, v in mnist_columns(128).items()}

    def data(seed):
        return (ShardBatches.from_columns(columns, mnist_schema(), 16, seed),
                ShardBatches.from_columns(columns, mnist_schema(), 64, seed))

    recorder, reports = Recorder(), []
    ctx = with_callbacks(make_context(0, 1, 1, tmp_path / "checkpoints", recorder, reports),
                         Profiling(tmp_path / "profile", cfg.trainer.profile_steps))
    assert DDP().run_worker(cfg, ctx, WorkerData(mnist_schema(), data))
    events = json.loads((tmp_path / "profile" / "trace_rank0.json").read_text())["traceEvents"]
    names = [event.get("name", "") for event in events]
    assert sorted({name for name in names if name.startswith("ProfilerStep#")}) == [
        "ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]  # after one warmup step
    assert sum(name.startswith("Optimizer.step#SGD") for name in names) == 3
    assert recorder.artifacts == [(str(tmp_path / "profile"), "profile")]
    assert len(recorder.step_losses) == 8  # all 128 / 16 steps trained


def test_stragglers_are_ranks_whose_own_time_exceeds_the_others_median():
    from contract.stragglers import RankTimes, gathered, stragglers

    def times(*own_ms, step_ms=20.0):
        return [RankTimes(step_ms, data_wait_ms=own * 0.75, forward_ms=own * 0.25) for own in own_ms]
    assert [r for r, _, _ in stragglers(times(1.0, 1.2, 9.0, 1.1), ratio=2.0)] == [2]
    assert stragglers(times(1.0, 1.2, 3.0, 1.1), ratio=3.0) == []  # under the ratio
    assert stragglers(times(0.1, 0.1, 0.9, 0.1), ratio=2.0) == []  # 9x, but 4% of a 20 ms step
    assert stragglers(times(1.0, 9.0), ratio=0) == []  # off
    assert stragglers(times(9.0), ratio=2.0) == []  # one rank
    # Gathering: each rank fills its slots of one summed vector.
    each, contributed = times(1.0, 2.0, 3.0), []
    for rank, own in enumerate(each):
        gathered(own, rank, 3, lambda vector: contributed.append(vector) or vector)
    summed = [sum(column) for column in zip(*contributed)]
    assert gathered(each[0], 0, 3, lambda vector: summed) == each


def test_checkpoints_inside_epochs_resume_at_their_step(tmp_path):
    """`run.checkpoint_every_n_steps=7`: a checkpoint of the half-done epoch every 7 steps since the last one (an
    epoch's end counting as one), its report without an epoch's metrics; a run restarted from one trains the rest of the
    epoch, and its loss curve and epoch metrics are the uninterrupted run's."""
    run = lambda ctx: TrainLoop(LineAdapter(), replace(ctx, checkpoint_every_n_steps=7)).run()  # noqa: E731
    straight = run_attempt(run, 0, 1, 2, tmp_path / "straight")
    inside = {(int(report["checkpoint_at_epoch"]), int(report["checkpoint_at_step"])): number
              for number, report in enumerate(straight.reports, 1) if "checkpoint_at_step" in report}
    assert list(inside) == [(1, 7), (1, 14), (1, 21), (2, 7), (2, 14), (2, 21)]  # 25 steps an epoch
    assert not any("test_accuracy" in straight.reports[number - 1] for number in inside.values())  # no epoch's
    for epoch in (1, 2):  # what they held training up, apart from the epoch end's checkpoint
        assert straight.recorder.extras[epoch]["step_checkpoints"] == 3
        taken_s = straight.recorder.extras[epoch]["step_checkpoints_s"]
        assert 0 < taken_s < straight.recorder.epochs[epoch]["epoch_time_s"]
    checkpoint = tmp_path / "straight" / f"checkpoint_{inside[(2, 14)]}"
    state = TrainState.read(checkpoint)
    assert (state.epoch, state.partial.steps) == (1, 14)
    resumed = run_attempt(run, 0, 1, 2, tmp_path / "resumed", restored=checkpoint)
    assert resumed.finished and sorted(resumed.recorder.step_losses) == list(range(40, 51))  # the rest of epoch 2
    assert resumed.recorder.extras[2]["step_checkpoints"] == 1  # at step 21 of epoch 2
    assert [resumed.recorder.step_losses[step] for step in range(40, 51)] == \
        [straight.recorder.step_losses[step] for step in range(40, 51)]
    for key in ("train_loss", "test_accuracy"):
        assert resumed.recorder.epochs[2][key] == pytest.approx(straight.recorder.epochs[2][key], rel=1e-12)


def test_a_streamed_run_takes_the_learning_rates_of_the_cached_run_step_for_step(tmp_path):
    """A cosine schedule with warmup over 2 epochs, the same 330 rows held in memory (`ShardBatches`) or streamed
    from 4 files (`StreamedBatches`: the epoch's length known from the files' row counts, not from reading them):
    the learning rate of every step, the short last batch's included, is the cached run's."""
    from contract.stream_order import StreamOrder
    from trainers.adapter import WorkerData
    from trainers.callbacks.base import LoopCallback
    from tests.support.streamed import in_process
    from trainers.streamed import SplitFiles, StreamedRows
    from trainers.torch.ddp import DDP
    from trainers.torch.data import ShardBatches, StreamedBatches

    file_rows, schema = [100, 60, 120, 50], mnist_schema()
    columns = mnist_columns(sum(file_rows))
    starts = np.cumsum([0, *file_rows])
    files = {f"f{i}": {c: v[starts[i]:starts[i + 1]] for c, v in columns.items()} for i in range(len(file_rows))}

    def read(paths: list[str], names: list[str]) -> Iterator[dict[str, np.ndarray]]:
        yield {c: np.concatenate([files[p][c] for p in paths]) for c in names}

    def streamed(seed: int) -> StreamedBatches:
        rows = StreamedRows(SplitFiles(list(files), file_rows), ["image", "label"], StreamOrder(file_rows, 100, seed),
                            16, 1, 0, read=in_process(read), stored=schema.stored_columns)
        return StreamedBatches(rows, schema)

    def held(seed: int) -> ShardBatches:
        return ShardBatches.from_columns({c: torch.from_numpy(v) for c, v in columns.items()}, schema, 16, seed)

    cfg = config(tmp_path, ["trainer.batch_size=16", "trainer.optimizer=sgd", "trainer.lr=0.05", "model.hidden=[16]",
                            "trainer.epochs=2", "trainer.num_workers=1", "trainer.lr_schedule=cosine",
                            "trainer.warmup_steps=5"])

    class LearningRates(LoopCallback):
        def __init__(self):
            self.adapter, self.rates = None, []

        def on_step_start(self, epoch: int, step: int) -> None:
            self.rates.append(self.adapter.optimizer.param_groups[0]["lr"])

    def rates(batches) -> list[float]:
        recorded = LearningRates()

        def run(ctx):
            recorded.adapter = DDP().build_adapter(cfg, ctx, WorkerData(schema, lambda seed: (batches(seed),
                                                                                               held(seed))))
            return DDP().train(cfg, with_callbacks(ctx, recorded), recorded.adapter)
        assert run_attempt(run, 0, 1, 2, tmp_path / batches.__name__).finished
        return recorded.rates

    cached = rates(held)
    assert len(cached) == 2 * 21 and cached[0] < cached[4] and cached[-1] < cached[21]  # warmup, then decay
    assert rates(streamed) == cached
