"""The recipe schema: typed, validated, hashed. The one place defaults live.

A recipe is a YAML file with a `name`, a `version` and one mapping per section below. Field names
are Megatron-LM's command-line flags with underscores; defaults equal Megatron-LM's where it has one.
Everything a run does is decided by the resolved recipe, and its hash is written into every output.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import platform
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from megatron_core.errors import UserError

# ----------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------


@dataclass
class CorpusConfig:
    """Where the loose-JSON corpus comes from (see megatron_core.data.corpus)."""

    # Each source: {"type": "python-stdlib"} | {"type": "jsonl", "paths": [...], "key": "content"}
    #            | {"type": "hf-dataset", "name": ..., "revision": ..., "split": "train", "key": "content"}
    sources: list = field(default_factory=lambda: [{"type": "python-stdlib"}])
    max_documents: Optional[int] = None
    max_bytes: Optional[int] = None


@dataclass
class TokenizerConfig:
    tokenizer_type: Literal["GPT2BPETokenizer"] = "GPT2BPETokenizer"
    # Given files are used as they are; without them a byte-level BPE is trained on the corpus.
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    # Or a Hugging Face Hub tokenizer (e.g. "codeparrot/codeparrot") whose vocab.json and merges.txt
    # are fetched at a pinned revision; needs internet or a warm HF cache.
    hf_tokenizer: Optional[str] = None
    hf_tokenizer_revision: str = "main"
    vocab_size: int = 32768
    min_frequency: int = 2


@dataclass
class DataConfig:
    json_keys: list = field(default_factory=lambda: ["text"])
    append_eod: bool = False
    split_sentences: bool = False
    keep_newlines: bool = False
    dataset_impl: Literal["mmap", "cached", "lazy"] = "mmap"
    workers: int = 2
    log_interval: int = 1000
    # Explicit prefixes or a blend [w1, p1, w2, p2, ...]; empty means the recipe's own preprocessed output.
    data_path: list = field(default_factory=list)
    split: str = "969,30,1"


@dataclass
class ModelConfig:
    num_layers: int = 12
    hidden_size: int = 768
    num_attention_heads: int = 12
    ffn_hidden_size: Optional[int] = None  # None: 4 * hidden_size
    seq_length: int = 1024
    max_position_embeddings: int = 1024
    make_vocab_size_divisible_by: int = 128
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    # Megatron's default bias-GeLU fusion (and openai_gelu) is the tanh approximation; with both
    # off the model uses the exact erf GeLU.
    bias_gelu_fusion: bool = True
    openai_gelu: bool = False
    untie_embeddings_and_output_weights: bool = False
    # auto: our blocked causal kernel on a CPU in fp32/fp64/bf16 while no attention dropout is drawn (it
    # skips masked key blocks; torch's CPU SDPA is slower there), F.scaled_dot_product_attention otherwise.
    # The same function either way: changing it on resume is safe.
    attention_backend: Literal["auto", "sdpa", "unfused", "blocked"] = "auto"

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def gelu_approximation(self) -> str:
        return "tanh" if (self.bias_gelu_fusion or self.openai_gelu) else "none"


@dataclass
class ParallelConfig:
    # Processes of one run (GPUs, or CPU ranks on gloo); data parallel size = world / (TP * PP).
    world_size: int = 1
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    recompute_granularity: Optional[Literal["full", "selective"]] = None
    # Megatron's interleaved 1F1B (virtual pipeline stages): each PP rank holds
    # num_layers / (PP x this) non-contiguous chunks of this many layers; None: one contiguous stage.
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    # Gradient all-reduce bucket size for data parallelism (elements), as Megatron's ddp_bucket_size.
    ddp_bucket_size: int = 40_000_000

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)

    def virtual_pipeline_model_parallel_size(self, num_layers: int) -> Optional[int]:
        """Model chunks per PP rank (Megatron's virtual_pipeline_model_parallel_size), None without interleaving."""
        if self.num_layers_per_virtual_pipeline_stage is None:
            return None
        return num_layers // (self.pipeline_model_parallel_size * self.num_layers_per_virtual_pipeline_stage)


@dataclass
class TrainingConfig:
    micro_batch_size: int = 1
    global_batch_size: int = 1
    train_iters: int = 1000
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_decay_style: Literal["constant", "linear", "cosine"] = "linear"
    lr_warmup_iters: int = 0
    lr_decay_iters: Optional[int] = None  # None: train_iters
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    fp16: bool = False
    bf16: bool = False
    # Megatron's flag: gradients accumulate over micro batches and are all-reduced in fp32 main_grad
    # buffers. Forced on for bf16 (as Megatron does); fp16 without it accumulates in fp16.
    accumulate_allreduce_grads_in_fp32: bool = False
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    # The NaN guard (Megatron's check_for_nan_in_loss_and_grad, always on): an iteration whose loss or
    # grad norm is NaN/inf is skipped; this many such iterations in a row stop the run with an error.
    max_consecutive_nan_steps: int = 3
    seed: int = 1234
    log_interval: int = 100
    save_interval: Optional[int] = None
    # Iteration directories kept on disk: older ones are deleted after each successful save (0 or
    # null: keep all). Two, so a checkpoint that fails verification has a good one to fall back to.
    keep_last_checkpoints: Optional[int] = 2
    eval_interval: int = 1000
    eval_iters: int = 100
    # Fused-kernel backends: one choice for all, with per-fusion overrides
    # (layer_norm, bias_gelu, bias_dropout_add, softmax, cross_entropy).
    fusions: Literal["auto", "triton", "apex", "compile", "torch"] = "auto"
    fusion_overrides: dict = field(default_factory=dict)
    compile: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # The inner Adam: torch's AdamW (fused, on CUDA and CPU) or Apex's FusedAdam (CUDA only; opt-in until a
    # GPU check has compared it with torch's step for step). Same update rule: a resume may switch.
    optimizer: Literal["adam", "apex"] = "adam"

    @property
    def decay_iters(self) -> int:
        return self.lr_decay_iters if self.lr_decay_iters is not None else self.train_iters


@dataclass
class EvaluateConfig:
    perplexity: bool = True
    humaneval: bool = False
    humaneval_num_samples: int = 200
    humaneval_temperature: float = 0.2
    humaneval_top_p: float = 0.95
    humaneval_max_new_tokens: int = 256
    humaneval_timeout_s: float = 3.0
    humaneval_problems: Optional[int] = None  # None: all 164
    humaneval_k: list = field(default_factory=lambda: [1, 10, 100])
    humaneval_stop_sequences: Optional[list] = None  # None: Codex's ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
    humaneval_memory_mb: int = 1024  # address-space limit of each sandboxed sample
    # Published figures to print beside ours, e.g. {"pass@1": 0.038, ...}.
    reference: dict = field(default_factory=dict)


SECTIONS: dict[str, type] = {
    "corpus": CorpusConfig,
    "tokenizer": TokenizerConfig,
    "data": DataConfig,
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "training": TrainingConfig,
    "evaluate": EvaluateConfig,
}
TOP_LEVEL = ("name", "version", "description", "family", "hardware")

# Keys that may change between a checkpoint and its resume without changing what is learned.
RESUME_SAFE_KEYS = frozenset(
    {
        "training.train_iters",
        "model.attention_backend",
        "training.log_interval",
        "training.save_interval",
        "training.keep_last_checkpoints",
        "training.max_consecutive_nan_steps",
        "training.eval_interval",
        "training.eval_iters",
        "training.lr_decay_iters",
        "training.device",
        "training.optimizer",
        "description",
        "hardware",
        "version",
        "evaluate",
        # The layout: a resume re-slices weights and optimizer state for any TP x PP x DP; the
        # vocabulary padding may change with it as long as the padded size stays (checked on load).
        "parallel",
        "model.make_vocab_size_divisible_by",
    }
)


# Keys added after recipes were hashed: at their default they are left out of the resolved recipe, so
# every existing recipe keeps its hash, run directory and resumable checkpoints.
KEYS_HASHED_ONLY_WHEN_SET = ("parallel.num_layers_per_virtual_pipeline_stage", "training.optimizer",
                             "training.keep_last_checkpoints", "training.max_consecutive_nan_steps")


@dataclass
class Recipe:
    name: str
    version: int
    description: str = ""
    family: Optional[str] = None
    hardware: str = "cpu"
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    # Where it came from and which --set overrides were applied (recorded, not hashed twice:
    # their effect is already in the resolved values).
    source: str = ""
    overrides: list = field(default_factory=list)

    # -- derived values ------------------------------------------------------------------------
    @property
    def num_micro_batches(self) -> int:
        t, p = self.training, self.parallel
        return t.global_batch_size // (t.micro_batch_size * p.data_parallel_size)

    @property
    def precision(self) -> str:
        """"fp16", "bf16" or "fp32": the training precision the recipe asks for."""
        return "fp16" if self.training.fp16 else "bf16" if self.training.bf16 else "fp32"

    def padded_vocab_size(self, vocab_size: int) -> int:
        """Megatron's padding: a multiple of make_vocab_size_divisible_by x TP."""
        multiple = self.model.make_vocab_size_divisible_by * self.parallel.tensor_model_parallel_size
        return int(math.ceil(vocab_size / multiple) * multiple)

    def num_parameters(self, vocab_size: Optional[int] = None) -> int:
        m = self.model
        v = self.padded_vocab_size(vocab_size or self.tokenizer.vocab_size)
        h, f, L = m.hidden_size, m.ffn_size, m.num_layers
        per_layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
        embed = v * h + m.max_position_embeddings * h
        head = v * h if m.untie_embeddings_and_output_weights else 0
        return embed + L * per_layer + 2 * h + head

    def tokens_to_train(self) -> int:
        return self.training.train_iters * self.training.global_batch_size * self.model.seq_length

    # -- serialization -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The resolved recipe: every section with every value, defaults included."""
        out: dict[str, Any] = {k: getattr(self, k) for k in TOP_LEVEL}
        for name in SECTIONS:
            out[name] = dataclasses.asdict(getattr(self, name))
        for dotted in KEYS_HASHED_ONLY_WHEN_SET:
            section, key = dotted.split(".")
            if out[section][key] == _field_default(SECTIONS[section], key):
                del out[section][key]
        return out

    def to_yaml(self) -> str:
        """The resolved recipe as a recipe file (load_recipe reads it back with the same hash)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @property
    def hash(self) -> str:
        return canonical_hash(self.to_dict())

    def unpinned_revisions(self) -> list[str]:
        """The Hub revisions this recipe names that can move: anything but a full commit sha (a branch
        such as `main`, or a tag). Their run records the commit it resolved (provenance)."""
        named = [(f"corpus.sources[{i}].revision", source.get("revision"))
                 for i, source in enumerate(self.corpus.sources) if source.get("type") == "hf-dataset"]
        if self.tokenizer.hf_tokenizer is not None:
            named.append(("tokenizer.hf_tokenizer_revision", self.tokenizer.hf_tokenizer_revision))
        return [f"{key}={value}" for key, value in named if not _is_commit_sha(value)]

    def stage_hash(self, stage: str) -> str:
        """Hash of exactly what a pipeline stage's output depends on (so a change of lr does not
        redo the corpus, and a change of the corpus redoes everything downstream). A corpus read from
        the running Python's standard library is keyed by that Python's version too."""
        d = self.to_dict()
        parts = {"corpus": {"corpus": d["corpus"]}}
        if any(source.get("type") == "python-stdlib" for source in self.corpus.sources):
            parts["corpus"]["python"] = platform.python_version()
        # a trained tokenizer learns from the texts under data.json_keys
        parts["tokenizer"] = {**parts["corpus"], "tokenizer": d["tokenizer"], "json_keys": d["data"]["json_keys"]}
        preprocess_keys = ("json_keys", "append_eod", "split_sentences", "keep_newlines", "dataset_impl")
        parts["preprocess"] = {
            **parts["tokenizer"],
            "data": {k: d["data"][k] for k in preprocess_keys},
        }
        # the run (training, its checkpoints, the converted model) depends on everything but how it is
        # evaluated afterwards and the prose: `--set evaluate...` finds the same run
        parts["train"] = {k: v for k, v in d.items() if k not in ("evaluate", "description", "hardware")}
        if "python" in parts["corpus"]:
            parts["train"]["python"] = parts["corpus"]["python"]
        if stage not in parts:
            raise ValueError(f"unknown stage {stage!r}; one of {', '.join(parts)}")
        return canonical_hash(parts[stage])

    def diff(self, other: dict) -> list[str]:
        """Dotted keys whose values differ between this recipe and a resolved recipe dict. A key the
        other dict lacks (it was written before the schema had it) differs only when this recipe's
        value is not the key's default, which is what an older run used."""
        mine = self.to_dict()
        for name in SECTIONS:
            section = getattr(self, name)
            saved = other.get(name)
            if not isinstance(saved, dict):
                continue
            for f in dataclasses.fields(section):
                if f.name not in saved and f.default is not dataclasses.MISSING and mine[name].get(f.name) == f.default:
                    mine[name].pop(f.name, None)
        return sorted(_diff_dicts(mine, other))

    def describe(self) -> str:
        m, p, t = self.model, self.parallel, self.training
        vpp = p.virtual_pipeline_model_parallel_size(m.num_layers)
        chunks = f" x {vpp} virtual stages" if vpp is not None else ""
        return (
            f"{self.name} v{self.version} [{self.hash}]: {m.num_layers}x{m.hidden_size}x"
            f"{m.num_attention_heads} seq {m.seq_length}, world {p.world_size} (TP {p.tensor_model_parallel_size}, "
            f"PP {p.pipeline_model_parallel_size}{chunks}, DP {p.data_parallel_size}), micro {t.micro_batch_size}, "
            f"global {t.global_batch_size}, {t.train_iters} iters"
        )


