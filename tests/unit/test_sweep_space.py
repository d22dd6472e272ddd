"""The sweep's plan before Ray starts: grid expansion, override merging, and every rejection reason."""
from __future__ import annotations

import re
import os

import numpy as np
import pytest

from contract.config import layout_of
from contract.registry import BACKENDS
from pipelines.config import ConfigError
from pipelines.sweep.space import (expand_grid, load_sweep, max_concurrent, merge_overrides, plan_trials,
                                   reject_unfit, split_argv, stop_thresholds, trial_name)


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


def test_distributions_are_drawn_per_sample_within_their_bounds_and_repeatably():
    space = [{"trainer": ["ddp", "tp"], "trainer.lr": {"loguniform": [1e-4, 1e-2]},
              "trainer.batch_size": {"randint": [8, 64]}, "trainer.optimizer": {"choice": ["adam", "sgd"]},
              "model.dropout": {"uniform": [0.0, 0.5]}}]
    points = expand_grid(space, num_samples=3, seed=7)
    assert [p["trainer"] for p in points] == ["ddp", "tp"] * 3  # Tune's order: the whole grid per sample
    assert all(list(p) == list(space[0]) for p in points)
    assert all(1e-4 <= p["trainer.lr"] <= 1e-2 and 0.0 <= p["model.dropout"] <= 0.5 for p in points)
    assert all(isinstance(p["trainer.batch_size"], int) and 8 <= p["trainer.batch_size"] < 64 for p in points)
    assert {p["trainer.optimizer"] for p in points} <= {"adam", "sgd"}
    assert len({p["trainer.lr"] for p in points}) == 6  # a fresh draw for every trial
    assert all(p["trainer.lr"] == float(f"{p['trainer.lr']:.4g}") for p in points)  # as its override says
    assert expand_grid(space, num_samples=3, seed=7) == points
    assert expand_grid(space, num_samples=3, seed=8) != points


def test_loguniform_draws_spread_over_the_decades():
    points = expand_grid([{"trainer.lr": {"loguniform": [1e-5, 1e-1]}}], num_samples=400, seed=0)
    decades = np.floor(np.log10([p["trainer.lr"] for p in points]))
    assert set(np.unique(decades)) == {-5, -4, -3, -2}
    assert min(np.bincount((decades + 5).astype(int))) > 60  # ~100 each; uniform on the value would put ~90% in one


def test_random_trials_are_validated_like_grid_points(fake_imdb):
    spec = load_sweep("smoke", ["sweep.num_samples=2", "sweep.seed=3",
                                "sweep.grid=[{trainer:[tp],trainer.num_workers:[2],trainer.tp:{choice:[1,2]},"
                                "trainer.dp:[1],trainer.lr:{loguniform:[0.0001,0.01]}}]"])
    trials = plan_trials(spec, [fake_imdb])
    assert len(trials) == 2
    for trial in trials:
        assert f"trainer.lr={trial.combo['trainer.lr']}" in trial.overrides
        if trial.combo["trainer.tp"] == 1:
            assert trial.cfg is None and trial.reason.startswith("trainer.dp: tp*dp=1*1=1 != num_workers=2")
        else:
            assert trial.cfg.trainer.lr == trial.combo["trainer.lr"]


