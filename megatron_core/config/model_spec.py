"""`ModelSpec`: the model's shape and its parallel layout in one frozen value, and `problems()`, every
rule they must satisfy. Recipe validation, GPTModel, the checkpoint reader and the Hugging Face import
all ask it, so a shape or layout rule is written once, here.

Built from a recipe (`from_recipe`, or `from_configs` for a model being built), from a Megatron
checkpoint's `args` (`from_args`) or from a Hugging Face GPT2 `config.json` (`from_hf_config`); it gives
back the `args` fields Megatron tools read (`to_args`) and a `ModelConfig` (`to_model_config`).
No torch here: recipes load without it.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from megatron_core.config.schema import ModelConfig, ParallelConfig, Recipe
from megatron_core.errors import UserError

# Hugging Face's activation_function -> the GeLU Megatron computes ("tanh": the approximation
# Megatron's bias-GeLU fusion and openai_gelu use; "none": the exact erf GeLU).
HF_GELU = {"gelu_new": "tanh", "gelu_fast": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class ModelSpec:
    """A GPT's shape (Megatron's names) and how it is split over TP x PP (x DP when world_size is known)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    max_position_embeddings: int
    seq_length: int
    # None until known: a recipe's vocabulary is padded once its tokenizer exists (make_vocab_size_divisible_by
    # x TP); a checkpoint or an HF model says it.
    padded_vocab_size: Optional[int] = None
    make_vocab_size_divisible_by: int = 128
    gelu_approximation: str = "tanh"  # "tanh" | "none"
    tied_embeddings: bool = True
    layernorm_epsilon: float = 1e-5
    tp: int = 1
    pp: int = 1
    # The interleaved schedule: each PP rank holds num_layers / (pp x this) chunks of this many layers.
    layers_per_virtual_stage: Optional[int] = None
    sequence_parallel: bool = False
    world_size: Optional[int] = None  # None: not known (one model being built, a file being converted)

    # -- constructors ----------------------------------------------------------------------------
    @classmethod
    def from_configs(
        cls,
        model: ModelConfig,
        parallel: ParallelConfig,
        padded_vocab_size: Optional[int] = None,
        world_size: Optional[int] = None,
    ) -> ModelSpec:
        """A model's sections; world_size only where the processes are this run's (not a GPTModel built alone)."""
        return cls(
            num_layers=model.num_layers,
            hidden_size=model.hidden_size,
            num_attention_heads=model.num_attention_heads,
            ffn_hidden_size=model.ffn_size,
            max_position_embeddings=model.max_position_embeddings,
            seq_length=model.seq_length,
            padded_vocab_size=padded_vocab_size,
            make_vocab_size_divisible_by=model.make_vocab_size_divisible_by,
            gelu_approximation=model.gelu_approximation,
            tied_embeddings=not model.untie_embeddings_and_output_weights,
            layernorm_epsilon=model.layernorm_epsilon,
            tp=parallel.tensor_model_parallel_size,
            pp=parallel.pipeline_model_parallel_size,
            layers_per_virtual_stage=parallel.num_layers_per_virtual_pipeline_stage,
            sequence_parallel=parallel.sequence_parallel,
            world_size=world_size,
        )

    @classmethod
    def from_recipe(cls, recipe: Recipe, padded_vocab_size: Optional[int] = None) -> ModelSpec:
        return cls.from_configs(recipe.model, recipe.parallel, padded_vocab_size, recipe.parallel.world_size)

    @classmethod
    def from_args(cls, args: Any) -> ModelSpec:
        """A Megatron checkpoint's `args` Namespace (Megatron-LM's or ours); absent layout fields mean 1."""

        def arg(name: str, default: Any = None) -> Any:
            value = getattr(args, name, None) if args is not None else None
            return default if value is None else value

        missing = [n for n in ("hidden_size", "num_layers", "num_attention_heads") if arg(n) is None]
        if missing:
            raise UserError(f"checkpoint args lack {', '.join(missing)}; cannot tell the model's shape")
        positions = arg("max_position_embeddings") or arg("seq_length")
        return cls(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads,
            ffn_hidden_size=arg("ffn_hidden_size") or 4 * args.hidden_size,
            max_position_embeddings=positions,
            seq_length=arg("seq_length") or positions,
            padded_vocab_size=arg("padded_vocab_size") or None,
            make_vocab_size_divisible_by=arg("make_vocab_size_divisible_by", 128),
            gelu_approximation="tanh" if (arg("bias_gelu_fusion", False) or arg("openai_gelu", False)) else "none",
            tied_embeddings=not arg("untie_embeddings_and_output_weights", False),
            layernorm_epsilon=arg("layernorm_epsilon", 1e-5),
            tp=arg("tensor_model_parallel_size", 1),
            pp=arg("pipeline_model_parallel_size", 1),
            layers_per_virtual_stage=arg("num_layers_per_virtual_pipeline_stage"),
            sequence_parallel=arg("sequence_parallel", False),
            world_size=arg("world_size"),
        )

    @classmethod
    def from_hf_config(
        cls, config: dict, tp: int = 1, pp: int = 1, layers_per_virtual_stage: Optional[int] = None
    ) -> ModelSpec:
        """A Hugging Face GPT2 config.json, to be split over TP x PP (its vocabulary taken as padded)."""
        if config.get("model_type") != "gpt2":
            raise UserError(f"model_type {config.get('model_type')!r} is not gpt2; only GPT2 models import")
        act = config.get("activation_function", "gelu_new")
        if act not in HF_GELU:
            raise UserError(f"activation_function {act!r} has no Megatron GeLU equivalent ({', '.join(HF_GELU)})")
        if config.get("scale_attn_by_inverse_layer_idx") or config.get("reorder_and_upcast_attn"):
            raise UserError("scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn have no Megatron equivalent")
        h = config["n_embd"]
        return cls(
            num_layers=config["n_layer"],
            hidden_size=h,
            num_attention_heads=config["n_head"],
            ffn_hidden_size=config.get("n_inner") or 4 * h,
            max_position_embeddings=config["n_positions"],
            seq_length=config["n_positions"],
            padded_vocab_size=config["vocab_size"],
            gelu_approximation=HF_GELU[act],
            tied_embeddings=config.get("tie_word_embeddings", True),
            layernorm_epsilon=config.get("layer_norm_epsilon", 1e-5),
            tp=tp,
            pp=pp,
            layers_per_virtual_stage=layers_per_virtual_stage,
        )

    # -- derived values --------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def virtual_stages(self) -> Optional[int]:
        """Model chunks per PP rank (Megatron's virtual_pipeline_model_parallel_size), None without interleaving."""
        if self.layers_per_virtual_stage is None:
            return None
        return self.num_layers // (self.pp * self.layers_per_virtual_stage)

    @property
    def data_parallel_size(self) -> Optional[int]:
        """world_size // (tp x pp), None where the world is not known (or the sizes are not positive)."""
        if self.world_size is None or self.tp < 1 or self.pp < 1:
            return None
        return self.world_size // (self.tp * self.pp)

    # -- the rules -------------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """Every shape and layout rule this spec breaks, one line each naming its keys and numbers
        (the recipe's keys: model.*, parallel.*). Empty when the model can be built and split."""
        tp, pp, vls = self.tp, self.pp, self.layers_per_virtual_stage
        positive = {
            "model.num_layers": self.num_layers,
            "model.hidden_size": self.hidden_size,
            "model.num_attention_heads": self.num_attention_heads,
            "model.seq_length": self.seq_length,
            "parallel.world_size": self.world_size,
            "parallel.tensor_model_parallel_size": tp,
            "parallel.pipeline_model_parallel_size": pp,
            "model.make_vocab_size_divisible_by": self.make_vocab_size_divisible_by,
        }
        problems = [f"{k} must be >= 1 (got {v})" for k, v in positive.items() if v is not None and v < 1]
        if problems:  # the divisibility rules below would divide by these
            return problems
        if self.hidden_size % self.num_attention_heads:
            problems.append(
                f"model.hidden_size {self.hidden_size} is not divisible by model.num_attention_heads "
                f"{self.num_attention_heads}"
            )
        if self.seq_length > self.max_position_embeddings:
            problems.append(
                f"model.seq_length {self.seq_length} > model.max_position_embeddings "
                f"{self.max_position_embeddings}: raise max_position_embeddings or shorten seq_length"
            )
        if self.world_size is not None and self.world_size % (tp * pp):
            problems.append(
                f"parallel.world_size {self.world_size} is not divisible by tensor_model_parallel_size "
                f"{tp} x pipeline_model_parallel_size {pp}"
            )
        if self.num_attention_heads % tp:
            problems.append(f"model.num_attention_heads {self.num_attention_heads} is not divisible by TP {tp}")
        if self.ffn_hidden_size % tp:
            problems.append(f"model.ffn_hidden_size {self.ffn_hidden_size} is not divisible by TP {tp}")
        if self.padded_vocab_size is not None and self.padded_vocab_size % tp:
            problems.append(f"padded vocab size {self.padded_vocab_size} is not divisible by TP {tp}")
        if self.num_layers % pp:
            problems.append(f"model.num_layers {self.num_layers} is not divisible by PP {pp}")
        key = "parallel.num_layers_per_virtual_pipeline_stage"
        if vls is not None and vls < 1:
            problems.append(f"{key} must be >= 1 or null (got {vls})")
        elif vls is not None and pp < 2:
            problems.append(
                f"{key} {vls} needs pipeline_model_parallel_size >= 2 (got {pp}); "
                "set it to null without pipeline parallelism"
            )
        elif vls is not None and self.num_layers % (pp * vls):
            problems.append(
                f"model.num_layers {self.num_layers} is not divisible by pipeline_model_parallel_size "
                f"{pp} x {key} {vls} = {pp * vls}"
            )
        if self.sequence_parallel and tp == 1:
            problems.append("parallel.sequence_parallel needs tensor_model_parallel_size > 1")
        if self.sequence_parallel and self.seq_length % tp:
            problems.append(f"model.seq_length {self.seq_length} is not divisible by TP {tp} (sequence parallel)")
        return problems

    def check(self, fix: str) -> None:
        """Raise UserError with every problem in one line, then `fix` (what the caller's user should change)."""
        problems = self.problems()
        if problems:
            raise UserError("; ".join(problems) + f"; {fix}")

    # -- back to the other forms -----------------------------------------------------------------
    def to_args(self, **extra: Any) -> argparse.Namespace:
        """The args fields Megatron tools (and transformers' converter) read from a checkpoint; `extra` adds
        the others (a training run's schedule, seeds, ...) or says a field as its recipe wrote it."""
        fields: dict[str, Any] = dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            ffn_hidden_size=self.ffn_hidden_size,
            padded_vocab_size=self.padded_vocab_size,
            max_position_embeddings=self.max_position_embeddings,
            seq_length=self.seq_length,
            bias_gelu_fusion=self.gelu_approximation == "tanh",
            openai_gelu=False,
            untie_embeddings_and_output_weights=not self.tied_embeddings,
            layernorm_epsilon=self.layernorm_epsilon,
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            tokenizer_type="GPT2BPETokenizer",
        )
        if self.layers_per_virtual_stage is not None:
            fields["num_layers_per_virtual_pipeline_stage"] = self.layers_per_virtual_stage
            fields["virtual_pipeline_model_parallel_size"] = self.virtual_stages
        return argparse.Namespace(**{**fields, **extra})

    def to_model_config(self, **extra: Any) -> ModelConfig:
        """The model section that builds this shape; `extra` sets the rest (dropout, attention_backend, ...).
        Its seq_length is max_position_embeddings: a loaded model takes any input its positions cover."""
        return dataclasses.replace(
            ModelConfig(
                num_layers=self.num_layers,
                hidden_size=self.hidden_size,
                num_attention_heads=self.num_attention_heads,
                ffn_hidden_size=self.ffn_hidden_size,
                seq_length=self.max_position_embeddings,
                max_position_embeddings=self.max_position_embeddings,
                make_vocab_size_divisible_by=self.make_vocab_size_divisible_by,
                layernorm_epsilon=self.layernorm_epsilon,
                bias_gelu_fusion=self.gelu_approximation == "tanh",
                openai_gelu=False,
                untie_embeddings_and_output_weights=not self.tied_embeddings,
            ),
            **extra,
        )