def _is_commit_sha(revision) -> bool:
    return isinstance(revision, str) and len(revision) == 40 and all(c in "0123456789abcdef" for c in revision)


def canonical_hash(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _diff_dicts(a: dict, b: dict, prefix: str = "") -> set[str]:
    out = set()
    for key in set(a) | set(b):
        dotted = f"{prefix}{key}"
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict) and key in SECTIONS:
            out |= _diff_dicts(va, vb, dotted + ".")
        elif va != vb:
            out.add(dotted)
    return out


# ----------------------------------------------------------------------------------------------
# Typed construction with messages for people
# ----------------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except UserError as exc:
                errors.append(exc)
        raise UserError(f"{where}: got {value!r} ({type(value).__name__}), expected {_type_name(tp)}")
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise UserError(f"{where}: got {value!r}, expected one of {_type_name(tp)}")
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads `5e-4` as a string; accept a number spelled that way
            return float(value)
        except ValueError:
            pass
    if tp is int and isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    expected = {list: list, dict: dict}.get(origin or tp, tp)
    if expected in (int, float, str, bool, list, dict):
        if isinstance(value, expected) and not (expected is int and isinstance(value, bool)):
            return value
        raise UserError(
            f"{where}: got {value!r} ({type(value).__name__}), expected {_type_name(tp)}"
        )
    return value


