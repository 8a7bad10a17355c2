"""Read a Megatron-layout checkpoint of any (TP, PP) layout and version into one full state.

The merged state uses our canonical names (docs/checkpoint-format.md: flat, global layer numbers) and
the checkpoint_version 2.0/3.0 QKV row order (per head [q, k, v]):

    embedding.word_embeddings.weight, embedding.position_embeddings.weight,
    encoder.layers.{i}.{input_layernorm, self_attention.query_key_value, self_attention.dense,
                       post_attention_layernorm, mlp.dense_h_to_4h, mlp.dense_4h_to_h}.{weight,bias},
    encoder.final_layernorm.{weight,bias}, output_layer.weight (untied only)

`split_state` is the inverse: full state -> per-(tp, pp) nested `model` dicts.

Checkpoints of the interleaved schedule hold `model0`, `model1`, ... (one per virtual pipeline
chunk) instead of `model` in each rank file; chunk c of PP rank r holds the layers of pipeline
position c x PP + r (parallel_state.stage_layers), with stage-local layer numbers as always.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch

from megatron_core.checkpoint_format import (
    LAYER_KEY,
    RELEASE,
    TRACKER_FILENAME,
    ShardingMap,
    check_rank_files,
    find_rank_files,
    is_model_key,
    iteration_dir,
    layer_generic_name,
    load_checkpoint_file,
    merge_chunked_states,
    model_chunks,
    nest_model_state,
    read_tracker,
    split_chunked_state,
)
from megatron_core.config import ModelSpec
from megatron_core.errors import UserError
from megatron_core.log import get_logger
from megatron_core.models.gpt import parameter_sharding

_LOG = get_logger(__name__, tag="convert")

# Older and newer Megatron spellings -> ours (applied to the flattened key, in order).
_RENAMES = (
    (re.compile(r"^transformer\."), "encoder."),
    (re.compile(r"\.attention\."), ".self_attention."),
    (re.compile(r"\.input_norm\."), ".input_layernorm."),
    (re.compile(r"\.post_attention_norm\."), ".post_attention_layernorm."),
    (re.compile(r"^encoder\.final_norm\."), "encoder.final_layernorm."),
)


@dataclass
class MergedCheckpoint:
    state: dict  # canonical flat name -> full tensor
    spec: ModelSpec  # the checkpoint's shape and layout; padded vocab and tied embeddings as its weights are
    args: Any
    iteration: Union[int, str]
    checkpoint_version: float
    tensor_parallel: int
    pipeline_parallel: int
    dtype: torch.dtype
    recipe: Optional[dict] = None
    recipe_hash: Optional[str] = None
    source: str = ""
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------


def load_shard_file(path: Path) -> dict:
    """One model_optim_rng.pt, with the training engineer's allow-listed loader when it exists."""
    try:
        obj = load_checkpoint_file(path)
    except UserError:
        raise
    except Exception as exc:  # pickle / zip errors: not a checkpoint we can read
        raise UserError(
            f"{path} is not a readable Megatron checkpoint ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
            "point --load at a directory written by Megatron-LM or megatron_core training"
        ) from None
    if not isinstance(obj, dict) or not any(map(is_model_key, obj)):
        raise UserError(
            f"{path} is not a Megatron checkpoint (no 'model' or 'model0' key); point --load at a Megatron save dir"
        )
    return obj


def resolve_iteration_dir(load_dir: Union[str, Path], iteration=None) -> tuple[Path, Union[int, str]]:
    """`iteration` None/'latest' reads the tracker file; 'release' or an int names the folder."""
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        raise UserError(f"checkpoint directory {load_dir} does not exist; give --load a run's checkpoints")
    if iteration is None or iteration == "latest":
        iteration = read_tracker(load_dir)  # the one tracker reader (it names a malformed file)
        if iteration is None:
            found = sorted(p.name for p in load_dir.glob("iter_*"))
            hint = f" (found {', '.join(found)}; pass --iteration N)" if found else ""
            raise UserError(f"{load_dir} is not a Megatron checkpoint directory: no {TRACKER_FILENAME}{hint}")
    elif iteration != RELEASE:
        iteration = _parse_int(str(iteration), "--iteration")
    path = iteration_dir(load_dir, iteration)
    if not path.is_dir():
        raise UserError(f"{path} does not exist; the checkpoint has no iteration {iteration}")
    return path, iteration


