"""Megatron's legacy checkpoint format on disk: one module that training, convert and import-hf
share (layout, tracker file, nesting of model keys, the safe loader and the one atomic writer).
The facts it follows are written down in docs/checkpoint-format.md.

    {save}/latest_checkpointed_iteration.txt          the iteration number (or "release"), replaced last
    {save}/iter_{it:07d}/mp_rank_{tp:02d}/model_optim_rng.pt          (PP = 1)
    {save}/iter_{it:07d}/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt (PP > 1)

Writing: every rank file goes into `iter_{it}.tmp/` (written to a temporary name, fsynced,
renamed; its size and crc32 noted beside it), then one process writes `manifest.json` (every file's
size and crc32), renames the directory into place and replaces the tracker file, so a kill at any
moment leaves a complete checkpoint that the tracker (or, without one, the directory listing) finds.
Loading checks each file against the manifest (docs/checkpoint-format.md, "Verification").
"""

from __future__ import annotations

import argparse
import errno
import json
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import numpy as np
import torch

from megatron_core.errors import UserError
from megatron_core.files import publish_directory, remove_directory, replace_atomically

CHECKPOINT_VERSION = 3.0
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
MODEL_FILENAME = "model_optim_rng.pt"
OPTIM_STATE_KEYS = ("fp32_param", "exp_avg", "exp_avg_sq")  # per-parameter optimizer state, by model name

MANIFEST_FILENAME = "manifest.json"  # {file: size and crc32} of an iteration directory, written before publishing
_SUM_SUFFIX = ".crc32"  # a staged file's "size crc32", gathered into the manifest when the iteration is published
RELEASE = "release"  # the tracker's word for a checkpoint of weights only (import-hf, Megatron-LM releases)


def _numpy_array_globals() -> list:
    """What unpickling a plain numpy array needs: Megatron-LM saves np.random.get_state() in rng_state."""
    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct
    dtype_classes = [type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64, np.float32, np.int32)]
    return [_reconstruct, np.ndarray, np.dtype, *dtype_classes]


# What checkpoint files (ours and Megatron-LM's) hold beyond tensors and plain containers.
SAFE_GLOBALS = [argparse.Namespace, *_numpy_array_globals()]


class CheckpointError(UserError):
    """A checkpoint is missing, unreadable or does not fit this run."""


# ----------------------------------------------------------------------------------------------
# Model nesting (docs/checkpoint-format.md, "model: nesting and names")
# ----------------------------------------------------------------------------------------------

_EMBEDDING_PREFIX = "embedding."
_ENCODER_PREFIX = "encoder."
_OUTPUT_LAYER_PREFIX = "output_layer."
_HEAD_PREFIX = "word_embeddings_for_head."


def nest_model_state(flat: dict[str, torch.Tensor]) -> dict:
    """GPTModel.state_dict() -> Megatron's nested `model` dict."""
    lm: dict[str, Any] = {}
    nested: dict[str, Any] = {"language_model": lm}
    for key, value in flat.items():
        if key.startswith(_EMBEDDING_PREFIX):
            module, _, leaf = key[len(_EMBEDDING_PREFIX) :].partition(".")
            lm.setdefault("embedding", {}).setdefault(module, {})[leaf] = value
        elif key.startswith(_ENCODER_PREFIX):
            lm.setdefault("encoder", {})[key[len(_ENCODER_PREFIX) :]] = value
        elif key.startswith(_OUTPUT_LAYER_PREFIX):
            lm.setdefault("output_layer", {})[key[len(_OUTPUT_LAYER_PREFIX) :]] = value
        elif key.startswith(_HEAD_PREFIX):
            nested.setdefault("word_embeddings_for_head", {})[key[len(_HEAD_PREFIX) :]] = value
        else:
            raise ValueError(f"model parameter {key!r} has no place in Megatron's checkpoint layout")
    return nested


def flatten_model_state(nested: dict) -> dict[str, torch.Tensor]:
    """Megatron's nested `model` dict -> flat GPTModel.state_dict() keys (inverse of nest_model_state)."""
    flat: dict[str, torch.Tensor] = {}
    lm = nested.get("language_model", {})
    for module, leaves in lm.get("embedding", {}).items():
        for leaf, value in leaves.items():
            flat[f"{_EMBEDDING_PREFIX}{module}.{leaf}"] = value
    for key, value in lm.get("encoder", {}).items():
        flat[_ENCODER_PREFIX + key] = value
    for key, value in lm.get("output_layer", {}).items():
        flat[_OUTPUT_LAYER_PREFIX + key] = value
    for key, value in nested.get("word_embeddings_for_head", {}).items():
        flat[_HEAD_PREFIX + key] = value
    unknown = set(lm) - {"embedding", "encoder", "output_layer"}
    if unknown or set(nested) - {"language_model", "word_embeddings_for_head"}:
        raise CheckpointError(
            f"checkpoint model dict has unexpected entries {sorted(unknown)}; is it a Megatron GPT checkpoint?"
        )
    return flat


