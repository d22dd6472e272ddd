"""A resumed Lightning run's optimizer takes its config's hyperparameters back after the checkpoint is loaded
(trainers/torch/lightning_hyperparameters.py), on real torch optimizers and schedules, loaded as Lightning loads
them (optimizer, then schedule state dicts). The whole path, a user's LightningModule resumed with another rate:
tests/unit/test_loop_backends.py."""
from __future__ import annotations

import copy

import pytest
import torch

from trainers.torch.lightning_hyperparameters import configured_groups, reapply

STEPS = 5  # optimizer steps before the checkpoint


def trained(make_optimizer, make_schedule, steps: int = STEPS):
    """A one-parameter optimizer and schedule after `steps` steps."""
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = make_optimizer([weight])
    schedule = make_schedule(optimizer) if make_schedule else None
    for _ in range(steps):
        weight.grad = torch.full((3,), 0.5)
        optimizer.step()
        if schedule:
            schedule.step()
    return optimizer, schedule


def resumed(make_optimizer, make_schedule, checkpoint):
    """A fresh optimizer and schedule from (another) config, the checkpoint loaded into them, then `reapply`."""
    optimizer, schedule = trained(make_optimizer, make_schedule, steps=0)
    configured = configured_groups([optimizer])
    optimizer.load_state_dict(copy.deepcopy(checkpoint[0].state_dict()))
    if schedule:
        schedule.load_state_dict(copy.deepcopy(checkpoint[1].state_dict()))
    reapply([optimizer], [schedule] if schedule else [], configured)
    return optimizer, schedule


def sgd(lr, momentum=0.9, weight_decay=0.01):
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)


def warmup(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 8))


def halving(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


@pytest.mark.parametrize("make_schedule, factor", [(warmup, lambda step: min(1.0, (step + 1) / 8)),
                                                   (halving, lambda step: 0.5 ** (step // 2))])
def test_a_changed_rate_continues_the_restored_schedule_from_the_new_start(make_schedule, factor):
    checkpoint = trained(sgd(0.1), make_schedule)
    optimizer, schedule = resumed(sgd(0.04, momentum=0.5, weight_decay=0.02), make_schedule, checkpoint)
    group = optimizer.param_groups[0]
    torch.testing.assert_close(group["lr"], 0.04 * factor(STEPS), rtol=1e-12, atol=0)
    assert (group["momentum"], group["weight_decay"], group["initial_lr"]) == (0.5, 0.02, 0.04)
    assert schedule.base_lrs == [0.04] and schedule.last_epoch == STEPS  # the position is the checkpoint's
    state = optimizer.state[group["params"][0]]["momentum_buffer"]
    torch.testing.assert_close(state, checkpoint[0].state[checkpoint[0].param_groups[0]["params"][0]]
                               ["momentum_buffer"], rtol=0, atol=0)
    for step in range(STEPS + 1, STEPS + 4):  # and the schedule goes on from the new start
        optimizer.step()
        schedule.step()
        torch.testing.assert_close(group["lr"], 0.04 * factor(step), rtol=1e-12, atol=0)


@pytest.mark.parametrize("make_schedule", [None, warmup, halving])
def test_an_unchanged_config_resumes_exactly_where_it_stopped(make_schedule):
    checkpoint = trained(sgd(0.1), make_schedule)
    optimizer, schedule = resumed(sgd(0.1), make_schedule, checkpoint)
    assert optimizer.param_groups[0] == {**checkpoint[0].param_groups[0], "params": optimizer.param_groups[0]["params"]}
    if schedule:
        assert schedule.state_dict() == checkpoint[1].state_dict()


def test_without_a_schedule_the_rate_is_the_configured_one():
    checkpoint = trained(sgd(0.1), None)
    optimizer, _ = resumed(sgd(0.0, momentum=0.0), None, checkpoint)
    assert (optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["momentum"]) == (0.0, 0.0)


def test_a_cycled_momentum_stays_where_its_schedule_took_it():
    def one_cycle(optimizer):
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=optimizer.param_groups[0]["lr"], total_steps=20)
    checkpoint = trained(sgd(0.1), one_cycle)
    restored_momentum = checkpoint[0].param_groups[0]["momentum"]
    optimizer, schedule = resumed(sgd(0.2), one_cycle, checkpoint)
    group = optimizer.param_groups[0]
    assert group["momentum"] == restored_momentum != 0.9  # mid-cycle, not the configured start
    assert group["max_lr"] == 0.2 and schedule.base_lrs == [group["initial_lr"]]
    torch.testing.assert_close(group["lr"], 2 * checkpoint[0].param_groups[0]["lr"], rtol=1e-12, atol=0)