def _parse_int(text: str, where) -> int:
    try:
        return int(text)
    except ValueError:
        raise UserError(f"{where}: expected an iteration number or 'release', got {text!r}") from None


# ----------------------------------------------------------------------------------------------
# Reading and merging
# ----------------------------------------------------------------------------------------------


def _arg(args, name, default=None):
    return getattr(args, name, default) if args is not None else default


def flatten_nested(nested: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in nested.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_nested(value, name + "."))
        elif isinstance(value, torch.Tensor):
            flat[name] = value
        # non-tensor entries (e.g. `_extra_state` None) carry no weights
    return flat


def canonical_names(model: dict) -> dict:
    """A shard's `model` dict -> flat canonical names (stage-local layer numbers)."""
    language_model = model.get("language_model", model)
    flat = flatten_nested(language_model)
    if "word_embeddings_for_head" in model:
        flat.update(flatten_nested({"word_embeddings_for_head": model["word_embeddings_for_head"]}))
    out = {}
    for key, tensor in flat.items():
        if key.endswith("._extra_state") or key.endswith(".inv_freq"):
            continue
        for pattern, replacement in _RENAMES:
            key = pattern.sub(replacement, key)
        out[key] = tensor
    return out  # names the model does not have are refused when the shards are merged (_merge)


def to_canonical_qkv(tensor: torch.Tensor, version: float, heads_local: int) -> torch.Tensor:
    """Reorder one TP shard's QKV rows to the v2/v3 order [np, 3, hn] (docs/checkpoint-format.md, QKV row order)."""
    if version >= 2.0:
        return tensor
    rest = tensor.shape[1:]
    hn = tensor.shape[0] // (3 * heads_local)
    if version == 0:  # [3, np, hn]
        t = tensor.view(3, heads_local, hn, *rest).transpose(0, 1)
    else:  # 1.0: [np, hn, 3]
        t = tensor.view(heads_local, hn, 3, *rest).transpose(1, 2)
    return t.contiguous().view(tensor.shape)


def _check_same(shards: dict, key: str, where: str) -> Any:
    values = {pos: ck.get(key) for pos, ck in shards.items()}
    distinct = {repr(v) for v in values.values()}
    if len(distinct) > 1:
        detail = ", ".join(f"mp_rank {pos}: {v!r}" for pos, v in sorted(values.items()))
        raise UserError(
            f"shards of {where} disagree on '{key}' ({detail}); they come from different runs or "
            "iterations: copy one checkpoint's shards together"
        )
    return next(iter(values.values()))


def read_checkpoint(load_dir, iteration=None) -> MergedCheckpoint:
    """Read, check and merge every shard of one iteration."""
    iter_dir, iteration = resolve_iteration_dir(load_dir, iteration)
    files = find_rank_files(iter_dir)
    _LOG.info(f"reading {len(files)} shard(s) from {iter_dir}")
    shards = {pos: load_shard_file(path) for pos, path in files.items()}
    first = shards[min(shards)]
    args = first.get("args")
    tp = _arg(args, "tensor_model_parallel_size", 1 + max(t for t, _ in shards))
    pp = _arg(args, "pipeline_model_parallel_size", 1 + max(p for _, p in shards))
    check_rank_files(iter_dir, shards, tp, pp)
    for key in ("iteration", "recipe_hash", "checkpoint_version"):
        _check_same(shards, key, iter_dir)
    args_seen = {
        pos: (
            _arg(c.get("args"), "tensor_model_parallel_size"),
            _arg(c.get("args"), "pipeline_model_parallel_size"),
            _arg(c.get("args"), "num_layers"),
            _arg(c.get("args"), "hidden_size"),
        )
        for pos, c in shards.items()
    }
    if len(set(args_seen.values())) > 1:
        raise UserError(
            f"{iter_dir}: shards disagree on the model/parallel args {args_seen}; they come from "
            "different runs: copy one checkpoint's shards together"
        )
    if iteration != "release" and first.get("iteration") not in (None, iteration):
        raise UserError(
            f"{iter_dir}: shards say iteration {first.get('iteration')}, folder says {iteration}; "
            "the folder was renamed or mixed up"
        )
    version = float(first.get("checkpoint_version", 0) or 0)
    # The layout is the shards' (older args may not say it); the shape must split over it.
    spec = dataclasses.replace(ModelSpec.from_args(args), tp=tp, pp=pp)
    # Only the rules the weights obey: a run's sequence parallelism or world size does not shape its files.
    dataclasses.replace(spec, sequence_parallel=False, world_size=None).check("the args do not match the shards")
    chunk_states = {pos: [canonical_names(m) for m in model_chunks(ck, files[pos])] for pos, ck in shards.items()}
    chunks = _check_same({pos: {"model chunks": len(c)} for pos, c in chunk_states.items()}, "model chunks", iter_dir)
    recorded = _arg(args, "virtual_pipeline_model_parallel_size")
    if (recorded or 1) != chunks:
        raise UserError(
            f"{iter_dir}: the shards hold {chunks} model chunk(s) each but args.virtual_pipeline_model_"
            f"parallel_size is {recorded}; the args do not match the shards"
        )
    state = _merge(chunk_states, version, spec, tp, pp)  # positions in model order: chunk c of PP rank r is c x PP + r
    embedding = state["embedding.word_embeddings.weight"]
    spec = dataclasses.replace(
        spec,
        padded_vocab_size=spec.padded_vocab_size or embedding.shape[0],
        tied_embeddings="output_layer.weight" not in state,
    )
    return MergedCheckpoint(
        state=state,
        spec=spec,
        args=args,
        iteration=iteration,
        checkpoint_version=version,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        dtype=embedding.dtype,
        recipe=first.get("recipe"),
        recipe_hash=first.get("recipe_hash"),
        source=str(iter_dir),
    )