def test_stop_thresholds_are_reached_from_below_and_losses_from_above():
    from pipelines.sweep.run import ReachedStop

    spec = load_sweep("smoke", ["sweep.stop={test_accuracy: 0.9, train_loss: 0.2}"])
    stop = ReachedStop(stop_thresholds(spec))
    assert stop.thresholds == {"test_accuracy": (0.9, "max"), "train_loss": (0.2, "min")}
    assert not stop("t", {"test_accuracy": 0.89, "train_loss": 0.21})
    assert stop("t", {"test_accuracy": 0.9, "train_loss": 0.5}) and stop("t", {"train_loss": 0.2})
    assert not stop("t", {"samples_per_s": 1e9})


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
    layouts = [(t.cfg.trainer, layout_of(t.cfg.trainer)) for t in trials if t.cfg is not None]
    valid = {(trainer.backend, trainer.num_workers, layout.tp, layout.dp) for trainer, layout in layouts}
    assert valid == {("ddp", 1, 1, 1), ("ddp", 2, 1, 2)}
    reasons = {(t.combo["trainer"], t.combo["trainer.num_workers"], t.combo.get("trainer.tp")): t.reason
               for t in trials if t.cfg is None}
    assert len(reasons) == 5
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
    ("sweep.grid=[{trainer.lr: 0.1}]", r"^sweep\.grid: 'trainer.lr' needs a list of values or one of \{choice"),
    ("sweep.grid=[{trainer.lr: []}]", r"^sweep\.grid: 'trainer.lr' needs a non-empty list"),
    ("sweep.grid=[{trainer.lr: {normal: [0, 1]}}]", r"^sweep\.grid: 'trainer.lr' needs a list of values or one of"),
    ("sweep.grid=[{trainer.lr: {uniform: [0.1, 0.01]}}]", r"^sweep\.grid: 'trainer.lr': uniform needs \[low, high\]"),
    ("sweep.grid=[{trainer.lr: {loguniform: [0, 0.1]}}]", r"^sweep\.grid: 'trainer.lr': loguniform needs low > 0"),
    ("sweep.grid=[{trainer.batch_size: {randint: [8, 64.5]}}]", r"^sweep\.grid: 'trainer.batch_size': randint needs "
                                                                 r"integers"),
    ("sweep.grid=[{trainer.batch_size: {choice: []}}]",
     r"^sweep\.grid: 'trainer.batch_size': choice needs a non-empty"),
    ("sweep.num_sample=3", r"^sweep\.num_sample: not a sweep key \(did you mean sweep\.num_samples\?\)"),
    ("sweep.time_budget_s=0", r"^sweep\.time_budget_s: must be > 0"),
    ("sweep.num_samples=0", r"^sweep\.num_samples: must be >= 1"),
    ("sweep.stop={efficiency: 0.9}", r"^sweep\.stop: 'efficiency' is not an epoch metric"),
    ("sweep.stop={test_accuracy: high}", r"^sweep\.stop: 'test_accuracy' needs a number"),
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
    with pytest.raises(ConfigError, match=r"^sweep: unknown choice 'nope' \(choices: mnist_backends, parallelism, "
                                          r"pbt_mnist, smoke\)$"):
        load_sweep("nope", [])


def test_a_sweep_file_of_the_users_composes_and_takes_overrides_like_a_preset(tmp_path, fake_imdb):
    mine = tmp_path / "hidden_sizes.yaml"
    mine.write_text("overrides: [model=mlp, trainer.epochs=1]\n"
                    "grid:\n  trainer: [ddp]\n  trainer.lr: [0.01]\n  model.hidden: [[8], [16]]\n")
    spec = load_sweep(str(mine), ["sweep.max_concurrent_trials=1"])
    assert (spec.name, spec.max_concurrent_trials, spec.scheduler) == ("hidden_sizes", 1, "fifo")
    trials = plan_trials(spec, [fake_imdb])
    assert [t.cfg.model.hidden for t in trials] == [[8], [16]]
    # The run names tell the trials apart by the grid key the layout part leaves out.
    assert [trial_name(t) for t in trials] == ["ddp-w2-tp1-dp2-bs128-lr0.01-model.hidden=[8]",
                                               "ddp-w2-tp1-dp2-bs128-lr0.01-model.hidden=[16]"]

    with pytest.raises(ConfigError, match=r"^sweep: .*/nope\.yaml: no such file$"):
        load_sweep(str(tmp_path / "nope.yaml"), [])
    mine.write_text("grid: [1, 2\n")
    with pytest.raises(ConfigError,
                       match=r"^sweep: .*hidden_sizes\.yaml:2:1: not a readable YAML file \(while parsing"):
        load_sweep(str(mine), [])
    mine.write_text("- trainer.lr\n")
    with pytest.raises(ConfigError, match=r"^sweep: .*hidden_sizes\.yaml: holds a ListConfig, not a mapping"):
        load_sweep(str(mine), [])


