"""A whole training state in Megatron's checkpoint format (megatron_core.checkpoint_format):
what goes into each rank's file, the collective save, resume-time checks, RNG state.

Every (TP, PP) rank with DP rank 0 writes its own file into the staging directory, all ranks meet
at a barrier, global rank 0 publishes the iteration (directory into place, then the tracker).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.checkpoint_format import (  # noqa: F401 - re-exported: the names training callers use
    CHECKPOINT_VERSION,
    DISTRIB_OPTIM_FILENAME,
    MODEL_FILENAME,
    RELEASE,
    TRACKER_FILENAME,
    CheckpointError,
    checkpoint_file,
    flatten_model_state,
    iteration_dir,
    load_checkpoint_file,
    model_chunks,
    model_entries,
    nest_model_state,
    publish_iteration,
    rank_dirname,
    read_tracker,
    staging_dir,
    write_rank_file,
)

def _my_rank() -> tuple[int, int, int]:
    """(tp rank, pp rank, pp size) of this process."""
    return (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_world_size())


def _my_rank_file(save: Path, iteration: int) -> Path:
    return checkpoint_file(save, iteration, *_my_rank())


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
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size(m.num_layers),
        num_layers_per_virtual_pipeline_stage=p.num_layers_per_virtual_pipeline_stage,
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


def save_checkpoint(save, iteration: int, *, model_state, args: argparse.Namespace, recipe,
                    optimizer=None, scheduler=None, consumed_train_samples: int, extra: Optional[dict] = None,
                    save_optim: bool = True) -> Path:
    """Write iteration `iteration` atomically; returns the iteration directory. Collective: every
    rank calls it (DP rank 0 of each (TP, PP) writes). `model_state`: the model's state dict, or
    a list of one per virtual pipeline chunk (saved as `model0`, `model1`, ...)."""
    chunk_states = model_state if isinstance(model_state, list) else [model_state]
    save = Path(save)
    distributed = dist.is_available() and dist.is_initialized()
    is_global_zero = not distributed or dist.get_rank() == 0
    # Nodes need not share a filesystem: local rank 0 of each node looks after its own copy of `save`.
    is_node_zero = int(os.environ.get("LOCAL_RANK", dist.get_rank() if distributed else 0)) == 0
    if is_node_zero:
        shutil.rmtree(staging_dir(save, iteration), ignore_errors=True)  # leftovers of a save killed midway
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
            **model_entries([nest_model_state(chunk) for chunk in chunk_states]),
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
        if sharded is not None:
            write_rank_file(save, iteration, *_my_rank(), sharded, filename=DISTRIB_OPTIM_FILENAME)
        write_rank_file(save, iteration, *_my_rank(), state)
    _barrier()
    final_dir = iteration_dir(save, iteration)
    if is_global_zero:
        publish_iteration(save, iteration)
    _barrier()
    # On a shared filesystem rank 0 has published every file; a node with its own disk still holds
    # its ranks' files in staging and publishes them there (gathered in one directory, they load).
    if is_node_zero and not is_global_zero and staging_dir(save, iteration).is_dir():
        publish_iteration(save, iteration)
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