def _closest(key: str, valid: typing.Iterable[str]) -> str:
    match = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else ""


def _build_section(cls: type, values: Any, section: str):
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise UserError(f"recipe section '{section}' must be a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            elsewhere = [f"{name}.{key}" for name, other in SECTIONS.items()
                         if name != section and key in typing.get_type_hints(other)]
            hint = f"; it belongs in another section: '{elsewhere[0]}'" if elsewhere else _closest(key, hints)
            raise UserError(f"unknown key '{section}.{key}'{hint}")
        kwargs[key] = _coerce(value, hints[key], f"{section}.{key}")
    return cls(**kwargs)


def recipe_from_dict(raw: dict, source: str = "<dict>", overrides: Optional[list] = None) -> Recipe:
    if not isinstance(raw, dict):
        raise UserError(f"{source}: a recipe must be a YAML mapping")
    valid_top = set(TOP_LEVEL) | set(SECTIONS)
    for key in raw:
        if key not in valid_top:
            raise UserError(f"{source}: unknown key '{key}'{_closest(key, valid_top)}")
    for key in ("name", "version"):
        if key not in raw:
            raise UserError(f"{source}: missing '{key}' (every recipe names itself and pins a version)")
    top_hints = typing.get_type_hints(Recipe)
    top = {k: _coerce(raw[k], top_hints[k], k) for k in TOP_LEVEL if k in raw}
    sections = {name: _build_section(cls, raw.get(name), name) for name, cls in SECTIONS.items()}
    recipe = Recipe(**top, **sections, source=source, overrides=list(overrides or []))
    validate(recipe)
    return recipe


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