_MODEL_CHUNK_KEY = re.compile(r"^model(\d+)$")


def is_model_key(key) -> bool:
    """`model`, or `model0`, `model1`, ... (the interleaved schedule's chunks): a rank file's model entries."""
    return key == "model" or bool(_MODEL_CHUNK_KEY.match(str(key)))


def model_entries(nested_states: list[dict]) -> dict:
    """A rank file's model key(s) for its model chunks' nested dicts: `model` for one, `model0`,
    `model1`, ... for the virtual pipeline chunks of the interleaved schedule (Megatron's layout)."""
    if len(nested_states) == 1:
        return {"model": nested_states[0]}
    return {f"model{i}": state for i, state in enumerate(nested_states)}


def model_chunks(checkpoint: dict, where="checkpoint") -> list[dict]:
    """The nested model dict(s) of one rank file in chunk order: [model] or [model0, model1, ...]."""
    if "model" in checkpoint:
        return [checkpoint["model"]]
    found = sorted(int(m[1]) for m in map(_MODEL_CHUNK_KEY.match, checkpoint) if m)
    if not found:
        raise CheckpointError(
            f"{where} holds no 'model' (or 'model0', 'model1', ...) entry; it is not a model checkpoint"
        )
    if found != list(range(len(found))):
        raise CheckpointError(f"{where} holds model chunks {['model%d' % i for i in found]}; chunks are missing")
    return [checkpoint[f"model{i}"] for i in found]


# ----------------------------------------------------------------------------------------------
# Merging and splitting over TP x PP (docs/checkpoint-format.md, "Shapes per TP rank"): what convert
# and a resume under another layout share. A "full" state uses the canonical names: flat, global
# layer numbers, no word_embeddings_for_head (a copy of the word embedding). How each tensor splits
# is not written here: the model declares it (models.gpt.parameter_sharding, from the attributes its
# tensor-parallel layers set) and the caller passes that map in.
# ----------------------------------------------------------------------------------------------

