"""Megatron legacy checkpoints: layout, atomic save, safe load, exact-resume state.

    {save}/latest_checkpointed_iteration.txt          the iteration number, replaced last
    {save}/iter_{it:07d}/mp_rank_{tp:02d}/model_optim_rng.pt          (PP = 1)
    {save}/iter_{it:07d}/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt (PP > 1)

Every (TP, PP) rank with DP rank 0 writes its own file into `iter_{it}.tmp/`, all ranks meet at a
barrier, global rank 0 renames the directory into place and then replaces the tracker file, so a
kill at any moment leaves the previous checkpoint complete and the tracker pointing at it.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.errors import UserError

CHECKPOINT_VERSION = 3.0
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
MODEL_FILENAME = "model_optim_rng.pt"
DISTRIB_OPTIM_FILENAME = "distrib_optim.pt"  # the distributed optimizer's gathered shards, beside the model file

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
# Model nesting (conventions item 2)
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
            module, _, leaf = key[len(_EMBEDDING_PREFIX):].partition(".")
            lm.setdefault("embedding", {}).setdefault(module, {})[leaf] = value
        elif key.startswith(_ENCODER_PREFIX):
            lm.setdefault("encoder", {})[key[len(_ENCODER_PREFIX):]] = value
        elif key.startswith(_OUTPUT_LAYER_PREFIX):
            lm.setdefault("output_layer", {})[key[len(_OUTPUT_LAYER_PREFIX):]] = value
        elif key.startswith(_HEAD_PREFIX):
            nested.setdefault("word_embeddings_for_head", {})[key[len(_HEAD_PREFIX):]] = value
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
        raise CheckpointError(f"checkpoint model dict has unexpected entries {sorted(unknown)}; "
                              "is it a Megatron GPT checkpoint?")
    return flat


# ----------------------------------------------------------------------------------------------
# Paths
# ----------------------------------------------------------------------------------------------


def iteration_dir(save: Path, iteration) -> Path:
    return Path(save) / (RELEASE if iteration == RELEASE else f"iter_{iteration:07d}")


def rank_dirname(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def checkpoint_file(save: Path, iteration: int, tp_rank: int = 0, pp_rank: int = 0, pp_size: int = 1) -> Path:
    return iteration_dir(save, iteration) / rank_dirname(tp_rank, pp_rank, pp_size) / MODEL_FILENAME


def read_tracker(load: Path):
    """The latest iteration saved under `load` (an int, or "release" for weights only), or None when
    there is no checkpoint there."""
    tracker = Path(load) / TRACKER_FILENAME
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    if text == RELEASE:
        return RELEASE
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{tracker} holds {text!r}, not an iteration number; delete it or point "
                              "--load at a valid checkpoint directory") from None


def _my_rank_file(save: Path, iteration: int, tmp: bool = False) -> Path:
    directory = iteration_dir(save, iteration)
    if tmp:
        directory = directory.with_name(directory.name + ".tmp")
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    name = rank_dirname(parallel_state.get_tensor_model_parallel_rank(),
                        parallel_state.get_pipeline_model_parallel_rank(), pp_size)
    return directory / name / MODEL_FILENAME


# ----------------------------------------------------------------------------------------------
# Load / save one file
# ----------------------------------------------------------------------------------------------


def load_checkpoint_file(path) -> dict:
    """torch.load(weights_only=True) with our explicit allow-list (argparse.Namespace)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint file {path} does not exist")
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - a truncated or foreign file: one message for people
            raise CheckpointError(f"cannot read checkpoint {path}: {type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0] if str(exc) else ''}") from None


def _atomic_torch_save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# ----------------------------------------------------------------------------------------------
# RNG state (weights_only-safe: numpy's state as a tensor, not an ndarray pickle)
# ----------------------------------------------------------------------------------------------


def get_rng_state() -> dict:
    from megatron_core.tensor_parallel.random import get_rng_tracker

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                         "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": get_rng_tracker().get_states(),
    }
    return state


