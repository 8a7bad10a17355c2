"""The recipe schema: one dataclass per section, the `Recipe` with its derived values, and the
resolved dictionary whose hash names every output. The one place defaults live.

Field names are Megatron-LM's command-line flags with underscores; defaults equal Megatron-LM's where
it has one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional

import yaml

from megatron_core.config.hashing import canonical_hash, stage_hash
from megatron_core.config.resume import RUN_EXTENDING_KEYS


@dataclass(frozen=True)
class CorpusSource:
    """One place the corpus's documents come from, written in a recipe as a mapping whose `type` is the
    subclass's TYPE. A subclass's fields are the mapping's other keys; megatron_core.data.corpus reads it."""

    TYPE: ClassVar[str]

    def to_dict(self) -> dict:
        """The source resolved: `type` and every key, defaults included (as every other section)."""
        out: dict[str, Any] = {"type": self.TYPE}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


@dataclass(frozen=True)
class PythonStdlibSource(CorpusSource):
    """The running interpreter's standard-library `.py` files (site-packages and non-UTF-8 files left out),
    sorted by relative path, or with `shuffle_seed` in a fixed pseudo-random order of those paths (so that
    Megatron's contiguous valid/test split samples the whole library, not its last packages)."""

    TYPE: ClassVar[str] = "python-stdlib"
    shuffle_seed: Optional[int] = None


@dataclass(frozen=True)
class JsonlSource(CorpusSource):
    """`.jsonl` / `.jsonl.gz` files: `paths` (files or globs, in order; one may be a string), the text
    under `key` of each line."""

    TYPE: ClassVar[str] = "jsonl"
    paths: tuple[str, ...]
    key: str = "content"


@dataclass(frozen=True)
class HfDatasetSource(CorpusSource):
    """A dataset through the `datasets` library: a Hub id at `revision` (a commit sha, or a branch or tag
    whose commit the corpus records), or a local directory (save_to_disk, or parquet/json files)."""

    TYPE: ClassVar[str] = "hf-dataset"
    name: str
    revision: Optional[str] = None
    split: str = "train"
    key: str = "content"


# The source types a recipe may name. A new one is a dataclass here and its reader in data/corpus.py.
SOURCE_TYPES: dict[str, type[CorpusSource]] = {
    cls.TYPE: cls for cls in (PythonStdlibSource, JsonlSource, HfDatasetSource)
}


@dataclass
class CorpusConfig:
    """Where the loose-JSON corpus comes from (read in order, see megatron_core.data.corpus)."""

    sources: tuple[CorpusSource, ...] = field(default_factory=lambda: (PythonStdlibSource(),))
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
    # auto (the same as sdpa): F.scaled_dot_product_attention; unfused: softmax(QK^T)V through the softmax
    # fusion. The same function either way: changing it on resume is safe.
    attention_backend: Literal["auto", "sdpa", "unfused"] = "auto"

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
    fusions: Literal["auto", "triton", "apex", "torch"] = "auto"
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
        """ "fp16", "bf16" or "fp32": the training precision the recipe asks for."""
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
        out["corpus"]["sources"] = [source.to_dict() for source in self.corpus.sources]
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
        named = [
            (f"corpus.sources[{i}].revision", source.revision)
            for i, source in enumerate(self.corpus.sources)
            if isinstance(source, HfDatasetSource)
        ]
        if self.tokenizer.hf_tokenizer is not None:
            named.append(("tokenizer.hf_tokenizer_revision", self.tokenizer.hf_tokenizer_revision))
        return [f"{key}={value}" for key, value in named if not _is_commit_sha(value)]

    def stage_hash(self, stage: str) -> str:
        """Hash of exactly what a pipeline stage's output depends on (see hashing.stage_hash)."""
        return stage_hash(self.to_dict(), stage, run_extending=RUN_EXTENDING_KEYS)

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
