"""A whole training state in Megatron's checkpoint format (megatron_core.checkpoint_format):
what goes into each rank's file, the collective save, the restore policy (`restore`, which the loop calls
once to resume), RNG state.

Every (TP, PP) rank with DP rank 0 writes its own file into the staging directory (with the
distributed optimizer every DP rank also writes its own pieces of the optimizer state), all ranks
meet at a barrier, global rank 0 publishes the iteration (directory into place, then the tracker).

A resume works under any layout: when the checkpoint's TP x PP differs from this run's, every rank
reads all rank files of the iteration, merges weights and per-parameter optimizer state into full
tensors (the merge rules convert uses) and keeps its own slice (`load_latest`).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.checkpoint_format import (
    MANIFEST_FILENAME,
    CHECKPOINT_VERSION,
    OPTIM_STATE_KEYS,
    RECIPE_FILENAME,
    RELEASE,
    TRACKER_FILENAME,
    CheckpointError,
    atomic_write_text,
    check_complete,
    check_rank_files,
    distrib_optim_filename,
    find_rank_files,
    flatten_model_state,
    is_model_key,
    iteration_dir,
    load_checkpoint_file,
    manifest_paths,
    merge_chunked_states,
    model_chunks,
    model_entries,
    nest_model_state,
    publish_iteration,
    published_iterations,
    rank_dirname,
    read_tracker,
    read_tracker_leniently,
    split_chunked_state,
    staging_dir,
    tokenizer_copies,
    write_rank_file,
    write_tokenizer_files,
)
from megatron_core.files import rename_durably
from megatron_core.config.model_spec import ModelSpec
from megatron_core.models.gpt import parameter_sharding


def _my_rank() -> tuple[int, int, int]:
    """(tp rank, pp rank, pp size) of this process."""
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# ----------------------------------------------------------------------------------------------
# RNG state (weights_only-safe: numpy's state as a tensor, not an ndarray pickle)
# ----------------------------------------------------------------------------------------------


def get_rng_state() -> dict:
    """Every generator a run draws from. The tracker's device type is the training device's (seeded
    by seed_everything): the CUDA generator is saved only when training on CUDA, so a CPU run on a
    GPU host never opens a CUDA context here."""
    from megatron_core.tensor_parallel.random import get_rng_tracker

    tracker = get_rng_tracker()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if tracker.device_type == "cuda" else None,
        "rng_tracker_states": tracker.get_states(),
        "rng_tracker_device": tracker.device_type,  # whose generator the tracker states belong to
    }
    return state


def set_rng_state(state: dict) -> Optional[str]:
    """Restore the generators saved by get_rng_state. The tracker states are handed over only when
    they belong to this run's generator; otherwise the tracker keeps its states from the seed and
    the reason comes back, for the log (None when everything was restored)."""
    from megatron_core.tensor_parallel.random import get_rng_tracker

    tracker = get_rng_tracker()
    version, internal, gauss = state["random_rng_state"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["np_rng_state"]
    np.random.set_state(
        (
            np_state["kind"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch_rng_state"])
    if state.get("cuda_rng_state") is not None and tracker.device_type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    states = state.get("rng_tracker_states")
    if not states:  # none saved, or dropped on purpose (a TP change, logged by the caller)
        return None
    # Megatron-LM's rng_state has no rng_tracker_device: only the state sizes tell the generator apart.
    saved = state.get("rng_tracker_device")
    why = (
        f"they were saved for the {saved} generator and this run trains on {tracker.device_type}"
        if saved not in (None, tracker.device_type)
        else tracker.misfit(states)
    )
    if why is not None:
        return (
            f"checkpoint: the dropout RNG tracker states are not restored ({why}): they restart from the "
            "seed, so dropout inside tensor-parallel regions draws new masks (exact only without dropout)"
        )
    tracker.set_states(states)
    return None


# ----------------------------------------------------------------------------------------------
# Megatron args
# ----------------------------------------------------------------------------------------------


def megatron_args(
    recipe, padded_vocab_size: int, *, iteration: int, consumed_train_samples: int, params_dtype: str
) -> argparse.Namespace:
    """The `args` Namespace with Megatron's names (what the HF converter and Megatron tools read).
    Only plain Python values, so weights_only loading needs nothing but Namespace itself."""
    m, p, t = recipe.model, recipe.parallel, recipe.training
    # The shape and layout from the one ModelSpec; the rest as the recipe says it.
    return ModelSpec.from_recipe(recipe, padded_vocab_size).to_args(
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        bias_gelu_fusion=m.bias_gelu_fusion,
        openai_gelu=m.openai_gelu,
        tokenizer_type=recipe.tokenizer.tokenizer_type,
        world_size=p.world_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size(m.num_layers),
        num_layers_per_virtual_pipeline_stage=p.num_layers_per_virtual_pipeline_stage,
        data_parallel_size=p.data_parallel_size,
        sequence_parallel=p.sequence_parallel,
        use_distributed_optimizer=p.use_distributed_optimizer,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        train_iters=t.train_iters,
        lr=t.lr,
        min_lr=t.min_lr,
        lr_decay_style=t.lr_decay_style,
        lr_warmup_iters=t.lr_warmup_iters,
        lr_decay_iters=t.decay_iters,
        weight_decay=t.weight_decay,
        clip_grad=t.clip_grad,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        fp16=t.fp16,
        bf16=t.bf16,
        params_dtype=params_dtype,
        seed=t.seed,
        iteration=iteration,
        consumed_train_samples=consumed_train_samples,
    )


# ----------------------------------------------------------------------------------------------
# Save / load a whole training state
# ----------------------------------------------------------------------------------------------


def save_checkpoint(
    save,
    iteration: int,
    *,
    model_state,
    args: argparse.Namespace,
    recipe,
    optimizer=None,
    scheduler=None,
    consumed_train_samples: int,
    extra: Optional[dict] = None,
    save_optim: bool = True,
    tokenizer_files=None,
) -> Path:
    """Write iteration `iteration` atomically; returns the iteration directory. Collective: every
    rank calls it (DP rank 0 of each (TP, PP) writes). `model_state`: the model's state dict, or
    a list of one per virtual pipeline chunk (saved as `model0`, `model1`, ...). The directory
    carries what converting and evaluating need: `tokenizer_files` (vocab, merges) are copied into
    `save` and named in args.vocab_file / merge_file (Megatron-LM's way), and the resolved recipe
    goes to recipe.yaml."""
    chunk_states = model_state if isinstance(model_state, list) else [model_state]
    save = Path(save)
    if tokenizer_files:
        args.vocab_file, args.merge_file = (str(p) for p in tokenizer_copies(save.resolve()))
    distributed = dist.is_available() and dist.is_initialized()
    is_global_zero = not distributed or dist.get_rank() == 0
    # Nodes need not share a filesystem: local rank 0 of each node looks after its own copy of `save`.
    is_node_zero = parallel_state.is_local_rank_zero()
    if is_node_zero:
        shutil.rmtree(staging_dir(save, iteration), ignore_errors=True)  # leftovers of a save killed midway
    _barrier()
    optim = optimizer.state_dict() if save_optim and optimizer is not None else None
    if optim is not None and optim.get("distributed_optimizer"):  # every DP rank writes its own pieces
        write_rank_file(
            save,
            iteration,
            *_my_rank(),
            {"param_state": optimizer.param_state()},
            filename=distrib_optim_filename(parallel_state.get_data_parallel_rank()),
        )
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
        if optim is not None:
            state["optimizer"] = optim
        if save_optim and scheduler is not None:
            state["opt_param_scheduler"] = scheduler.state_dict()
        if extra:
            state.update(extra)
        write_rank_file(save, iteration, *_my_rank(), state)
    _barrier()
    final_dir = iteration_dir(save, iteration)
    if is_global_zero:
        _publish(save, iteration, recipe, tokenizer_files, MANIFEST_FILENAME)
    _barrier()
    # On a shared filesystem rank 0 has published every file; a node with its own disk still holds
    # its ranks' files in staging and publishes them there (gathered in one directory, they load).
    if is_node_zero and not is_global_zero and staging_dir(save, iteration).is_dir():
        _publish(save, iteration, recipe, tokenizer_files, f"manifest-rank{dist.get_rank()}.json")
    _barrier()
    return final_dir


def _publish(save: Path, iteration: int, recipe, tokenizer_files, manifest_name: str) -> None:
    """What convert and evaluate need beside the weights (tokenizer, recipe.yaml), then the iteration."""
    if tokenizer_files:
        write_tokenizer_files(save, *tokenizer_files)
    atomic_write_text(save / RECIPE_FILENAME, recipe.to_yaml())
    publish_iteration(save, iteration, keep_last=recipe.training.keep_last_checkpoints, manifest_name=manifest_name)


def check_can_save(run_dir: Path, save: Path, *, parameters: int, bytes_per_parameter: int) -> None:
    """Fail fast, before the first iteration: the run and save directories must be writable and the
    save directory's disk must hold one more checkpoint (`parameters` x `bytes_per_parameter`, weights
    plus optimizer state, as the rank files hold them)."""
    from megatron_core.errors import UserError

    for what, where in (("run directory", Path(run_dir)), ("checkpoint directory", Path(save))):
        try:
            where.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(
                f"cannot create the {what} {where}: {exc.strerror or exc}; choose a writable path (--run-dir / --save)"
            ) from None
        if not os.access(where, os.W_OK | os.X_OK):
            raise UserError(
                f"the {what} {where} is not writable; fix its permissions or choose another (--run-dir / --save)"
            )
    needed, free = parameters * bytes_per_parameter, shutil.disk_usage(save).free
    if free < needed:
        raise UserError(
            f"{save} has {free / 2**30:.2f} GiB free but one checkpoint needs about "
            f"{needed / 2**30:.2f} GiB ({parameters:,} parameters x {bytes_per_parameter} bytes); "
            "free space or --save elsewhere"
        )


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
            f"{', '.join(sorted(RESUME_SAFE_KEYS))} may change on resume)"
        )
    return changed


def lr_schedule_note(recipe, saved_recipe: dict, iteration: int) -> Optional[str]:
    """One line saying how a resume with a raised (or lowered) train_iters moves the LR decay, where
    lr_decay_iters follows train_iters (as in Megatron, the schedule's shape comes from this run's recipe
    and its position from the checkpoint); None where the decay end stays."""
    from megatron_core.training.lr_schedule import learning_rate

    t, saved = recipe.training, saved_recipe.get("training", {})
    before = saved.get("lr_decay_iters") or saved.get("train_iters")
    if t.lr_decay_iters is not None or t.lr_decay_style == "constant" or before in (None, t.decay_iters):
        return None

    def lr(decay_iters: int) -> float:
        return learning_rate(
            iteration,
            max_lr=t.lr,
            min_lr=t.min_lr,
            warmup_steps=t.lr_warmup_iters,
            decay_steps=decay_iters,
            decay_style=t.lr_decay_style,
        )

    return (
        f"lr_decay_iters follows train_iters: {before} -> {t.decay_iters}; the learning rate now decays to "
        f"min_lr at {t.decay_iters} (at iteration {iteration} it is {lr(t.decay_iters):.3g}, where the old "
        f"schedule had {lr(before):.3g}); set training.lr_decay_iters to keep a schedule fixed"
    )


def set_aside(save: Path) -> Optional[Path]:
    """--from-scratch: move the checkpoints already in `save` aside (nothing is deleted), so the new run's
    iterations never mix with the old run's and a later resume cannot pick an old one. Collective; local
    rank 0 of each node moves its own copy. The new name, or None when there was nothing to move."""
    save, target = Path(save), None
    if (
        parallel_state.is_local_rank_zero()
        and save.is_dir()
        and (published_iterations(save) or (save / TRACKER_FILENAME).exists())
    ):
        target = save.with_name(f"{save.name}.before-from-scratch-{time.strftime('%Y%m%d-%H%M%S')}")
        rename_durably(save, target)
    _barrier()
    return target


# ----------------------------------------------------------------------------------------------
# Restore: the resume policy, in one call from the loop
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Restored:
    """What `restore` loaded into the model, optimizer and LR scheduler; the loop continues from it."""

    where: Path  # the iteration directory
    iteration: int  # the iteration the run continues after (0 for a weights-only start)
    consumed_train_samples: int
    skipped_iterations: int
    nan_iterations: int
    training_state: bool  # False: weights only (import-hf's release, a foreign checkpoint): all else from zero
    optimizer_state: bool  # the optimizer and LR schedule continue (False: they restart from the loaded weights)


def restore(
    load: Path,
    recipe,
    *,
    chunks: Sequence[torch.nn.Module],
    optimizer,
    scheduler,
    padded_vocab_size: int,
    log: Callable[[str], None],
    save: Optional[Path] = None,
    fallback: bool = True,
    from_scratch: bool = False,
) -> Optional[Restored]:
    """Resume from the latest checkpoint under `load` that verifies, whatever layout wrote it
    (`load_latest`: falls back to older iterations unless `fallback` is False; `from_scratch` first sets
    `save`'s checkpoints aside and loads nothing). Checks that it fits this run (resume-safe recipe
    keys, vocabulary padding, model chunks, weight shapes), loads the weights into `chunks` (the model
    protocol's, saved as model0, model1, ...), the optimizer and LR scheduler state (or restarts them
    from the weights where the checkpoint has none) and the RNG state; each decision is one line
    through `log`. A weights-only checkpoint starts everything but the weights from zero. None when
    nothing is loaded. Collective."""
    if from_scratch and save is not None:
        moved = set_aside(save)
        if moved:
            log(f"--from-scratch: the checkpoints in {save} were moved to {moved}")
    found = load_latest(load, fallback=fallback, from_scratch=from_scratch, log=log)
    if found is None:
        log(f"no checkpoint in {load}: starting from scratch")
        return None
    iteration, state = found
    where = iteration_dir(load, iteration)
    tp = recipe.parallel.tensor_model_parallel_size
    if iteration == RELEASE or "recipe" not in state:
        load_model_weights(
            state, chunks, optimizer, where, padded_vocab_size=padded_vocab_size, tensor_model_parallel_size=tp
        )
        log(
            f"initialized the model from the weights in {where}; optimizer, learning-rate schedule and data "
            "position start from zero"
        )
        return Restored(where, 0, 0, 0, 0, training_state=False, optimizer_state=False)
    changed = check_recipe_compatible(recipe, state["recipe"], state["recipe_hash"], load)
    consumed = int(state["consumed_train_samples"])
    if changed:
        log(f"resuming with changed resume-safe keys: {', '.join(changed)}")
    schedule_note = lr_schedule_note(recipe, state["recipe"], iteration)
    if schedule_note:
        log(schedule_note)
    if "training.train_iters" in changed:  # the GPT dataset's epochs and shuffle are sized by train_iters
        log(
            "train_iters changed: the data indices are sized for the new length, so past the first epoch the "
            f"samples still to come are shuffled anew (Megatron does the same); the {consumed} consumed samples "
            "are not replayed in order"
        )
    saved_tp = getattr(state["args"], "tensor_model_parallel_size", None)  # Megatron-LM's args may lack it
    live_tp = parallel_state.get_tensor_model_parallel_world_size()
    if saved_tp not in (None, live_tp):
        log(
            f"the checkpoint was written under TP {saved_tp}: weights and optimizer state are re-sliced for TP "
            f"{live_tp}; the dropout RNG streams restart from the seed (exact only without dropout)"
        )
    load_model_weights(
        state, chunks, optimizer, load, padded_vocab_size=padded_vocab_size, tensor_model_parallel_size=tp
    )
    optimizer_state = "optimizer" in state and "opt_param_scheduler" in state
    if optimizer_state:
        optimizer.load_state_dict(state["optimizer"])  # param_state re-sliced for this layout
        scheduler.load_state_dict(state["opt_param_scheduler"])
    else:
        why = state.get("optimizer_not_loaded", "it has no optimizer state (--no-save-optim)")
        log(
            f"checkpoint: {why}: the optimizer and LR restart from the loaded weights; the run is not an exact "
            "continuation"
        )
        scheduler.num_steps = consumed  # the LR where the saved run was (Megatron counts samples)
        scheduler.step(0)
    rng_note = set_rng_state(state["rng_state"][0])  # e.g. resumed on another device
    if rng_note:
        log(rng_note)
    counters = state.get("train_counters", {})
    log(f"resumed from {where} at iteration {iteration} ({consumed} samples consumed)")
    return Restored(
        where,
        iteration,
        consumed,
        int(counters.get("skipped_iterations", 0)),
        int(counters.get("nan_iterations", 0)),
        training_state=True,
        optimizer_state=optimizer_state,
    )


def load_model_weights(
    state: dict,
    chunks: Sequence[torch.nn.Module],
    optimizer,
    where,
    *,
    padded_vocab_size: int,
    tensor_model_parallel_size: int,
) -> None:
    """This rank's weights from a checkpoint dict (load_for_this_rank's) into the model's `chunks`, after
    checking that the vocabulary padding and the number of chunks fit; then the optimizer's fp32 masters
    from them. `where` names the checkpoint in the errors."""
    args = state.get("args")
    saved_vocab = getattr(args, "padded_vocab_size", None)
    if saved_vocab and saved_vocab != padded_vocab_size:  # Megatron pads to divisible_by x TP
        multiple = getattr(args, "make_vocab_size_divisible_by", 1) * getattr(args, "tensor_model_parallel_size", 1)
        tp = tensor_model_parallel_size
        raise CheckpointError(
            f"the checkpoint in {where} pads the vocabulary to {saved_vocab} rows (a multiple of "
            f"{multiple}), this run to {padded_vocab_size}; pad alike: --set "
            f"make_vocab_size_divisible_by={multiple // tp if multiple % tp == 0 else multiple}"
        )
    saved = model_chunks(state, where)
    if len(saved) != len(chunks):
        raise CheckpointError(
            f"the checkpoint in {where} holds {len(saved)} model chunk(s) per rank but this run's model has "
            f"{len(chunks)} (parallel.num_layers_per_virtual_pipeline_stage decides: virtual pipeline stages "
            "hold non-contiguous layers); train with the checkpoint's layout, or re-split it (invoke convert, "
            "then invoke import-hf with this run's layout)"
        )
    try:
        for stage, nested in zip(chunks, saved):
            stage.load_state_dict(flatten_model_state(nested))
    except RuntimeError as exc:  # shapes or names that do not fit this recipe's model
        first = str(exc).splitlines()
        raise CheckpointError(
            f"the weights in {where} do not fit this recipe's model "
            f"({' '.join(line.strip() for line in first[1:3]) or first[0]}); "
            "check num_layers, hidden_size, heads and the (padded) vocabulary"
        ) from None
    # The fp32 masters were copied from the initial weights when the optimizer was built: without
    # this, a bf16/fp16 run whose checkpoint has no optimizer state would step from random weights.
    optimizer.reload_model_params()


def load_latest(
    load,
    *,
    required: bool = False,
    fallback: bool = True,
    from_scratch: bool = False,
    log: Optional[Callable[[str], None]] = None,
) -> Optional[tuple[int, dict]]:
    """(iteration, this rank's checkpoint dict) of the latest checkpoint under `load` that verifies,
    or None; see `load_for_this_rank` for what the dict holds when the checkpoint was written under
    another layout. Collective. The tracker names the latest; without a usable tracker the newest
    complete iteration directory is taken. A checkpoint that fails verification or cannot be read is
    logged and the next older one tried (`fallback=False` refuses instead). Iteration directories
    that none load raise, unless `from_scratch` (which ignores every checkpoint there)."""
    load = Path(load)
    say = log or (lambda _line: None)
    try:
        raw = read_tracker(load)
    except CheckpointError:
        raw = "unreadable"
    _check_every_rank_found(raw, load)
    tracked, problem = read_tracker_leniently(load)
    iterations = published_iterations(load)
    if from_scratch:
        if iterations or raw is not None:
            say(
                f"--from-scratch: ignoring the checkpoints in {load}; training starts from iteration 0 and "
                "its saves replace them"
            )
        return None
    if tracked == RELEASE:
        candidates = [(RELEASE, iteration_dir(load, RELEASE))]
    elif tracked is not None:
        candidates = [(n, where) for n, where in iterations.items() if n <= tracked]
    else:
        candidates = list(iterations.items())
        if not candidates and iteration_dir(load, RELEASE).is_dir():
            candidates = [(RELEASE, iteration_dir(load, RELEASE))]
        if candidates:
            why = problem or f"no {TRACKER_FILENAME} in {load}"
            say(f"{why}: resuming from the newest complete iteration directory that verifies")
    if not candidates:
        if problem:
            say(f"{problem}, and no iteration directory is there: starting from scratch")
        if required:
            raise CheckpointError(f"no checkpoint under {load} (no {TRACKER_FILENAME}); check --load")
        return None
    failed: list[str] = []
    first_error = None  # the newest iteration's reason: what the user must fix when none loads
    for iteration, where in candidates:
        error, state = None, None
        try:
            check_complete(where)
            state = load_for_this_rank(where)
        except CheckpointError as exc:
            error = str(exc)
        if _on_every_rank(error is None, iteration, load):
            if failed:
                say(f"falling back to {where} (iteration {iteration}): {', '.join(failed)} failed verification")
            if not manifest_paths(where):  # Megatron-LM's own, or written before checksums: said, not silent
                say(f"{where} has no manifest: its files are loaded without checksum verification")
            return iteration, state
        error = error or "another rank could not read its files"
        say(f"checkpoint {where} cannot be used: {error}")
        failed.append(where.name)
        first_error = first_error or error
        if not fallback:
            raise CheckpointError(
                f"checkpoint {where} fails verification or cannot be read (see the log) and "
                "--no-fallback was given: repair or remove it, or drop --no-fallback to resume "
                "from the newest older iteration that verifies"
            )
    raise CheckpointError(
        f"{load} holds iteration directories but none loads ({', '.join(failed)}); the newest: "
        f"{first_error}. Copy a good checkpoint there, --load another directory, or pass "
        "--from-scratch to start over (its saves replace them)"
    )


def _on_every_rank(ok: bool, iteration, load: Path) -> bool:
    """True when every rank loaded `iteration`; ranks that tried different iterations are stopped."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ok
    code = -2 if iteration == RELEASE else int(iteration)
    device = parallel_state.get_collective_device()
    found = torch.tensor([int(ok), code, -code], dtype=torch.int64, device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MIN)
    if int(found[1]) != -int(found[2]):
        raise CheckpointError(
            f"the ranks tried different checkpoints under {load} (iterations {int(found[1])} to "
            f"{-int(found[2])}): on nodes without a shared filesystem copy every node's "
            "checkpoint files into one directory and resume from it (--load DIR)"
        )
    return bool(found[0])


def _check_every_rank_found(iteration, load: Path) -> None:
    """Every rank must resume from the same iteration: on nodes that do not share a filesystem each
    reads its own tracker, and a node without one (or with an older one) would silently start
    elsewhere. Collective."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    code = {None: -1, RELEASE: -2, "unreadable": -3}.get(iteration, iteration)
    device = parallel_state.get_collective_device()
    found = torch.tensor([code, -code], dtype=torch.int64, device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    highest, lowest = int(found[0]), -int(found[1])
    if highest != lowest:

        def name(c):
            return {-1: "none", -2: RELEASE, -3: "an unreadable tracker"}.get(c, str(c))

        raise CheckpointError(
            f"the ranks found different latest checkpoints under {load} (from {name(lowest)} to "
            f"{name(highest)}): on nodes without a shared filesystem copy every node's checkpoint "
            "files into one directory and resume from it (--load DIR)"
        )


def load_for_this_rank(iter_dir: Path) -> dict:
    """This rank's checkpoint dict for this process's TP x PP layout, from a checkpoint of any
    TP x PP x DP layout and either optimizer. `model` is this rank's nested weights; `optimizer`
    (when saved) gains `param_state`: {model name: {fp32_param, exp_avg, exp_avg_sq}} in whole
    tensors of this rank's parameters, whatever optimizer and DP size wrote it.

    Same TP x PP: only this rank's own files are read. Another TP x PP: every rank reads every rank
    file of the iteration and merges them (cheap for small models; at scale each rank reads the
    whole checkpoint once, i.e. world size x checkpoint bytes from the filesystem, and holds one
    full copy of weights and optimizer state in CPU memory while slicing). The other keys (args,
    recipe, counters, RNG) come from the saved rank that holds this rank's first layer."""
    files = find_rank_files(iter_dir)
    tp, pp, tp_rank, pp_rank = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        *_my_rank()[:2],
    )
    chunks = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    first_pos = (tp_rank, pp_rank) if (tp_rank, pp_rank) in files else min(files)
    first = load_checkpoint_file(files[first_pos])
    args = first.get("args")
    saved_tp = getattr(args, "tensor_model_parallel_size", None) or 1 + max(t for t, _ in files)
    saved_pp = getattr(args, "pipeline_model_parallel_size", None) or 1 + max(p for _, p in files)
    saved_chunks = len(model_chunks(first, files[first_pos]))
    check_rank_files(iter_dir, files, saved_tp, saved_pp)
    if (saved_tp, saved_pp, saved_chunks) == (tp, pp, chunks):
        state = first
        model, optim = _rank_states(iter_dir, first_pos, saved_pp, first, files[first_pos])
    else:
        num_layers = args.num_layers
        # The saved rank holding this rank's first layer gives the RNG and the other keys.
        mine_first = parallel_state.stage_layers(
            num_layers,
            pp,
            pp_rank,
            virtual_rank=0,
            num_layers_per_virtual_pipeline_stage=_chunk_layers(num_layers, pp, chunks),
        ).start
        saved_position = mine_first // (num_layers // (saved_pp * saved_chunks))
        source = (min(tp_rank, saved_tp - 1), saved_position % saved_pp)
        loaded = {pos: first if pos == first_pos else load_checkpoint_file(path) for pos, path in files.items()}
        per_rank = {pos: _rank_states(iter_dir, pos, saved_pp, ck, files[pos]) for pos, ck in loaded.items()}
        tied = "output_layer.weight" not in per_rank[(0, saved_pp - 1)][0][saved_chunks - 1]
        # The saved model's parameters, as its layers split them (tied or not as the files hold it).
        sharding = parameter_sharding(
            ModelSpec.from_args(args).to_model_config(untie_embeddings_and_output_weights=not tied)
        )

        def mine(parts: dict) -> list[dict]:
            return split_chunked_state(
                merge_chunked_states(parts, saved_tp, saved_pp, sharding),
                tp,
                pp,
                tp_rank,
                pp_rank,
                chunks,
                num_layers=num_layers,
                tied=tied,
                sharding=sharding,
            )

        state = loaded[source]
        model = mine({pos: model for pos, (model, _) in per_rank.items()})
        optim = None
        if all(o is not None for _, o in per_rank.values()):
            by_key = {
                key: mine({pos: [{n: e[key] for n, e in c.items()} for c in o] for pos, (_, o) in per_rank.items()})
                for key in OPTIM_STATE_KEYS
            }
            optim = [
                {name: {key: by_key[key][c][name] for key in OPTIM_STATE_KEYS} for name in by_key["exp_avg"][c]}
                for c in range(chunks)
            ]
        if tp != saved_tp and state.get("rng_state"):  # the TP tracker's streams are per TP rank
            state["rng_state"][0]["rng_tracker_states"] = None
    for key in [k for k in state if is_model_key(k)]:
        del state[key]
    state.update(model_entries([nest_model_state(flat) for flat in model]))
    if optim is not None:
        state["optimizer"]["param_state"] = _optimizer_names(optim)
    elif state.pop("optimizer", None) is not None:  # saved, but in a form we cannot read back per parameter
        state["optimizer_not_loaded"] = (
            "its optimizer state is in a form this project cannot read per parameter (Megatron-LM's own)"
        )
    return state