def set_rng_state(state: dict) -> None:
    from megatron_core.tensor_parallel.random import get_rng_tracker

    version, internal, gauss = state["random_rng_state"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["np_rng_state"]
    np.random.set_state((np_state["kind"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch_rng_state"])
    if state.get("cuda_rng_state") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    if state.get("rng_tracker_states"):
        get_rng_tracker().set_states(state["rng_tracker_states"])


# ----------------------------------------------------------------------------------------------
# Megatron args
# ----------------------------------------------------------------------------------------------


def megatron_args(recipe, padded_vocab_size: int, *, iteration: int, consumed_train_samples: int,
                  params_dtype: str) -> argparse.Namespace:
    """The `args` Namespace with Megatron's names (what the HF converter and Megatron tools read).
    Only plain Python values, so weights_only loading needs nothing but Namespace itself."""
    m, p, t = recipe.model, recipe.parallel, recipe.training
    return argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_size, seq_length=m.seq_length, max_position_embeddings=m.max_position_embeddings,
        padded_vocab_size=padded_vocab_size, make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std, layernorm_epsilon=m.layernorm_epsilon,
        bias_gelu_fusion=m.bias_gelu_fusion, openai_gelu=m.openai_gelu,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        tokenizer_type=recipe.tokenizer.tokenizer_type,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size, world_size=p.world_size,
        data_parallel_size=p.data_parallel_size, sequence_parallel=p.sequence_parallel,
        use_distributed_optimizer=p.use_distributed_optimizer,
        micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size, train_iters=t.train_iters,
        lr=t.lr, min_lr=t.min_lr, lr_decay_style=t.lr_decay_style, lr_warmup_iters=t.lr_warmup_iters,
        lr_decay_iters=t.decay_iters, weight_decay=t.weight_decay, clip_grad=t.clip_grad,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
        fp16=t.fp16, bf16=t.bf16, params_dtype=params_dtype, seed=t.seed,
        iteration=iteration, consumed_train_samples=consumed_train_samples,
    )


# ----------------------------------------------------------------------------------------------
# Save / load a whole training state
# ----------------------------------------------------------------------------------------------


def save_checkpoint(save, iteration: int, *, model_state: dict, args: argparse.Namespace, recipe,
                    optimizer=None, scheduler=None, consumed_train_samples: int, extra: Optional[dict] = None,
                    save_optim: bool = True) -> Path:
    """Write iteration `iteration` atomically; returns the iteration directory. Collective: every
    rank calls it (DP rank 0 of each (TP, PP) writes)."""
    save = Path(save)
    final_dir = iteration_dir(save, iteration)
    tmp_dir = final_dir.with_name(final_dir.name + ".tmp")
    is_global_zero = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    if is_global_zero:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # leftovers of a save killed midway
    _barrier()
    # The distributed optimizer gathers its shards to DP rank 0 (collective: every DP rank joins).
    sharded = None
    if save_optim and optimizer is not None and hasattr(optimizer, "sharded_state_dict"):
        sharded = optimizer.sharded_state_dict()
    if parallel_state.get_data_parallel_rank() == 0:
        state = {
            "args": args,
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration,
            "model": nest_model_state(model_state),
            "rng_state": [get_rng_state()],
            "recipe": recipe.to_dict(),
            "recipe_hash": recipe.hash,
            "consumed_train_samples": consumed_train_samples,
        }
        if save_optim and optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
        if save_optim and scheduler is not None:
            state["opt_param_scheduler"] = scheduler.state_dict()
        if extra:
            state.update(extra)
        rank_file = _my_rank_file(save, iteration, tmp=True)
        if sharded is not None:
            _atomic_torch_save(sharded, rank_file.with_name(DISTRIB_OPTIM_FILENAME))
        _atomic_torch_save(state, rank_file)
    _barrier()
    if is_global_zero:
        if final_dir.exists():  # re-saving an iteration: move the old one aside, then drop it
            old = final_dir.with_name(final_dir.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final_dir, old)
            os.replace(tmp_dir, final_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp_dir, final_dir)
        _atomic_write_text(save / TRACKER_FILENAME, f"{iteration}\n")
    _barrier()
    return final_dir


def check_recipe_compatible(recipe, saved_recipe: dict, saved_hash: str, where: Path) -> list[str]:
    """The changed keys, all resume-safe; raise when any other key differs."""
    from megatron_core.config import RESUME_SAFE_KEYS

    if saved_hash == recipe.hash:
        return []
    changed = recipe.diff(saved_recipe)

    def safe(key: str) -> bool:
        return any(key == s or key.startswith(s + ".") for s in RESUME_SAFE_KEYS)

    unsafe = [k for k in changed if not safe(k)]
    if unsafe:
        raise CheckpointError(
            f"the checkpoint in {where} was written by recipe {saved_hash}, this run's recipe is {recipe.hash}; "
            f"changed keys that alter training: {', '.join(unsafe)}. Resume with the original recipe, or start "
            "fresh with another --save/--run-dir (only "
            f"{', '.join(sorted(RESUME_SAFE_KEYS))} may change on resume)")
    return changed


def load_latest(load, *, required: bool = False) -> Optional[tuple[int, dict]]:
    """(iteration, this rank's checkpoint dict) of the latest checkpoint under `load`, or None."""
    load = Path(load)
    iteration = read_tracker(load)
    if iteration is None:
        if required:
            raise CheckpointError(f"no checkpoint under {load} (no {TRACKER_FILENAME}); check --load")
        return None
    path = _my_rank_file(load, iteration)
    if not path.exists() and iteration_dir(load, iteration).is_dir():
        written = sorted(p.name for p in iteration_dir(load, iteration).iterdir() if p.is_dir())
        raise CheckpointError(
            f"{iteration_dir(load, iteration)} has no {path.parent.name} (it holds {', '.join(written) or 'nothing'}): "
            f"it was written with another TP x PP layout than this run's "
            f"{parallel_state.get_tensor_model_parallel_world_size()} x "
            f"{parallel_state.get_pipeline_model_parallel_world_size()}; resume with that layout, or re-split it "
            "(invoke convert, then invoke import-hf --tp N --pp M)")
    return iteration, load_checkpoint_file(path)


def load_distributed_optimizer_file(load, iteration: int) -> dict:
    """This (TP, PP) rank's distrib_optim.pt (every DP rank reads it and takes its own slice)."""
    return load_checkpoint_file(_my_rank_file(Path(load), iteration).with_name(DISTRIB_OPTIM_FILENAME))