LAYER_KEY = re.compile(r"^encoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class TensorSharding:
    """How one parameter lies across TP ranks, as its layer declared it."""

    partition_dim: Optional[int]  # the dim it is split along; None: whole (replicated) on every TP rank
    vocab_padded: bool = False  # its partition dim is the padded vocabulary


# {layer-generic name: sharding}; a transformer layer's parameters appear once, as `encoder.layers.*.<rest>`.
ShardingMap = Mapping[str, TensorSharding]


def layer_generic_name(name: str) -> str:
    """`encoder.layers.<i>.<rest>` -> `encoder.layers.*.<rest>`: a sharding map's key (every layer splits alike)."""
    match = LAYER_KEY.match(name)
    return f"encoder.layers.*.{match.group(2)}" if match else name


def sharding_of(sharding: ShardingMap, name: str) -> TensorSharding:
    """The declared sharding of checkpoint tensor `name`; a name the model does not have is refused."""
    found = sharding.get(layer_generic_name(name))
    if found is None:
        raise CheckpointError(
            f"the checkpoint holds {name!r}, which this GPT model does not have (its parameters: "
            f"{', '.join(sorted(sharding))}); only checkpoints of this project's GPT (Megatron's "
            "GPT layout) merge or split"
        )
    return found


def merge_rank_states(stage_states: dict, tp: int, pp: int, sharding: ShardingMap) -> dict[str, torch.Tensor]:
    """{(tp rank, pp rank): flat state, stage-local layer numbers} -> the full state. TP shards are
    concatenated along their partition dim; replicated tensors must be bitwise equal across TP ranks."""
    merged: dict[str, torch.Tensor] = {}
    layer_offset = 0
    for stage in range(pp):
        per_rank = [stage_states[(t, stage)] for t in range(tp)]
        names = list(per_rank[0])
        for t, names_t in enumerate(per_rank):
            if set(names_t) != set(names):
                diff = sorted(set(names) ^ set(names_t))[:4]
                raise CheckpointError(
                    f"TP rank {t} of stage {stage} holds different weights than rank 0 ({diff}); "
                    "shards from different models are mixed"
                )
        for name in names:
            parts = [r[name] for r in per_rank]
            dim = sharding_of(sharding, name).partition_dim
            if dim is None:
                full = parts[0]
                if any(not torch.equal(full, p) for p in parts[1:]):
                    raise CheckpointError(
                        f"stage {stage}: the TP ranks hold different copies of the replicated "
                        f"{name}; shards from different runs or iterations are mixed: copy one "
                        "checkpoint's shards"
                    )
            else:
                full = torch.cat(parts, dim=dim) if tp > 1 else parts[0]
            match = LAYER_KEY.match(name)
            if match:
                name = f"encoder.layers.{int(match.group(1)) + layer_offset}.{match.group(2)}"
            if name != _HEAD_PREFIX + "weight":
                merged[name] = full
        layer_offset += len({m.group(1) for m in map(LAYER_KEY.match, names) if m})
    return merged


def split_rank_state(
    state: dict, tp: int, pp: int, tp_rank: int, pp_rank: int, *, num_layers: int, tied: bool, sharding: ShardingMap
) -> dict[str, torch.Tensor]:
    """The full state -> one rank's flat state (the inverse of merge_rank_states for that rank)."""
    per_stage = num_layers // pp
    first, last = pp_rank == 0, pp_rank == pp - 1
    flat = {}
    for name, tensor in state.items():
        dim = sharding_of(sharding, name).partition_dim
        match = LAYER_KEY.match(name)
        if match:
            layer = int(match.group(1)) - pp_rank * per_stage
            names = [f"encoder.layers.{layer}.{match.group(2)}"] if 0 <= layer < per_stage else []
        elif name.startswith(_EMBEDDING_PREFIX):
            names = [name] if first else []
            if last and not first and tied and name == "embedding.word_embeddings.weight":
                names.append(_HEAD_PREFIX + "weight")
        else:  # final layernorm, output layer
            names = [name] if last else []
        for target in names:
            flat[target] = (tensor.chunk(tp, dim=dim)[tp_rank] if dim is not None else tensor).clone()
    return flat


# Under the interleaved schedule each PP rank holds `chunks` model chunks; chunk c of PP rank r is
# pipeline position c x PP + r of PP x chunks positions in model order (parallel_state.stage_layers),
# so the rules above serve it unchanged, one position per (PP rank, chunk).


def merge_chunked_states(rank_chunks: dict, tp: int, pp: int, sharding: ShardingMap) -> dict[str, torch.Tensor]:
    """{(tp rank, pp rank): [flat state of chunk 0, chunk 1, ...]} -> the full state."""
    chunks = len(next(iter(rank_chunks.values())))
    positions = {(t, c * pp + r): states[c] for (t, r), states in rank_chunks.items() for c in range(chunks)}
    return merge_rank_states(positions, tp, pp * chunks, sharding)


def split_chunked_state(
    state: dict,
    tp: int,
    pp: int,
    tp_rank: int,
    pp_rank: int,
    chunks: int,
    *,
    num_layers: int,
    tied: bool,
    sharding: ShardingMap,
) -> list[dict[str, torch.Tensor]]:
    """The full state -> one rank's flat states, one per model chunk (the inverse of merge_chunked_states)."""
    return [
        split_rank_state(
            state, tp, pp * chunks, tp_rank, c * pp + pp_rank, num_layers=num_layers, tied=tied, sharding=sharding
        )
        for c in range(chunks)
    ]


# ----------------------------------------------------------------------------------------------
# Paths
# ----------------------------------------------------------------------------------------------


def iteration_dir(save: Path, iteration) -> Path:
    return Path(save) / (RELEASE if iteration == RELEASE else f"iter_{iteration:07d}")


def rank_dirname(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """The one name of a (TP, PP) rank's directory (Megatron's `get_checkpoint_name`)."""
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


_RANK_DIRNAME = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


def parse_rank_dirname(name: str) -> Optional[tuple[int, int]]:
    """(tp rank, pp rank) of a rank directory's name, None for anything else (inverse of rank_dirname)."""
    match = _RANK_DIRNAME.match(name)
    return None if match is None else (int(match[1]), int(match[2] or 0))


def find_rank_files(iter_dir: Path) -> dict[tuple[int, int], Path]:
    """{(tp rank, pp rank): model file} of every rank directory in an iteration directory."""
    files = {}
    for child in sorted(Path(iter_dir).iterdir()):
        ranks = parse_rank_dirname(child.name)
        if ranks is None:
            continue
        if not (child / MODEL_FILENAME).exists():
            raise CheckpointError(
                f"shard {child} has no {MODEL_FILENAME}; the checkpoint is incomplete (re-save or copy it again)"
            )
        files[ranks] = child / MODEL_FILENAME
    if not files:
        raise CheckpointError(f"{iter_dir} holds no mp_rank_* shard folders; it is not a Megatron checkpoint")
    return files


def check_rank_files(iter_dir: Path, found, tp: int, pp: int) -> None:
    """Refuse a checkpoint whose (tp, pp) rank files are not exactly those of TP tp x PP pp."""
    expected = {(t, p) for t in range(tp) for p in range(pp)}
    missing, extra = sorted(expected - set(found)), sorted(set(found) - expected)
    if missing:
        raise CheckpointError(
            f"{iter_dir}: missing shard(s) {missing} (tp, pp) for TP {tp} x PP {pp}; copy the whole iteration folder"
        )
    if extra:
        raise CheckpointError(
            f"{iter_dir}: extra shard(s) {extra} (tp, pp) beyond TP {tp} x PP {pp} of the args; "
            "shards of another layout are mixed in: remove them"
        )


def distrib_optim_filename(dp_rank: int) -> str:
    """Each DP rank's file of distributed-optimizer pieces, beside its (TP, PP) rank's model file."""
    return f"distrib_optim_dp_{dp_rank:03d}.pt"


def staging_dir(save: Path, iteration) -> Path:
    """Where an iteration is written before it is published."""
    final = iteration_dir(save, iteration)
    return final.with_name(final.name + ".tmp")


def read_tracker(load: Path):
    """The latest iteration saved under `load` (an int, or "release" for weights only), or None when
    there is no checkpoint there."""
    tracker = Path(load) / TRACKER_FILENAME
    if not tracker.exists():
        return None
    try:
        text = tracker.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(
            f"{tracker} holds bytes that are not text, not an iteration number; delete it or "
            "point --load at a valid checkpoint directory"
        ) from None
    if text == RELEASE:
        return RELEASE
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(
            f"{tracker} holds {text!r}, not an iteration number; delete it or point "
            "--load at a valid checkpoint directory"
        ) from None


# ----------------------------------------------------------------------------------------------
# Load / write
# ----------------------------------------------------------------------------------------------


def _crc32_file(path: Path) -> tuple[int, int]:
    """(size, crc32) of a file, read in large chunks (zlib releases the GIL while it hashes)."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as handle:
        while chunk := handle.read(16 << 20):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return size, crc


def manifest_paths(iter_dir: Path) -> list[Path]:
    """manifest.json and, on nodes without a shared disk, each other node's manifest-rank<R>.json: gathered
    into one directory, every node's files stay verified."""
    return sorted(Path(iter_dir).glob("manifest*.json"))


def read_manifest(iter_dir: Path) -> Optional[dict[str, tuple[int, int]]]:
    """{path relative to the iteration directory: (size, crc32)} of all its manifests, or None for a
    checkpoint written without one (before manifests, or by Megatron-LM): those load unverified."""
    paths = manifest_paths(iter_dir)
    if not paths:
        return None
    merged: dict[str, tuple[int, int]] = {}
    for path in paths:
        try:
            files = json.loads(path.read_text(encoding="utf-8"))["files"]
            merged.update({name: (int(entry["size"]), int(entry["crc32"], 16)) for name, entry in files.items()})
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            raise CheckpointError(
                f"{path} is damaged ({type(exc).__name__}); the checkpoint cannot be verified"
            ) from None
    return merged


def verify_file(path: Path) -> None:
    """Check a rank file against its iteration's manifest (a no-op where there is none)."""
    path = Path(path)
    iter_dir = path.parent.parent
    if parse_rank_dirname(path.parent.name) is None or not manifest_paths(iter_dir):
        return
    expected = read_manifest(iter_dir).get(f"{path.parent.name}/{path.name}")
    if expected is None:  # copied in from another node's folder without that node's manifest-rank<R>.json
        return
    size, crc = _crc32_file(path)
    if (size, crc) != expected:
        raise CheckpointError(
            f"{path} fails verification ({size} bytes, crc32 {crc:08x}; the manifest says "
            f"{expected[0]} bytes, crc32 {expected[1]:08x}): the file is damaged or comes from "
            "another save"
        )


def check_complete(iter_dir: Path) -> None:
    """Cheap completeness (no reading): every file the manifest lists is there with its size; without a
    manifest, every rank directory holds its model file. Raises CheckpointError naming what is wrong."""
    manifest = read_manifest(iter_dir)
    if manifest is None:
        find_rank_files(iter_dir)
        return
    for name, (size, _) in manifest.items():
        path = Path(iter_dir) / name
        if not path.is_file() or path.stat().st_size != size:
            raise CheckpointError(
                f"{path} is missing or truncated (the manifest says {size} bytes); the checkpoint is incomplete"
            )


def load_checkpoint_file(path) -> dict:
    """torch.load(weights_only=True) with our explicit allow-list (argparse.Namespace), after checking
    the file against its iteration's manifest."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint file {path} does not exist")
    verify_file(path)
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - a truncated or foreign file: one message for people
            raise CheckpointError(
                f"cannot read checkpoint {path}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from None


def _is_disk_full(exc: BaseException) -> bool:
    """ENOSPC as Python raises it, or as torch's zip writer reports a short write."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("unexpected pos" in text or "file write failed" in text)


def atomic_torch_save(obj: Any, path: Path) -> tuple[int, int]:
    """torch.save through files.replace_atomically; returns the file's (size, crc32), read back from the
    page cache before the fsync."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    result: list = []

    def write(tmp: Path) -> None:
        torch.save(obj, tmp)
        result.append(_crc32_file(tmp))

    replace_atomically(path, write)
    return result[0]


def atomic_write_text(path: Path, text: str) -> None:
    replace_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


TOKENIZER_FILES = ("vocab.json", "merges.txt")  # kept in the checkpoint directory, beside the tracker
RECIPE_FILENAME = "recipe.yaml"  # the resolved recipe of the run that wrote the checkpoint directory


def tokenizer_copies(save: Path) -> tuple[Path, Path]:
    """Where a checkpoint directory keeps its tokenizer (what training and import-hf write there)."""
    return Path(save) / TOKENIZER_FILES[0], Path(save) / TOKENIZER_FILES[1]


def write_tokenizer_files(save: Path, vocab_file, merge_file) -> None:
    """Copy the tokenizer into the checkpoint directory (each file atomically), so the directory
    converts and evaluates on its own."""
    for source, target in zip((vocab_file, merge_file), tokenizer_copies(save)):
        replace_atomically(target, lambda tmp, source=source: shutil.copyfile(source, tmp))


def write_rank_file(
    save: Path, iteration, tp_rank: int, pp_rank: int, pp_size: int, state: dict, filename: str = MODEL_FILENAME
) -> Path:
    """One rank's file into the iteration's staging directory (atomic, fsynced), its size and crc32
    beside it for the manifest. A full disk removes the staging directory and says so in one line."""
    staging = staging_dir(Path(save), iteration)
    path = staging / rank_dirname(tp_rank, pp_rank, pp_size) / filename
    try:
        size, crc = atomic_torch_save(state, path)
        path.with_name(path.name + _SUM_SUFFIX).write_text(f"{size} {crc:08x}\n")
    except (OSError, RuntimeError) as exc:
        if not _is_disk_full(exc):
            raise
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(
            f"no space left on device while saving iteration {iteration} into {staging} "
            "(removed the partial copy; the previous checkpoint is intact): free space, or "
            "--save elsewhere"
        ) from None
    return path


def write_manifest(staging: Path, iteration, name: str = MANIFEST_FILENAME) -> None:
    """Gather the staged files' sizes and crc32s into the manifest `name` (fsynced), dropping the notes."""
    files = {}
    for path in sorted(p for p in Path(staging).rglob("*") if p.is_file()):
        rel = path.relative_to(staging).as_posix()
        if (path.parent == Path(staging) and path.name.startswith("manifest")) or path.name.endswith(_SUM_SUFFIX):
            continue
        note = path.with_name(path.name + _SUM_SUFFIX)
        if note.exists():
            size_text, crc_text = note.read_text().split()
            size, crc = int(size_text), int(crc_text, 16)
        else:  # written by another path than write_rank_file: hash it now
            size, crc = _crc32_file(path)
        files[rel] = {"size": size, "crc32": f"{crc:08x}"}
    text = json.dumps({"iteration": iteration, "checksum": "crc32", "files": files}, indent=1) + "\n"
    atomic_write_text(Path(staging) / name, text)
    for note in Path(staging).rglob("*" + _SUM_SUFFIX):
        note.unlink()


_ITERATION_DIR = re.compile(r"^iter_(\d{7})(\.old)?$")


def published_iterations(save: Path) -> dict[int, Path]:
    """{iteration: directory} of every iteration directory under `save`, newest first. An iteration
    found only as `iter_N.old` (a re-save of N stopped between its two renames) counts as N."""
    found: dict[int, Path] = {}
    if not Path(save).is_dir():
        return found
    for child in Path(save).iterdir():
        match = _ITERATION_DIR.match(child.name)
        if match and child.is_dir() and (not match[2] or int(match[1]) not in found):
            found[int(match[1])] = child
    return dict(sorted(found.items(), reverse=True))


def read_tracker_leniently(load: Path) -> tuple[Any, Optional[str]]:
    """(iteration or "release" or None, what is wrong with the tracker or None): never raises."""
    try:
        value = read_tracker(load)
    except CheckpointError as exc:
        return None, str(exc).split(";")[0]
    if value is not None and not iteration_dir(load, value).is_dir():
        if value != RELEASE and published_iterations(load).get(value) is not None:
            return value, None  # only its .old copy is there: still this iteration
        return None, f"{Path(load) / TRACKER_FILENAME} names iteration {value}, whose directory is missing"
    return value, None


def _point_tracker_before(save: Path, iteration: int) -> None:
    """Before iter_N (which the tracker names) is moved aside: point the tracker at the newest complete
    older iteration, or remove it where there is none (the directory listing then finds iter_N/.old)."""
    for older, where in published_iterations(save).items():
        if iteration != RELEASE and older < iteration:
            try:
                check_complete(where)
            except CheckpointError:
                continue
            atomic_write_text(save / TRACKER_FILENAME, f"{older}\n")
            return
    (save / TRACKER_FILENAME).unlink(missing_ok=True)


def prune_iterations(save: Path, iteration: int, keep_last: Optional[int]) -> list[Path]:
    """Delete iteration directories older than the newest `keep_last` up to `iteration` (None or 0:
    keep all). Each is renamed away first so a half-deleted one is never taken for a checkpoint."""
    if not keep_last or not isinstance(iteration, int):
        return []
    older = [(n, d) for n, d in published_iterations(save).items() if n <= iteration][keep_last:]
    removed = []
    for _, where in older:
        remove_directory(where)
        removed.append(where)
    return removed


def publish_iteration(
    save: Path, iteration, keep_last: Optional[int] = None, manifest_name: str = MANIFEST_FILENAME
) -> Path:
    """Move the staged iteration into place, then the tracker; then drop all but the newest
    `keep_last` iterations. The tracker never names a directory that is not there: re-saving the
    iteration it names first points it at the previous complete one (docs/checkpoint-format.md).
    `manifest_name`: a node that publishes its own ranks' files (no shared disk) names its manifest apart."""
    save = Path(save)
    final_dir, tmp_dir = iteration_dir(save, iteration), staging_dir(save, iteration)
    write_manifest(tmp_dir, iteration, manifest_name)
    old = final_dir.with_name(final_dir.name + ".old")
    if final_dir.exists() and read_tracker_leniently(save)[0] == iteration:
        _point_tracker_before(save, iteration)  # re-saving the tracker's iteration
    publish_directory(tmp_dir, final_dir, set_aside=old)  # a re-saved iteration's old copy waits in .old
    atomic_write_text(save / TRACKER_FILENAME, f"{iteration}\n")
    shutil.rmtree(old, ignore_errors=True)
    prune_iterations(save, iteration, keep_last)
    return final_dir


def write_checkpoint(
    save, models: dict, args: argparse.Namespace, iteration: Union[int, str], extra: Optional[dict] = None
) -> Path:
    """Write {(tp, pp): nested model dict} from one process as a model-only checkpoint (what
    import-hf and the converters write), through the same staging and publishing as training.
    A list of nested dicts for a rank is its virtual pipeline chunks (model0, model1, ...)."""
    save = Path(save)
    pp_size = 1 + max(p for _, p in models)
    shutil.rmtree(staging_dir(save, iteration), ignore_errors=True)
    for (tp_rank, pp_rank), model in sorted(models.items()):
        payload = {
            "args": args,
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration,
            **model_entries(model if isinstance(model, list) else [model]),
            **(extra or {}),
        }
        write_rank_file(save, iteration, tp_rank, pp_rank, pp_size, payload)
    return publish_iteration(save, iteration)
