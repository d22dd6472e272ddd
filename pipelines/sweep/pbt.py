"""Population based training for sweeps (`sweep.scheduler=pbt`): Ray Tune's `PopulationBasedTraining` over our
trials. Every `pbt_interval` epochs the trials in the bottom `pbt_quantile` (by `sweep.metric`) stop and continue
from the checkpoint of a trial in the top quantile, with its recipe perturbed: each key of `sweep.mutations`
takes a neighbouring value of its list, or its number times 0.8 or 1.2 (kept inside its range), or a fresh draw
(Tune's resample probability, 0.25).

Mutations are recipe keys only (MUTABLE), and the keys a model spec declares `mutable` (`model.<key>`, e.g. a
user's LightningModule's own learning rate): a checkpoint holds weights, optimizer moments and the schedule's
position, and a trial that loads another's takes these keys from its own config (trainers/torch/recipe.py,
trainers/torch/lightning_hyperparameters.py), so a mutation changes how training continues, never what a
checkpoint means. Every trial's config is validated with each mutation at the ends of its range before launch,
like a grid point.
"""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from contract.metrics import REPORTED_EPOCH
from contract.registry import MODELS
from pipelines.config import ConfigError, load_config
from pipelines.sweep.space import SIGNIFICANT_DIGITS, Trial, check_axis, format_override

PBT_CHECKPOINTS_KEPT = 4  # per trial, by Tune: Tune warns that 2 or fewer can be deleted before a trial exploits one
MUTABLE = ("trainer.lr", "trainer.weight_decay", "trainer.momentum", "trainer.grad_clip", "trainer.batch_size",
           "model.dropout")
MODEL_PREFIX = "model."


def mutations(spec: DictConfig) -> dict[str, Any]:
    """`sweep.mutations` as plain data ({} unless the scheduler is pbt), checked."""
    raw = OmegaConf.to_container(spec.mutations, resolve=True) if OmegaConf.is_config(spec.mutations) \
        else spec.mutations
    if spec.scheduler != "pbt":
        if raw:
            raise ConfigError("sweep.mutations: only the pbt scheduler mutates trials (set sweep.scheduler=pbt)")
        return {}
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"sweep.mutations: pbt needs {{recipe key: [values] | {{distribution: args}}}}, got {raw}")
    for key, axis in raw.items():
        if key not in MUTABLE and not key.startswith(MODEL_PREFIX):  # a model's own: checked per trial
            raise ConfigError(f"sweep.mutations: '{key}' cannot change between checkpoints (choices: "
                              f"{', '.join(MUTABLE)}, or a key its model spec declares mutable)")
        check_axis(key, axis, "sweep.mutations")
    if spec.pbt_interval < 1:
        raise ConfigError(f"sweep.pbt_interval: must be >= 1 epoch, got {spec.pbt_interval}")
    if not 0 < spec.pbt_quantile <= 0.5:
        raise ConfigError(f"sweep.pbt_quantile: must be in (0, 0.5], got {spec.pbt_quantile}")
    return raw


def check_mutated_trials(spec: DictConfig, trials: list[Trial], mutable: dict[str, Any]) -> None:
    """Under PBT: reject the trials that some mutation would make invalid (each key's values, or its range's ends,
    on top of the trial's overrides), or whose model does not declare a mutated `model.<key>` mutable, and a
    perturbation interval no trial reaches before its last epoch. Other
    schedulers mutate nothing: nothing to check."""
    if spec.scheduler != "pbt":
        return
    for trial in trials:
        if trial.cfg is None:
            continue
        if spec.pbt_interval >= trial.cfg.trainer.epochs:
            epochs = trial.cfg.trainer.epochs
            trial.cfg, trial.reason = None, (f"sweep.pbt_interval: {spec.pbt_interval} epoch(s) leaves no "
                                             f"perturbation before the last of trainer.epochs={epochs}")
            continue
        own = MODELS.get(trial.cfg.model.name).mutable
        for key, axis in mutable.items():
            if key not in MUTABLE and key[len(MODEL_PREFIX):] not in own:
                trial.cfg, trial.reason = None, (f"sweep.mutations: '{key}' cannot change between checkpoints of model "
                                                 f"'{trial.cfg.model.name}' (its spec's mutable keys: "
                                                 f"{', '.join(own) or 'none'})")
                break
            for value in extremes(axis):
                try:
                    load_config([*trial.overrides, format_override(key, value)])
                except ConfigError as err:
                    trial.cfg, trial.reason = None, f"sweep.mutations: {key}={value} is invalid here: {err}"
                    break
            if trial.cfg is None:
                break