def _chunk_layers(num_layers: int, pp: int, chunks: int) -> Optional[int]:
    """num_layers_per_virtual_pipeline_stage of a layout with `chunks` model chunks per PP rank."""
    return None if chunks == 1 else num_layers // (pp * chunks)


def _optimizer_names(per_chunk: list[dict]) -> dict:
    """[{name in chunk c: entry}] -> {optimizer name: entry}: the model's own parameter names, which
    are `chunks.<c>.<name>` under virtual pipeline stages (GPTModelChunks)."""
    if len(per_chunk) == 1:
        return per_chunk[0]
    return {f"chunks.{c}.{name}": entry for c, entries in enumerate(per_chunk) for name, entry in entries.items()}


def _chunk_entries(param_state: dict, chunks: int) -> list[dict]:
    """The inverse of _optimizer_names."""
    if chunks == 1:
        return [param_state]
    out: list[dict] = [{} for _ in range(chunks)]
    for name, entry in param_state.items():
        c, local = re.fullmatch(r"chunks\.(\d+)\.(.+)", name).groups()
        out[int(c)][local] = entry
    return out


def _rank_states(iter_dir: Path, pos: tuple[int, int], pp_size: int, ckpt: dict, where: Path):
    """([flat weights per model chunk], [{name: {fp32_param, exp_avg, exp_avg_sq}} per chunk] or None)
    of one saved (TP, PP) rank, the distributed optimizer's pieces from every DP rank's file glued
    into whole tensors."""
    model = [flatten_model_state(nested) for nested in model_chunks(ckpt, where)]
    optim = ckpt.get("optimizer")
    if optim is None:
        return model, None
    named = _optimizer_names(model)  # the weights under the optimizer's names
    if optim.get("distributed_optimizer"):
        param_state = _glue_dp_pieces(iter_dir / rank_dirname(*pos, pp_size), ckpt["args"].data_parallel_size, named)
    elif "param_state" in optim:
        param_state = optim["param_state"]
    else:  # Megatron-LM's own: weights only (the trainer says the optimizer restarts)
        return model, None
    entries = {
        name: {
            "fp32_param": entry.get("fp32_param", named[name].float()),
            "exp_avg": entry["exp_avg"],
            "exp_avg_sq": entry["exp_avg_sq"],
        }
        for name, entry in param_state.items()
    }
    return model, _chunk_entries(entries, len(model))


