"""Learning-rate schedule with Megatron's OptimizerParamScheduler semantics.

    lr(n) = max_lr * n / warmup                       for warmup > 0 and n <= warmup
          = max_lr                                    for style 'constant' (after warmup)
          = min_lr                                    for n > decay_steps
          = min_lr + coeff(r) * (max_lr - min_lr)     otherwise, r = (n - warmup) / (decay - warmup)
    coeff: linear 1 - r, cosine 0.5 * (cos(pi r) + 1)

As in Megatron, the scheduler counts SAMPLES (`for_training`: warmup and decay steps are the
iteration counts x global batch size, and each successful optimizer step advances it by the global
batch; a skipped fp16 step does not), so its checkpointed state is the one Megatron-LM writes and
reads (`opt_param_scheduler`: num_steps, lr_warmup_steps, lr_decay_steps in samples, plus the
weight-decay keys). The lr used by step k is lr(k - 1): the very first update with warmup uses lr 0.
"""

from __future__ import annotations

import math

from megatron_core.errors import UserError

DECAY_STYLES = ("constant", "linear", "cosine")


def learning_rate(
    num_steps: int, *, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int, decay_style: str
) -> float:
    """The learning rate after `num_steps` successful steps (pure function, for tests and plots)."""
    if warmup_steps > 0 and num_steps <= warmup_steps:
        return max_lr * float(num_steps) / float(warmup_steps)
    if decay_style == "constant":
        return max_lr
    if num_steps > decay_steps:
        return min_lr
    decay_ratio = float(num_steps - warmup_steps) / float(decay_steps - warmup_steps)
    if decay_style == "linear":
        coeff = 1.0 - decay_ratio
    elif decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
    else:
        raise UserError(f"lr_decay_style {decay_style!r} is not one of {', '.join(DECAY_STYLES)}")
    return min_lr + coeff * (max_lr - min_lr)


class OptimizerParamScheduler:
    """Sets `lr` of every param group of `optimizer` (anything with `.param_groups`) each step."""

    def __init__(
        self,
        optimizer,
        *,
        max_lr: float,
        min_lr: float,
        warmup_steps: int,
        decay_steps: int,
        decay_style: str,
        weight_decay: float = 0.0,
        steps_per_iteration: int = 1,
    ) -> None:
        if decay_style not in DECAY_STYLES:
            raise UserError(f"lr_decay_style {decay_style!r} is not one of {', '.join(DECAY_STYLES)}")
        if decay_style != "constant" and decay_steps <= warmup_steps:
            raise UserError(
                f"lr_decay_iters {decay_steps} must be greater than lr_warmup_iters {warmup_steps} for "
                f"'{decay_style}' decay; raise lr_decay_iters (or train_iters) or lower lr_warmup_iters"
            )
        self.optimizer = optimizer
        self.max_lr, self.min_lr = float(max_lr), float(min_lr)
        self.warmup_steps, self.decay_steps = int(warmup_steps), int(decay_steps)
        self.decay_style = decay_style
        self.weight_decay = float(weight_decay)  # constant, as Megatron's default wd_incr_style
        self.steps_per_iteration = int(steps_per_iteration)
        self.num_steps = 0
        self.step(0)

    @classmethod
    def for_training(cls, optimizer, training) -> "OptimizerParamScheduler":
        """Megatron's scheduler of an iteration-based run: everything counted in samples."""
        b = training.global_batch_size
        return cls(
            optimizer,
            max_lr=training.lr,
            min_lr=training.min_lr,
            warmup_steps=training.lr_warmup_iters * b,
            decay_steps=training.decay_iters * b,
            decay_style=training.lr_decay_style,
            weight_decay=training.weight_decay,
            steps_per_iteration=b,
        )

    def step_iteration(self) -> float:
        """One successful optimizer step: the global batch's samples."""
        return self.step(self.steps_per_iteration)

    def get_lr(self) -> float:
        return learning_rate(
            self.num_steps,
            max_lr=self.max_lr,
            min_lr=self.min_lr,
            warmup_steps=self.warmup_steps,
            decay_steps=self.decay_steps,
            decay_style=self.decay_style,
        )

    def step(self, increment: int = 1) -> float:
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    # Megatron's keys and units, so Megatron-LM reads ours and we read its.
    def state_dict(self) -> dict:
        return {
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "lr_warmup_steps": self.warmup_steps,
            "lr_decay_steps": self.decay_steps,
            "lr_decay_style": self.decay_style,
            "num_steps": self.num_steps,
            "start_wd": self.weight_decay,
            "end_wd": self.weight_decay,
            "wd_incr_steps": self.decay_steps,
            "wd_incr_style": "constant",
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the position; the schedule's shape comes from the (possibly changed) recipe, as
        with Megatron's default override_opt_param_scheduler=False + use_checkpoint... = False.
        Reads Megatron's older key (`num_iters`) too."""
        self.num_steps = int(state["num_steps"] if "num_steps" in state else state["num_iters"])
        self.step(0)