def extremes(axis: Any) -> list[Any]:
    """The values a mutation can take that bound what it does: a list's values, a range's ends."""
    if isinstance(axis, list):
        return axis
    kind, args = next(iter(axis.items()))
    if kind == "choice":
        return args
    return [args[0], args[1] - 1] if kind == "randint" else list(args)


def initial_values(valid: list[Trial], mutable: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Each trial's starting value of every mutated key (its grid point or draw, else the training config's)."""
    return {t.index: {key: OmegaConf.select(t.cfg, key) for key in mutable} for t in valid}


def param_space(valid: list[Trial], mutable: dict[str, Any]) -> dict[str, Any]:
    """Tune's config: the trial index, and every mutated key at the trial's own starting value (PBT mutates the
    Tune config; a key missing from it would be drawn afresh)."""
    from ray import tune

    start = initial_values(valid, mutable)
    space: dict[str, Any] = {"trial_index": tune.grid_search([t.index for t in valid])}
    for key in mutable:
        space[key] = tune.sample_from(lambda s, key=key: start[s.config["trial_index"]][key])
    return space


def make_pbt(spec: DictConfig, mutable: dict[str, Any]) -> Any:
    from ray.tune.schedulers import PopulationBasedTraining

    class OwnTrialIndex(PopulationBasedTraining):
        """PBT gives an exploiting trial the whole config of the trial it clones, mutated; the trial index must
        stay the trial's own: it names the trial's MLflow child run and config (pipelines/sweep/trial.py)."""

        def _get_new_config(self, trial: Any, trial_to_clone: Any) -> tuple[dict, dict]:
            config, operations = super()._get_new_config(trial, trial_to_clone)
            return {**config, "trial_index": trial.config["trial_index"]}, operations

    return OwnTrialIndex(
        time_attr=REPORTED_EPOCH, metric=spec.metric, mode=spec.mode, perturbation_interval=spec.pbt_interval,
        quantile_fraction=spec.pbt_quantile, synch=spec.pbt_synch,
        hyperparam_mutations={key: tune_domain(axis) for key, axis in mutable.items()},
        custom_explore_fn=InRange(mutable),
        require_attrs=False)  # a stopped trial's last report (a STOP request) has no epoch


def tune_domain(axis: Any) -> Any:
    """A mutation as PBT takes it: a list (neighbours), or a Tune distribution (perturbed, or resampled)."""
    from ray import tune

    if isinstance(axis, list):
        return axis
    kind, args = next(iter(axis.items()))
    if kind == "choice":
        return list(args)
    return {"uniform": tune.uniform, "loguniform": tune.loguniform, "randint": tune.randint}[kind](*args)


class InRange:
    """PBT's `custom_explore_fn`: a perturbed number back inside its distribution's range (Tune multiplies by 0.8
    or 1.2 without bounds; the ends are what was validated)."""

    def __init__(self, mutable: dict[str, Any]):
        self.ranges = {key: (extremes(axis), next(iter(axis))) for key, axis in mutable.items()
                       if isinstance(axis, dict) and next(iter(axis)) != "choice"}

    def __call__(self, config: dict[str, Any]) -> dict[str, Any]:
        for key, ((low, high), kind) in self.ranges.items():
            value = min(max(config[key], low), high)
            config[key] = int(round(value)) if kind == "randint" else float(f"{value:.{SIGNIFICANT_DIGITS}g}")
        return config