def test_an_unparsable_sweep_file_names_its_line_and_column(tmp_path):
    """YAML's own place of the error, 1-based, as `file:line:column`, on one line."""
    mine = tmp_path / "my.yaml"
    mine.write_text("overrides: [model=mlp]\ngrid:\n  trainer.lr: [0.1, 0.01\n  model.hidden: [8]\n")
    with pytest.raises(ConfigError) as err:
        load_sweep(str(mine), [])
    assert str(err.value) == (f"sweep: {mine}:4:15: not a readable YAML file (while parsing a flow sequence: "
                              f"expected ',' or ']', but got ':')")
    mine.write_text("grid:\n  trainer: ddp: fsdp\n")
    with pytest.raises(ConfigError) as err:
        load_sweep(str(mine), [])
    assert str(err.value) == f"sweep: {mine}:2:15: not a readable YAML file (mapping values are not allowed here)"


def test_cli_with_no_valid_trial_exits_2_before_ray(fake_imdb, capsys):
    from pipelines.sweep.run import main

    assert main(["sweep=smoke", fake_imdb, "sweep.overrides=['data=imdb','model=mlp']"]) == 2
    err = capsys.readouterr().err
    assert "sweep.grid: no valid trial" in err
    assert "model.name: model 'mlp' takes image/numeric features; 'imdb' has tokens features" in err