def _sharding(spec: ModelSpec, *, tied: bool) -> ShardingMap:
    """How the GPT of this shape splits each weight over TP, as its layers declare it (models.gpt)."""
    return parameter_sharding(spec.to_model_config(untie_embeddings_and_output_weights=not tied))


def _merge(chunk_states: dict, version: float, shape: ModelSpec, tp: int, pp: int) -> dict:
    """{(tp, pp): [flat state per model chunk]} -> the full canonical state."""
    heads_local = shape.num_attention_heads // tp
    flats = [f for states in chunk_states.values() for f in states]
    # Tied or not as the shards hold it (older args may not say), the model's own map splits them.
    sharding = _sharding(shape, tied=not any("output_layer.weight" in flat for flat in flats))
    unknown = sorted({n for flat in flats for n in flat if layer_generic_name(n) not in sharding})
    if unknown:
        raise UserError(f"checkpoint has weights this converter does not know: {unknown[:5]}; only GPT models convert")
    for flat in flats:  # older QKV row orders -> 2.0/3.0
        for name in [n for n in flat if n.endswith(("query_key_value.weight", "query_key_value.bias"))]:
            flat[name] = to_canonical_qkv(flat[name], version, heads_local)
    merged = merge_chunked_states(chunk_states, tp, pp, sharding)
    layers = len({m.group(1) for m in map(LAYER_KEY.match, merged) if m})
    if layers != shape.num_layers:
        raise UserError(
            f"the shards hold {layers} layers but args.num_layers is {shape.num_layers}; "
            "a pipeline stage is missing or the args are wrong"
        )
    return merged


# ----------------------------------------------------------------------------------------------
# Splitting (import back, test fixtures)
# ----------------------------------------------------------------------------------------------


def split_state(state: dict, shape: ModelSpec) -> dict[tuple[int, int], Any]:
    """Full canonical state -> {(tp_rank, pp_rank): nested Megatron `model` dict} over the spec's TP x PP;
    with virtual pipeline stages, {(tp_rank, pp_rank): [nested dict of chunk 0, chunk 1, ...]} in
    Megatron's interleaved layout (what `model_entries` writes as model0, model1, ...)."""
    shape.check("choose a --tp/--pp that divides the model")
    tp, pp, vls = shape.tp, shape.pp, shape.layers_per_virtual_stage
    chunks = 1 if vls is None else shape.num_layers // (pp * vls)
    sharding = _sharding(shape, tied=shape.tied_embeddings)
    out: dict[tuple[int, int], Any] = {}
    for stage in range(pp):
        for rank in range(tp):
            nested = [
                nest_model_state(flat)
                for flat in split_chunked_state(
                    state,
                    tp,
                    pp,
                    rank,
                    stage,
                    chunks,
                    num_layers=shape.num_layers,
                    tied=shape.tied_embeddings,
                    sharding=sharding,
                )
            ]
            out[(rank, stage)] = nested[0] if vls is None else nested
    return out
