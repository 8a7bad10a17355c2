"""LR schedule: Megatron's OptimizerParamScheduler values at chosen steps, computed by hand."""

import math

import pytest
import torch

from megatron_core.errors import UserError
from megatron_core.training.lr_schedule import OptimizerParamScheduler, learning_rate


def lr_at(n, style, max_lr=1e-3, min_lr=1e-4, warmup=10, decay=110):
    return learning_rate(n, max_lr=max_lr, min_lr=min_lr, warmup_steps=warmup, decay_steps=decay, decay_style=style)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_warmup_is_linear_from_zero(style):
    assert lr_at(0, style) == 0.0
    assert lr_at(1, style) == pytest.approx(1e-4)
    assert lr_at(5, style) == pytest.approx(5e-4)
    assert lr_at(10, style) == pytest.approx(1e-3)  # n == warmup is still the warmup branch


def test_cosine_values():
    # n = 60: ratio (60-10)/(110-10) = 0.5 -> coeff 0.5 -> 1e-4 + 0.5 * 9e-4
    assert lr_at(60, "cosine") == pytest.approx(5.5e-4)
    # n = 35: ratio 0.25 -> coeff 0.5 * (cos(pi/4) + 1) = 0.853553...
    assert lr_at(35, "cosine") == pytest.approx(1e-4 + 0.8535533905932737 * 9e-4)
    assert lr_at(110, "cosine") == pytest.approx(1e-4)
    assert lr_at(111, "cosine") == 1e-4  # past decay iters: min_lr
    assert lr_at(10_000, "cosine") == 1e-4


def test_linear_values():
    assert lr_at(35, "linear") == pytest.approx(1e-4 + 0.75 * 9e-4)
    assert lr_at(85, "linear") == pytest.approx(1e-4 + 0.25 * 9e-4)
    assert lr_at(200, "linear") == 1e-4


def test_constant_after_warmup_ignores_decay_iters():
    assert lr_at(60, "constant") == 1e-3
    assert lr_at(500, "constant") == 1e-3


def test_no_warmup_starts_at_max():
    assert learning_rate(0, max_lr=2e-3, min_lr=0.0, warmup_steps=0, decay_steps=100, decay_style="cosine") == 2e-3
    assert learning_rate(
        50, max_lr=2e-3, min_lr=0.0, warmup_steps=0, decay_steps=100, decay_style="cosine"
    ) == pytest.approx(1e-3)


def test_scheduler_sets_param_groups_and_round_trips():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    sched = OptimizerParamScheduler(
        opt, max_lr=1e-3, min_lr=1e-4, warmup_steps=10, decay_steps=110, decay_style="cosine"
    )
    assert opt.param_groups[0]["lr"] == 0.0  # Megatron: the first update runs at lr(0)
    for _ in range(35):
        sched.step(1)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4 + 0.5 * (math.cos(math.pi / 4) + 1) * 9e-4)
    state = sched.state_dict()
    assert state["num_steps"] == 35 and state["lr_decay_style"] == "cosine"
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    sched2 = OptimizerParamScheduler(
        opt2, max_lr=1e-3, min_lr=1e-4, warmup_steps=10, decay_steps=110, decay_style="cosine"
    )
    sched2.load_state_dict(state)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_bad_schedules_are_refused():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    with pytest.raises(UserError, match="lr_decay_iters 10 must be greater than lr_warmup_iters 10"):
        OptimizerParamScheduler(opt, max_lr=1e-3, min_lr=0, warmup_steps=10, decay_steps=10, decay_style="cosine")
    with pytest.raises(UserError, match="not one of"):
        OptimizerParamScheduler(opt, max_lr=1e-3, min_lr=0, warmup_steps=0, decay_steps=10, decay_style="exp")


def FakeOptimizer():  # noqa: N802 - reads as the thing it stands for
    """A real optimizer whose param groups the schedulers write."""
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)


def _megatron_scheduler(optimizer, training):
    """megatron-core 0.16.1's own OptimizerParamScheduler, set up as Megatron-LM's training does for an
    iteration-based run (steps in samples)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler as MegatronScheduler

    b = training.global_batch_size
    return MegatronScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=training.lr,
        min_lr=training.min_lr,
        lr_warmup_steps=training.lr_warmup_iters * b,
        lr_decay_steps=training.decay_iters * b,
        lr_decay_style=training.lr_decay_style,
        start_wd=training.weight_decay,
        end_wd=training.weight_decay,
        wd_incr_steps=training.decay_iters * b,
        wd_incr_style="constant",
    )


def _training():
    from megatron_core.config import load_recipe

    overrides = ["lr_warmup_iters=5", "train_iters=40", "lr_decay_style=cosine", "min_lr=1e-5"]
    return load_recipe("smoke", overrides).training


def test_megatron_core_reads_our_scheduler_state_and_we_read_its():
    t = _training()
    ours = OptimizerParamScheduler.for_training(FakeOptimizer(), t)
    for _ in range(13):
        ours.step_iteration()
    theirs = _megatron_scheduler(FakeOptimizer(), t)
    theirs.load_state_dict(ours.state_dict())  # megatron-core checks every value against its own settings
    assert theirs.num_steps == ours.num_steps == 13 * t.global_batch_size
    assert theirs.get_lr(theirs.optimizer.param_groups[0]) == pytest.approx(ours.get_lr(), rel=1e-12)

    megatron = _megatron_scheduler(FakeOptimizer(), t)
    for _ in range(21):
        megatron.step(increment=t.global_batch_size)
    back = OptimizerParamScheduler.for_training(FakeOptimizer(), t)
    back.load_state_dict(megatron.state_dict())
    assert back.num_steps == megatron.num_steps
    assert back.get_lr() == pytest.approx(megatron.get_lr(megatron.optimizer.param_groups[0]), rel=1e-12)
    for _ in range(5):  # and both go on the same way
        back.step_iteration()
        megatron.step(increment=t.global_batch_size)
        assert back.get_lr() == pytest.approx(megatron.get_lr(megatron.optimizer.param_groups[0]), rel=1e-12)