def test_points_rejected_for_one_reason_are_one_line(tmp_path, capsys):
    """A data path that every point shares and none finds: one line saying so, not one per point."""
    from pipelines.sweep.run import main

    assert main(["sweep=mnist_backends", f"data.path={tmp_path / 'none'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(rf"error: sweep\.grid: no valid trial: every point \(\d+\) rejected: data\.path: no prepared "
                        rf"dataset at '{tmp_path / 'none'}' \(missing manifest\.json\); prepare your own table there "
                        rf"with .* or `rtp prepare mnist --out {tmp_path / 'none'}`", err), err


def test_mnist_backends_sweep_has_every_backend_that_trains_the_mlp(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")  # config checks only that a prepared dataset is there
    trials = plan_trials(load_sweep("mnist_backends", []), [f"data.path={tmp_path}"])
    assert all(t.cfg is not None for t in trials), [t.reason for t in trials]
    assert {t.cfg.trainer.backend for t in trials} == set(BACKENDS.names()) - {"tp"}  # tp trains the bert model only
    assert {t.cfg.trainer.tf_loop for t in trials if t.cfg.trainer.backend == "tf_mwms"} == {"fit", "custom"}
    assert {t.cfg.trainer.framework for t in trials if t.cfg.trainer.backend == "horovod"} == {"torch", "tf"}


def test_without_a_cluster_trials_with_more_worker_threads_than_cpus_are_rejected(fake_imdb, monkeypatch, capsys):
    from pipelines.sweep.run import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    too_many = len(os.sched_getaffinity(0)) + 1
    assert main(["sweep=smoke", fake_imdb, f"sweep.grid=[{{trainer:[ddp],trainer.num_workers:[{too_many}]}}]"]) == 2
    assert f"trainer.num_workers: {too_many} workers x 1 thread(s) need {too_many} CPUs" in capsys.readouterr().err


def test_trial_outcomes_from_tune_results():
    """How each way a trial can end is recorded, from real Tune `Result`s: early stops finish, a failure fails,
    and trials the time budget cut short before their first epoch are KILLED without counting as failures."""
    from ray.tune import Result

    from pipelines.sweep.run import outcome_of

    def result(metrics=None, error=None) -> Result:
        return Result(metrics=metrics, checkpoint=None, error=error, path="")

    full, early = outcome_of(result({"train_loss": 0.5, "epoch": 3}), 3, False), outcome_of(
        result({"train_loss": 0.5, "epoch": 1}), 3, False)
    assert (full.status, full.early_stop, full.failed) == ("FINISHED", None, False)
    assert (early.status, early.early_stop, early.failed) == ("FINISHED", 1, False)
    broken = outcome_of(result(error=RuntimeError("boom")), 3, False)
    assert (broken.status, broken.message, broken.failed) == ("FAILED", "RuntimeError: boom", True)
    stopped = outcome_of(result({"stopped_at_epoch": 1.0, "stopped_at_step": 5.0}), 3, False)
    assert (stopped.status, stopped.message, stopped.failed) == ("KILLED", "stopped on request at epoch 1 step 5", True)
    assert stopped.stopped_at == "epoch 1 step 5"  # the child run's `preempted_at`, as a single run's
    not_run = outcome_of(None, 3, False)
    assert not_run.message == "not run: the sweep stopped first" and not_run.failed
    for cut in (outcome_of(None, 3, True), outcome_of(result({}), 3, True)):
        assert (cut.status, cut.failed) == ("KILLED", False) and "time budget" in cut.message
    assert outcome_of(result({}), 3, False).failed  # no budget: a trial without an epoch did not finish


@pytest.mark.parametrize("overrides, message", [
    (["sweep.mutations=null"], r"^sweep\.mutations: pbt needs \{recipe key"),
    (["sweep.mutations={trainer.optimizer: [adam]}"],
     r"^sweep\.mutations: 'trainer.optimizer' cannot change between checkpoints"),
    (["sweep.mutations={trainer.momentum: {uniform: [0.9, 0.1]}}"],
     r"^sweep\.mutations: 'trainer.momentum': uniform needs \[low, "),
    (["sweep.pbt_quantile=0.6"], r"^sweep\.pbt_quantile: must be in \(0, 0\.5\]"),
    (["sweep.pbt_interval=0"], r"^sweep\.pbt_interval: must be >= 1 epoch"),
    (["sweep.scheduler=fifo"], r"^sweep\.mutations: only the pbt scheduler mutates trials"),
    (["sweep.metric=efficiency"], r"^sweep\.metric: pbt needs a metric every epoch reports"),
])
def test_bad_pbt_config_names_the_key(overrides, message):
    from pipelines.sweep.pbt import mutations

    with pytest.raises(ConfigError, match=message):
        mutations(load_sweep("pbt_mnist", overrides))


def test_pbt_rejects_trials_a_mutation_would_make_invalid_and_keeps_perturbations_in_range(tmp_path):
    """Every trial is validated with each mutation's values (a range's ends) before launch; a trial that cannot
    reach a perturbation before its last epoch is rejected too; a perturbed number stays inside its range."""
    from pipelines.sweep.pbt import InRange, check_mutated_trials, initial_values, mutations

    (tmp_path / "manifest.json").write_text("{}")
    spec = load_sweep("pbt_mnist", ["sweep.num_samples=1", "sweep.mutations={trainer.weight_decay: [0.0, 0.1]}",
                                    "sweep.grid=[{trainer.optimizer: [adam, adamw], trainer.epochs: [1, 3]}]"])
    trials = plan_trials(spec, [f"data.path={tmp_path}"])
    check_mutated_trials(spec, trials, mutations(spec))
    valid = [(t.combo["trainer.optimizer"], t.combo["trainer.epochs"]) for t in trials if t.cfg is not None]
    assert valid == [("adamw", 3)]
    reasons = {(t.combo["trainer.optimizer"], t.combo["trainer.epochs"]): t.reason for t in trials}
    assert reasons[("adam", 3)].startswith("sweep.mutations: trainer.weight_decay=0.1 is invalid here: trainer.")
    assert reasons[("adamw", 1)].startswith("sweep.pbt_interval: 1 epoch(s) leaves no perturbation")
    assert initial_values([t for t in trials if t.cfg is not None], {"trainer.weight_decay": [0.0, 0.1]}) == \
        {3: {"trainer.weight_decay": 0.0}}

    # A sweep that is not PBT mutates nothing: one epoch is no reason to reject its trials.
    fifo = load_sweep("mnist_backends", ["sweep.scheduler=fifo"])
    fifo_trials = plan_trials(fifo, [f"data.path={tmp_path}", "trainer.epochs=1"])
    check_mutated_trials(fifo, fifo_trials, mutations(fifo))
    assert fifo_trials and all(t.cfg is not None for t in fifo_trials)

    keep_in = InRange({"trainer.lr": {"loguniform": [1e-5, 1e-2]}, "trainer.batch_size": [32, 64],
                       "trainer.grad_clip": {"randint": [1, 5]}})
    assert keep_in({"trainer.lr": 0.012, "trainer.batch_size": 32, "trainer.grad_clip": 0.8}) == \
        {"trainer.lr": 0.01, "trainer.batch_size": 32, "trainer.grad_clip": 1}
    assert keep_in({"trainer.lr": 0.0024, "trainer.batch_size": 64, "trainer.grad_clip": 4.8})["trainer.grad_clip"] == 4


USER_LIGHTNING = ["trainer=lightning", "plugins=[tests.support.user_lightning]", "model=smoothed_mlp"]


def test_trials_sweeping_a_key_their_model_does_not_read_are_rejected(tmp_path, forget_plugins):
    """A user's own LightningModule picks its optimizer itself: a grid or PBT mutation over the recipe's learning
    rate would train the same trial again, so those trials are rejected, saying why; a key the module reads
    (its `model.lr`) and the same grid on the recipe's own module are kept."""
    from pipelines.sweep.space import reject_ignored

    (tmp_path / "manifest.json").write_text("{}")
    user = [f"data.path={tmp_path}", *USER_LIGHTNING]
    spec = load_sweep("mnist_backends", ["sweep.overrides=[]",
                                         "sweep.grid=[{trainer.lr: [0.01, 0.1]}, {model.lr: [0.01, 0.1]}]"])
    trials = plan_trials(spec, user)
    reject_ignored(trials, [])
    assert [t.cfg is None for t in trials] == [True, True, False, False]
    assert trials[0].reason == ("sweep: trainer.lr changes nothing here: model 'smoothed_mlp' is its own "
                                "LightningModule, whose configure_optimizers picks its optimizer and schedule; "
                                "sweep the keys of its model config that it reads")
    mutated = plan_trials(load_sweep("mnist_backends", ["sweep.overrides=[]", "sweep.grid=[{model.lr: [0.1]}]"]), user)
    reject_ignored(mutated, ["trainer.weight_decay", "trainer.batch_size"])
    assert mutated[0].reason.startswith("sweep: trainer.weight_decay changes nothing here")
    plain = plan_trials(spec, [f"data.path={tmp_path}", "trainer=lightning", "model=mlp"])[:2]
    reject_ignored(plain, ["trainer.weight_decay"])
    assert all(t.cfg is not None for t in plain)


def test_pbt_mutates_a_models_own_keys_only_where_its_spec_declares_them(tmp_path, forget_plugins):
    """`model.<key>` mutations: a key the model spec declares mutable (the user's LightningModule's `lr`) is kept, a
    key of a model that declares none is rejected per trial, naming the model, and the recipe's learning rate, which
    that module does not read, is rejected as a sweep of an ignored key."""
    from pipelines.sweep.pbt import check_mutated_trials, mutations
    from pipelines.sweep.space import reject_ignored

    (tmp_path / "manifest.json").write_text("{}")
    user = [f"data.path={tmp_path}", *USER_LIGHTNING, "trainer.epochs=3"]
    for overrides, mutated, reason in [
            (user, "{model.lr: [0.01, 0.1]}", ""),
            (user, "{trainer.lr: [0.01, 0.1]}", "sweep: trainer.lr changes nothing here: model 'smoothed_mlp'"),
            ([f"data.path={tmp_path}", "trainer.epochs=3"], "{model.hidden: [[32], [64]]}",
             "sweep.mutations: 'model.hidden' cannot change between checkpoints of model 'mlp' (its spec's mutable "
             "keys: none)")]:
        spec = load_sweep("mnist_backends", ["sweep.scheduler=pbt", "sweep.grid=[{trainer.batch_size: [64]}]",
                                             f"sweep.mutations={mutated}"])
        [trial] = plan_trials(spec, overrides)
        check_mutated_trials(spec, [trial], mutations(spec))
        reject_ignored([trial], list(mutations(spec)))
        assert trial.reason.startswith(reason) and (trial.cfg is None) == bool(reason), trial.reason