def _field_default(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


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


# ----------------------------------------------------------------------------------------------
# Overrides, recipe lookup and loading
# ----------------------------------------------------------------------------------------------


def _field_index() -> dict[str, list[str]]:
    """Bare field name -> the sections that hold it (names are unique today, but check)."""
    index: dict[str, list[str]] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            index.setdefault(f.name, []).append(section)
    return index


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `key=value` strings (`lr=1e-4` or `training.lr=1e-4`; YAML-typed values) to a raw
    recipe mapping. Types are checked afterwards by the schema like any other value."""
    raw = json.loads(json.dumps(raw))  # deep copy of plain data
    index = _field_index()
    for item in overrides:
        if "=" not in item:
            raise UserError(f"--set {item!r}: expected key=value, e.g. --set lr=1e-4")
        key, text = item.split("=", 1)
        key = key.strip()
        value = yaml.safe_load(text) if text.strip() else ""
        if key in TOP_LEVEL:
            raw[key] = value
            continue
        if "." in key:
            section, name = key.split(".", 1)
            if section not in SECTIONS:
                raise UserError(f"--set {key}: unknown section '{section}'{_closest(section, SECTIONS)}")
        else:
            name = key
            if name not in index:
                raise UserError(f"--set {key}: unknown key{_closest(name, index)}")
            if len(index[name]) > 1:
                raise UserError(f"--set {key}: ambiguous, say one of {[s + '.' + name for s in index[name]]}")
            section = index[name][0]
        raw.setdefault(section, {})
        if raw[section] is None:
            raw[section] = {}
        raw[section][name] = value
    return raw


def recipes_dir() -> Path:
    env = os.environ.get("MEGATRON_RECIPES_DIR")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "recipes"


def list_recipe_files() -> list[Path]:
    return sorted(recipes_dir().glob("*.yaml"))


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"cannot read recipe {path}: {exc.strerror}") from None
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None


def visible_gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA setup means "no GPUs" for recipe choice
        return 0


def resolve_recipe_path(spec: str, gpus: Optional[int] = None) -> Path:
    """A file path, a recipe name (file stem) or a family name. A family selects the variant whose
    `parallel.world_size` equals the number of visible GPUs, else its 8-GPU (largest) variant."""
    path = Path(spec)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.exists():
            raise UserError(f"recipe file {spec} does not exist")
        return path
    files = list_recipe_files()
    by_name = {f.stem: f for f in files}
    if spec in by_name:
        return by_name[spec]
    family = [(f, _read_yaml(f)) for f in files]
    family = [(f, raw) for f, raw in family if raw.get("family") == spec]
    if family:
        gpus = visible_gpu_count() if gpus is None else gpus
        sizes = {int((raw.get("parallel") or {}).get("world_size", 1)): f for f, raw in family}
        return sizes.get(gpus) or sizes[max(sizes)]
    families = sorted({raw.get("family") for raw in (_read_yaml(f) for f in files) if raw.get("family")})
    raise UserError(
        f"no recipe named '{spec}'{_closest(spec, list(by_name) + families)} "
        f"(known: {', '.join(sorted(by_name))}; families: {', '.join(families)})"
    )


def load_recipe(spec: str, overrides: Optional[list[str]] = None, gpus: Optional[int] = None) -> Recipe:
    path = resolve_recipe_path(spec, gpus)
    raw = apply_overrides(_read_yaml(path), list(overrides or []))
    return recipe_from_dict(raw, source=str(path), overrides=overrides)
