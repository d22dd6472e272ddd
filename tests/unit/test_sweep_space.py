"""The sweep's plan before Ray starts: grid expansion, override merging, and every rejection reason."""
from __future__ import annotations

import os

import pytest

from contract.config import TRAINER_SCHEMAS, parallel_degrees
from pipelines.config import ConfigError
from pipelines.sweep_space import (expand_grid, load_sweep, max_concurrent, merge_overrides, plan_trials,
                                   reject_unfit, split_argv)


@pytest.fixture()
def fake_imdb(tmp_path) -> str:
    (tmp_path / "manifest.json").write_text("{}")  # config checks only that a prepared dataset is there
    return f"data.path={tmp_path}"


def test_expand_grid_is_the_union_of_products_in_order_without_duplicates():
    grids = [{"trainer": ["ddp"], "trainer.num_workers": [1, 2]},
             {"trainer": ["tp", "ddp"], "trainer.num_workers": [2]}]
    assert expand_grid(grids) == [
        {"trainer": "ddp", "trainer.num_workers": 1}, {"trainer": "ddp", "trainer.num_workers": 2},
        {"trainer": "tp", "trainer.num_workers": 2}]  # (ddp, 2) of the second grid is already there


def test_merge_overrides_last_wins_and_groups_come_first():
    merged = merge_overrides(["data=imdb", "trainer.epochs=3"], ["trainer.epochs=1"],
                             ["trainer.lr=0.1", "trainer=tp"])
    assert merged == ["data=imdb", "trainer=tp", "trainer.epochs=1", "trainer.lr=0.1"]


def test_split_argv_separates_sweep_and_training_overrides():
    assert split_argv(["sweep=smoke", "sweep.metric=train_loss", "trainer.epochs=2"]) == (
        "smoke", ["sweep.metric=train_loss"], ["trainer.epochs=2"])
    assert split_argv([])[0] == "parallelism"


def test_smoke_plan_keeps_the_possible_points_and_says_why_the_others_are_rejected(fake_imdb):
    trials = plan_trials(load_sweep("smoke", []), [fake_imdb])
    reject_unfit(trials, cluster_cpus=6, cluster_gpus=0)
    valid = {(t.cfg.trainer.backend, t.cfg.trainer.num_workers, *reversed(parallel_degrees(t.cfg.trainer)))
             for t in trials if t.cfg is not None}
    assert valid == {("ddp", 1, 1, 1), ("ddp", 2, 1, 2), ("tp", 2, 2, 1)}
    reasons = {(t.combo["trainer"], t.combo["trainer.num_workers"], t.combo.get("trainer.tp")): t.reason
               for t in trials if t.cfg is None}
    assert len(reasons) == 6
    assert reasons[("ddp", 8, None)].startswith("cluster: needs 10 CPUs (8 workers x 1 threads")
    assert reasons[("tp", 2, 4)] == "trainer.tp: tp=4 does not divide num_workers=2"
    assert reasons[("tp", 2, 1)] == "trainer.dp: tp*dp=1*1=1 != num_workers=2"
    assert reasons[("tp", 4, 4)] == "trainer.tp: tp=4 does not divide the model's heads=2"


def test_every_trial_gets_the_base_then_cli_then_grid_values(fake_imdb):
    trials = plan_trials(load_sweep("smoke", []), [fake_imdb, "trainer.epochs=1", "trainer.lr=0.5"])
    first = trials[0].cfg
    assert first.model.hidden == 32 and first.trainer.epochs == 1  # base from the yaml, epochs from the CLI
    assert first.trainer.lr == 0.002  # the grid's value beats the CLI's


def test_gpu_trials_need_gpus(fake_imdb):
    trials = plan_trials(load_sweep("smoke", []), [fake_imdb, "trainer.use_gpu=true"])
    reject_unfit(trials, cluster_cpus=64, cluster_gpus=1)
    reasons = [t.reason for t in trials if t.reason.startswith("cluster")]
    assert "cluster: needs 2 GPUs (2 workers), the cluster has 1" in reasons
    assert [t.cfg.trainer.num_workers for t in trials if t.cfg is not None] == [1]


def test_max_concurrent_follows_the_largest_trial(fake_imdb):
    trials = [t for t in plan_trials(load_sweep("smoke", []), [fake_imdb]) if t.cfg is not None]
    trials = [t for t in trials if t.cfg.trainer.num_workers <= 2]
    assert max_concurrent(trials, cluster_cpus=6, cluster_gpus=0, requested=None) == 1  # 2 workers + 2 = 4 CPUs
    assert max_concurrent(trials, cluster_cpus=16, cluster_gpus=0, requested=None) == 4
    assert max_concurrent(trials, cluster_cpus=16, cluster_gpus=0, requested=2) == 2
    assert max_concurrent(trials, cluster_cpus=16, cluster_gpus=0, requested=9) == 4  # never more than fits


@pytest.mark.parametrize("override, message", [
    ("sweep.scheduler=random", r"^sweep\.scheduler: unknown 'random'"),
    ("sweep.mode=up", r"^sweep\.mode: unknown 'up'"),
    ("sweep.metric=nope", r"^sweep\.metric: 'nope' is not a report column"),
    ("sweep.max_concurrent_trials=0", r"^sweep\.max_concurrent_trials: must be >= 1"),
    ("sweep.grid=[]", r"^sweep\.grid: expected a mapping or a list of non-empty mappings"),
    ("sweep.grid=[{trainer.lr: 0.1}]", r"^sweep\.grid: 'trainer.lr' needs a non-empty list"),
])
def test_bad_sweep_config_names_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_sweep("smoke", [override])


def test_asha_needs_a_metric_every_epoch_reports():
    spec = load_sweep("smoke", ["sweep.scheduler=asha", "sweep.metric=train_loss", "sweep.mode=min"])
    assert (spec.scheduler, spec.metric, spec.mode) == ("asha", "train_loss", "min")
    with pytest.raises(ConfigError, match=r"^sweep\.metric: asha needs a metric every epoch reports"):
        load_sweep("smoke", ["sweep.scheduler=asha", "sweep.metric=efficiency"])


def test_unknown_sweep_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^overrides: .*sweep.*nope"):
        load_sweep("nope", [])


def test_cli_with_no_valid_trial_exits_2_before_ray(fake_imdb, capsys):
    from pipelines.sweep import main

    assert main(["sweep=smoke", fake_imdb, "sweep.overrides=['data=imdb','model=mlp']"]) == 2
    err = capsys.readouterr().err
    assert "sweep.grid: no valid trial" in err
    assert "model.name: model 'mlp' does not fit data 'imdb'" in err


def test_mnist_backends_sweep_has_every_backend_that_trains_the_mlp(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")  # config checks only that a prepared dataset is there
    trials = plan_trials(load_sweep("mnist_backends", []), [f"data.path={tmp_path}"])
    assert all(t.cfg is not None for t in trials), [t.reason for t in trials]
    assert {t.cfg.trainer.backend for t in trials} == set(TRAINER_SCHEMAS) - {"tp"}  # tp trains the bert model only


def test_without_a_cluster_trials_with_more_worker_threads_than_cpus_are_rejected(fake_imdb, monkeypatch, capsys):
    from pipelines.sweep import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    too_many = len(os.sched_getaffinity(0)) + 1
    assert main(["sweep=smoke", fake_imdb, f"sweep.grid=[{{trainer:[ddp],trainer.num_workers:[{too_many}]}}]"]) == 2
    assert f"trainer.num_workers: {too_many} workers x 1 thread(s) need {too_many} CPUs" in capsys.readouterr().err
