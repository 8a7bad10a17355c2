"""checkpointing.restore, the resume policy the training loop calls once: for each kind of checkpoint,
what it loads into the model, optimizer and LR schedule, the counters it hands back and the lines it
logs (one process, a tiny GPT; the multi-rank reshards are test_reshard's)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from megatron_core import checkpoint_format as cf
from megatron_core.pretrain_gpt import build_model_and_optimizer, seed_everything
from megatron_core.training import checkpointing as ckpt
from megatron_core.training.lr_schedule import OptimizerParamScheduler
from training_fixtures import VOCAB_SIZE, tiny_recipe

RECIPE = tiny_recipe()
PADDED = RECIPE.padded_vocab_size(VOCAB_SIZE)
ITERATION, CONSUMED = 3, 12


def _build():
    """(model protocol's implementation, optimizer, scheduler), as the loop gets them."""
    seed_everything(RECIPE.training.seed)  # the dropout RNG tracker, as train() seeds it
    _, model, _, optimizer = build_model_and_optimizer(RECIPE, PADDED, torch.device("cpu"))
    return model, optimizer, OptimizerParamScheduler.for_training(optimizer, RECIPE.training)


def _step(model, optimizer, scheduler) -> None:
    """One real update, so that weights and Adam moments differ from a fresh build's."""
    tokens = torch.arange(2 * 33).reshape(2, 33) % VOCAB_SIZE
    model.zero_grad_buffer()
    model(tokens[:, :-1], torch.arange(32).expand(2, 32), labels=tokens[:, 1:]).mean().backward()
    model.finish_grad_sync()
    scheduler.step_iteration()  # out of warm-up's lr 0 first
    assert optimizer.step()[0]


def _save(save: Path, save_optim: bool) -> dict:
    model, optimizer, scheduler = _build()
    _step(model, optimizer, scheduler)
    args = ckpt.megatron_args(
        RECIPE, PADDED, iteration=ITERATION, consumed_train_samples=CONSUMED, params_dtype="float32"
    )
    ckpt.save_checkpoint(
        save,
        ITERATION,
        model_state=[c.state_dict() for c in model.chunks],
        args=args,
        recipe=RECIPE,
        optimizer=optimizer,
        scheduler=scheduler,
        consumed_train_samples=CONSUMED,
        extra={"train_counters": {"skipped_iterations": 2, "nan_iterations": 1}},
        save_optim=save_optim,
    )
    return {
        "weights": {k: v.clone() for k, v in model.module.state_dict().items()},
        "exp_avg": {n: e["exp_avg"].clone() for n, e in optimizer.state_dict()["param_state"].items()},
        "num_steps": scheduler.num_steps,
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("restore")
    return {optim: (root / f"optim-{optim}", _save(root / f"optim-{optim}", optim)) for optim in (True, False)}


def _restore(load: Path, **kwargs):
    model, optimizer, scheduler = _build()
    lines: list[str] = []
    options = {"padded_vocab_size": PADDED, **kwargs}
    restored = ckpt.restore(
        load, RECIPE, chunks=model.chunks, optimizer=optimizer, scheduler=scheduler, log=lines.append, **options
    )
    return restored, model, optimizer, scheduler, lines


def _same_weights(model, want: dict) -> bool:
    return all(torch.equal(v, want[k]) for k, v in model.module.state_dict().items())


def test_a_training_state_continues_weights_optimizer_schedule_and_counters(saved):
    save, want = saved[True]
    restored, model, optimizer, scheduler, lines = _restore(save)
    assert restored == ckpt.Restored(
        cf.iteration_dir(save, ITERATION), ITERATION, CONSUMED, 2, 1, training_state=True, optimizer_state=True
    )
    assert _same_weights(model, want["weights"]) and not _same_weights(_build()[0], want["weights"])
    got = optimizer.state_dict()["param_state"]
    assert all(torch.equal(got[n]["exp_avg"], e) for n, e in want["exp_avg"].items())
    assert scheduler.num_steps == want["num_steps"] == RECIPE.training.global_batch_size
    assert lines[-1] == f"resumed from {cf.iteration_dir(save, ITERATION)} at iteration 3 (12 samples consumed)"


def test_a_checkpoint_without_optimizer_state_restarts_it_where_the_samples_were(saved):
    save, want = saved[False]
    restored, model, _, scheduler, lines = _restore(save)
    assert restored.training_state and not restored.optimizer_state and restored.iteration == ITERATION
    assert _same_weights(model, want["weights"])
    assert scheduler.num_steps == CONSUMED  # the LR where the saved run was, not the saved scheduler's
    assert (
        "checkpoint: it has no optimizer state (--no-save-optim): the optimizer and LR restart from the loaded "
        "weights; the run is not an exact continuation"
    ) in lines


def test_weights_only_start_everything_else_from_zero(saved, tmp_path):
    """A checkpoint without our training state (import-hf's release, a foreign one) gives the weights only."""
    save, want = saved[True]
    state = cf.load_checkpoint_file(cf.iteration_dir(save, ITERATION) / "mp_rank_00" / "model_optim_rng.pt")
    for key in ("recipe", "recipe_hash", "optimizer", "opt_param_scheduler"):
        del state[key]
    (tmp_path / "iter_0000003" / "mp_rank_00").mkdir(parents=True)
    torch.save(state, tmp_path / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt")
    (tmp_path / cf.TRACKER_FILENAME).write_text("3\n")
    restored, model, _, scheduler, lines = _restore(tmp_path)
    assert restored == ckpt.Restored(tmp_path / "iter_0000003", 0, 0, 0, 0, training_state=False, optimizer_state=False)
    assert _same_weights(model, want["weights"]) and scheduler.num_steps == 0
    assert lines[-1] == (
        f"initialized the model from the weights in {tmp_path / 'iter_0000003'}; optimizer, "
        "learning-rate schedule and data position start from zero"
    )


def test_nothing_to_load_and_from_scratch_load_nothing(saved, tmp_path):
    assert _restore(tmp_path / "empty")[0] is None
    assert _restore(tmp_path / "empty")[-1] == [f"no checkpoint in {tmp_path / 'empty'}: starting from scratch"]
    save = tmp_path / "checkpoints"
    shutil.copytree(saved[True][0], save)
    restored, model, *_, lines = _restore(save, save=save, from_scratch=True)
    assert restored is None and not save.exists()  # set aside, nothing deleted
    assert lines[0].startswith(f"--from-scratch: the checkpoints in {save} were moved to {save}.before-from-scratch-")
    assert not _same_weights(model, saved[True][1]["weights"])


def test_a_vocabulary_padded_otherwise_is_refused_with_the_setting_to_use(saved):
    with pytest.raises(
        cf.CheckpointError,
        match=f"pads the vocabulary to {PADDED} rows .* this run to "
        f"{PADDED + 64}; pad alike: --set make_vocab_size_divisible_by=",
    ):
        _restore(saved[True][0], padded_vocab_size=PADDED + 64)