def _glue_dp_pieces(rank_dir: Path, dp_size: int, model: dict) -> dict:
    """Whole tensors from each DP rank's pieces (distrib_optim_dp_XXX.pt), every element covered once."""
    names = [distrib_optim_filename(r) for r in range(dp_size)]
    missing = [n for n in names if not (rank_dir / n).exists()]
    if missing:
        raise CheckpointError(
            f"{rank_dir} lacks {', '.join(missing)} (the distributed optimizer state of "
            f"{len(missing)} of {dp_size} DP ranks); copy the whole iteration folder"
        )
    full: dict[str, dict[str, torch.Tensor]] = {}
    covered = dict.fromkeys(model, 0)
    for name_of_file in names:
        for name, piece in load_checkpoint_file(rank_dir / name_of_file)["param_state"].items():
            start, numel = piece["start"], piece["fp32_param"].numel()
            for key in OPTIM_STATE_KEYS:
                flat = full.setdefault(name, {}).setdefault(key, torch.zeros(model[name].numel()))
                flat[start : start + numel] = piece[key]
            covered[name] += numel
    gaps = [n for n, count in covered.items() if count != model[n].numel()]
    if gaps:
        raise CheckpointError(
            f"{rank_dir}: the distributed optimizer files do not cover {gaps[:3]} exactly once; "
            "they come from different saves: copy one checkpoint's folder"
        )
    return {name: {k: t.view(model[name].shape) for k, t in entry.items()} for name, entry in full.items()}
