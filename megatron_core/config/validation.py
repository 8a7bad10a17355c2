"""Recipe validation: refuse impossible combinations (layout, batch, schedule, precision) before any
work starts, each problem in one line that names its keys and numbers."""

from __future__ import annotations

from typing import Optional

from megatron_core.config.schema import Recipe, TrainingConfig
from megatron_core.errors import UserError


def _virtual_pipeline_problems(num_layers: int, pp: int, layers_per_virtual_stage: Optional[int],
                               num_micro_batches: int) -> list[str]:
    """What stops the interleaved schedule (Megatron's checks), each naming its numbers."""
    if layers_per_virtual_stage is None:
        return []
    key = "parallel.num_layers_per_virtual_pipeline_stage"
    if layers_per_virtual_stage < 1:
        return [f"{key} must be >= 1 or null (got {layers_per_virtual_stage})"]
    if pp < 2:
        return [f"{key} {layers_per_virtual_stage} needs pipeline_model_parallel_size >= 2 (got {pp}); "
                "set it to null without pipeline parallelism"]
    problems = []
    if num_layers % (pp * layers_per_virtual_stage):
        problems.append(f"model.num_layers {num_layers} is not divisible by pipeline_model_parallel_size {pp} x "
                        f"{key} {layers_per_virtual_stage} = {pp * layers_per_virtual_stage}")
    if num_micro_batches % pp:
        problems.append(f"the interleaved schedule needs the number of micro batches per iteration "
                        f"({num_micro_batches} = global_batch_size / (micro_batch_size x data-parallel size)) "
                        f"to be a multiple of pipeline_model_parallel_size {pp}")
    return problems


def lr_warmup_problem(t: TrainingConfig) -> Optional[str]:
    """The warm-up a short run cannot fit (a decaying schedule needs decay iterations after the warm-up),
    as one line naming the key and a value that works: a tenth of the decay iterations, Megatron's
    lr_warmup_fraction idea. None when the schedule fits."""
    decaying = t.lr_decay_style != "constant"
    if t.lr_warmup_iters < t.decay_iters or (not decaying and t.lr_warmup_iters == t.decay_iters):
        return None
    decay_key = "training.lr_decay_iters" if t.lr_decay_iters is not None else "training.train_iters"
    must = f"must be below {decay_key} {t.decay_iters} for {t.lr_decay_style} decay" if decaying else \
        f"exceeds {decay_key} {t.decay_iters}"
    return (f"training.lr_warmup_iters {t.lr_warmup_iters} {must}; add --set training.lr_warmup_iters="
            f"{t.decay_iters // 10} (a tenth of the run), or raise {decay_key} above {t.lr_warmup_iters}")


def validate(recipe: Recipe) -> None:
    """Refuse impossible combinations before any work starts."""
    m, p, t = recipe.model, recipe.parallel, recipe.training
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    problems = []
    positive = {
        "model.num_layers": m.num_layers,
        "model.hidden_size": m.hidden_size,
        "model.num_attention_heads": m.num_attention_heads,
        "model.seq_length": m.seq_length,
        "parallel.world_size": p.world_size,
        "parallel.tensor_model_parallel_size": tp,
        "parallel.pipeline_model_parallel_size": pp,
        "training.micro_batch_size": t.micro_batch_size,
        "training.global_batch_size": t.global_batch_size,
        "training.train_iters": t.train_iters,
        "training.log_interval": t.log_interval,
        "training.eval_interval": t.eval_interval,
        "model.make_vocab_size_divisible_by": m.make_vocab_size_divisible_by,
    }
    problems += [f"{k} must be >= 1 (got {v})" for k, v in positive.items() if v < 1]
    if problems:
        raise UserError("; ".join(problems))
    if m.hidden_size % m.num_attention_heads:
        problems.append(
            f"model.hidden_size {m.hidden_size} is not divisible by model.num_attention_heads {m.num_attention_heads}"
        )
    if m.seq_length > m.max_position_embeddings:
        problems.append(
            f"model.seq_length {m.seq_length} > model.max_position_embeddings {m.max_position_embeddings}: "
            "raise max_position_embeddings or shorten seq_length"
        )
    if p.world_size % (tp * pp):
        problems.append(
            f"parallel.world_size {p.world_size} is not divisible by tensor_model_parallel_size {tp} x "
            f"pipeline_model_parallel_size {pp}"
        )
    if m.num_attention_heads % tp:
        problems.append(f"model.num_attention_heads {m.num_attention_heads} is not divisible by TP {tp}")
    if m.ffn_size % tp:
        problems.append(f"ffn size {m.ffn_size} is not divisible by TP {tp}")
    if m.num_layers % pp:
        problems.append(f"model.num_layers {m.num_layers} is not divisible by PP {pp}")
    dp = max(p.data_parallel_size, 1)
    problems += _virtual_pipeline_problems(m.num_layers, pp, p.num_layers_per_virtual_pipeline_stage,
                                           t.global_batch_size // max(t.micro_batch_size * dp, 1))
    if t.global_batch_size % (t.micro_batch_size * dp):
        problems.append(
            f"training.global_batch_size {t.global_batch_size} is not a multiple of micro_batch_size "
            f"{t.micro_batch_size} x data-parallel size {dp}"
        )
    if p.sequence_parallel and tp == 1:
        problems.append("parallel.sequence_parallel needs tensor_model_parallel_size > 1")
    if p.sequence_parallel and m.seq_length % tp:
        problems.append(f"model.seq_length {m.seq_length} is not divisible by TP {tp} (sequence parallel)")
    if t.fp16 and t.bf16:
        problems.append("training.fp16 and training.bf16 are both set: choose one")
    if t.keep_last_checkpoints is not None and t.keep_last_checkpoints < 0:
        problems.append(f"training.keep_last_checkpoints must be >= 0 (0 or null keeps every checkpoint), got "
                        f"{t.keep_last_checkpoints}")
    if t.max_consecutive_nan_steps < 1:
        problems.append(f"training.max_consecutive_nan_steps must be >= 1, got {t.max_consecutive_nan_steps}")
    if t.optimizer == "apex" and t.device == "cpu":
        problems.append("training.optimizer 'apex' (Apex's FusedAdam) runs on CUDA only but training.device is "
                        "cpu: use --set optimizer=adam (torch's AdamW)")
    warmup_problem = lr_warmup_problem(t)
    if warmup_problem:
        problems.append(warmup_problem)
    if t.min_lr > t.lr:
        problems.append(f"training.min_lr {t.min_lr} > training.lr {t.lr}")
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
