"""Recipe validation: refuse impossible combinations before any work starts, each problem in one line
that names its keys and numbers. The model's shape and parallel layout are ModelSpec's rules
(config/model_spec.py); the batch, schedule, optimizer and precision rules are here."""

from __future__ import annotations

from typing import Optional

from megatron_core.config.model_spec import ModelSpec
from megatron_core.config.schema import Recipe, TrainingConfig
from megatron_core.errors import UserError


def lr_warmup_problem(t: TrainingConfig) -> Optional[str]:
    """The warm-up a short run cannot fit (a decaying schedule needs decay iterations after the warm-up),
    as one line naming the key and a value that works: a tenth of the decay iterations, Megatron's
    lr_warmup_fraction idea. None when the schedule fits."""
    decaying = t.lr_decay_style != "constant"
    if t.lr_warmup_iters < t.decay_iters or (not decaying and t.lr_warmup_iters == t.decay_iters):
        return None
    decay_key = "training.lr_decay_iters" if t.lr_decay_iters is not None else "training.train_iters"
    must = (
        f"must be below {decay_key} {t.decay_iters} for {t.lr_decay_style} decay"
        if decaying
        else f"exceeds {decay_key} {t.decay_iters}"
    )
    return (
        f"training.lr_warmup_iters {t.lr_warmup_iters} {must}; add --set training.lr_warmup_iters="
        f"{t.decay_iters // 10} (a tenth of the run), or raise {decay_key} above {t.lr_warmup_iters}"
    )


def validate(recipe: Recipe) -> None:
    """Refuse impossible combinations before any work starts."""
    m, t = recipe.model, recipe.training
    spec = ModelSpec.from_recipe(recipe)
    problems = spec.problems()
    positive = {
        "training.micro_batch_size": t.micro_batch_size,
        "training.global_batch_size": t.global_batch_size,
        "training.train_iters": t.train_iters,
        "training.log_interval": t.log_interval,
        "training.eval_interval": t.eval_interval,
    }
    not_positive = [f"{k} must be >= 1 (got {v})" for k, v in positive.items() if v < 1]
    if not_positive:  # the batch rules below would divide by these
        raise UserError("; ".join(problems + not_positive))
    dp = max(spec.data_parallel_size or 1, 1)
    if t.global_batch_size % (t.micro_batch_size * dp):
        problems.append(
            f"training.global_batch_size {t.global_batch_size} is not a multiple of micro_batch_size "
            f"{t.micro_batch_size} x data-parallel size {dp}"
        )
    pp, vls = spec.pp, spec.layers_per_virtual_stage
    num_micro_batches = t.global_batch_size // (t.micro_batch_size * dp)
    if vls is not None and vls >= 1 and pp >= 2 and num_micro_batches % pp:
        problems.append(
            f"the interleaved schedule needs the number of micro batches per iteration "
            f"({num_micro_batches} = global_batch_size / (micro_batch_size x data-parallel size)) "
            f"to be a multiple of pipeline_model_parallel_size {pp}"
        )
    if t.fp16 and t.bf16:
        problems.append("training.fp16 and training.bf16 are both set: choose one")
    if t.keep_last_checkpoints is not None and t.keep_last_checkpoints < 0:
        problems.append(
            f"training.keep_last_checkpoints must be >= 0 (0 or null keeps every checkpoint), got "
            f"{t.keep_last_checkpoints}"
        )
    if t.max_consecutive_nan_steps < 1:
        problems.append(f"training.max_consecutive_nan_steps must be >= 1, got {t.max_consecutive_nan_steps}")
    if t.optimizer == "apex" and t.device == "cpu":
        problems.append(
            "training.optimizer 'apex' (Apex's FusedAdam) runs on CUDA only but training.device is "
            "cpu: use --set optimizer=adam (torch's AdamW)"
        )
    warmup_problem = lr_warmup_problem(t)
    if warmup_problem:
        problems.append(warmup_problem)
    if t.min_lr > t.lr:
        problems.append(f"training.min_lr {t.min_lr} > training.lr {t.lr}")
    problems += _bound_problems(recipe)
    for name, value in (("hidden_dropout", m.hidden_dropout), ("attention_dropout", m.attention_dropout)):
        if not 0.0 <= value < 1.0:
            problems.append(f"model.{name} must be in [0, 1) (got {value})")
    split = [s for s in recipe.data.split.replace("/", ",").split(",") if s.strip()]
    try:
        weights = [float(s) for s in split]
    except ValueError:
        weights = []
    if not weights or any(w < 0 for w in weights) or sum(weights) <= 0 or len(weights) > 3:
        problems.append(f"data.split {recipe.data.split!r} must be up to three non-negative numbers, e.g. '969,30,1'")
    if recipe.data.data_path and len(recipe.data.data_path) > 1 and len(recipe.data.data_path) % 2:
        problems.append("data.data_path blend must be pairs: [weight1, prefix1, weight2, prefix2, ...]")
    if (recipe.tokenizer.vocab_file is None) != (recipe.tokenizer.merge_file is None):
        problems.append("tokenizer.vocab_file and tokenizer.merge_file go together: give both or neither")
    if problems:
        raise UserError("; ".join(problems))


def _bound_problems(recipe: Recipe) -> list[str]:
    """The optimizer, schedule and loss-scale values outside their range, one line each."""
    t, m = recipe.training, recipe.model
    # (key, value, holds, what it must be): in the order people read the recipe
    bounds = [
        ("training.lr", t.lr, t.lr > 0, "> 0"),
        ("training.min_lr", t.min_lr, t.min_lr >= 0, ">= 0"),
        ("training.lr_warmup_iters", t.lr_warmup_iters, t.lr_warmup_iters >= 0, ">= 0"),
        ("training.weight_decay", t.weight_decay, t.weight_decay >= 0, ">= 0"),
        ("training.adam_beta1", t.adam_beta1, 0.0 <= t.adam_beta1 < 1.0, "in [0, 1)"),
        ("training.adam_beta2", t.adam_beta2, 0.0 <= t.adam_beta2 < 1.0, "in [0, 1)"),
        ("training.adam_eps", t.adam_eps, t.adam_eps > 0, "> 0"),
        ("training.clip_grad", t.clip_grad, t.clip_grad >= 0, ">= 0 (0 turns clipping off;"),
        ("training.eval_iters", t.eval_iters, t.eval_iters >= 0, ">= 0"),
        ("training.save_interval", t.save_interval, t.save_interval is None or t.save_interval >= 1, ">= 1 or null"),
        ("model.init_method_std", m.init_method_std, m.init_method_std > 0, "> 0"),
    ]
    problems = [
        f"{key} must be {must}{' ' if must.endswith(';') else ' ('}got {value})"
        for key, value, holds, must in bounds
        if not holds
    ]
    if t.fp16:
        if not 0 < t.min_loss_scale <= t.initial_loss_scale:
            problems.append(
                f"training.min_loss_scale {t.min_loss_scale} must be in (0, initial_loss_scale {t.initial_loss_scale}]"
            )
        if t.loss_scale_window < 1 or t.hysteresis < 1:
            problems.append("training.loss_scale_window and training.hysteresis must be >= 1")
    return problems
