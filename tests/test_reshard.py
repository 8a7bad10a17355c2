"""Resharding on resume: a checkpoint written under one TP x PP x DP layout (either optimizer)
continues under another exactly like the run that wrote it.

A TP 2 x PP 2 run trains 12 iterations and checkpoints at iteration 6; TP 1, DP 2 with the
distributed optimizer and PP 2 x DP 2 resume from that checkpoint and must reproduce its losses of
iterations 7-12 within 1e-4 (relative). The reverse: TP 2 x PP 2 resumes from a TP 1 checkpoint and
must reproduce the TP 1 run's losses; TP 1 resumes the DP 2 run's distributed-optimizer pieces
(checkpoint at 9). What must carry over: weights, fp32 masters, Adam moments,
step count, LR schedule, consumed samples. Dropout is 0 (the harness's recipe): the dropout RNG
streams are per TP rank, so they cannot continue across a TP change; without dropout nothing else
in the loss draws random numbers, and test_parallel_equivalence.py shows every layout trains like
the single process, which is why one run's losses are the other's reference.

Built on the harness of test_parallel_equivalence.py (tiny GPT, synthetic data, the real Trainer).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import test_parallel_equivalence as proof
from distributed_utils import run_distributed
from megatron_core import parallel_state as ps
from megatron_core.config import recipe_from_dict
from megatron_core.training import checkpointing as ckpt

ITERS, SAVED_AT, RTOL = 12, 6, 1e-4
TP2_PP2 = proof.Layout("TP2xPP2", tp=2, pp=2)
TP1 = proof.Layout("TP1")
DP2_DISTOPT = proof.Layout("DP2 distributed optimizer", dp=2, distributed_optimizer=True)
PP2_DP2 = proof.Layout("PP2xDP2", pp=2, dp=2)
PP2_VPP2 = proof.Layout("PP2 VPP2", pp=2, vpp_layers=1)


def recipe(layout: proof.Layout, **training):
    return proof.make_recipe(layout, **{"train_iters": ITERS, "lr_decay_iters": ITERS, "save_interval": SAVED_AT,
                                        **training})


def run(layout: proof.Layout, run_dir: Path, *, save=None, load=None, **training):
    """Train `layout` in this process group; the losses by iteration on the log-writing rank, else None."""
    try:
        return proof.fit(recipe(layout, **training), run_dir, save=save, load=load)[3]
    finally:
        ps.destroy_model_parallel()


def checkpoint_at(save: Path, iteration: int = SAVED_AT) -> Path:
    """A checkpoint directory holding only `save`'s `iteration` (the runs also save at their end)."""
    copy = save.with_name(f"{save.name}-at-{iteration}")
    if not copy.exists():
        shutil.copytree(save / f"iter_{iteration:07d}", copy / f"iter_{iteration:07d}")
        (copy / ckpt.TRACKER_FILENAME).write_text(f"{iteration}\n")
    return copy


def four_rank_work(root: str) -> dict:
    """The TP 2 x PP 2 reference (checkpoint at 6), PP 2 x DP 2 resuming from it, and TP 2 x PP 2
    resuming from the TP 1 checkpoint."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    root = Path(root)
    reference = run(TP2_PP2, root / "tp2pp2", save=root / "tp2pp2-ckpt")
    if dist.get_rank() == 0:
        checkpoint_at(root / "tp2pp2-ckpt")
    dist.barrier()
    return {"reference": reference,
            "pp2dp2": run(PP2_DP2, root / "pp2dp2", load=root / "tp2pp2-ckpt-at-6"),
            "reverse": run(TP2_PP2, root / "reverse", load=checkpoint_at(root / "tp1-ckpt"))}


def dp2_work(root: str):
    torch.set_num_threads(1)
    root = Path(root)
    return run(DP2_DISTOPT, root / "dp2", load=root / "tp2pp2-ckpt-at-6", save=root / "dp2-ckpt", save_interval=3)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("reshard")


@pytest.fixture(scope="module")
def tp1(root) -> dict:
    """The single process: 12 iterations, checkpoint at 6 (what the reverse case starts from)."""
    torch.set_num_threads(1)
    losses = run(TP1, root / "tp1", save=root / "tp1-ckpt")
    checkpoint_at(root / "tp1-ckpt")  # made here: the four ranks would race to make it
    return losses


@pytest.fixture(scope="module")
def four_rank(root, tp1) -> dict:
    ranks = run_distributed(four_rank_work, 4, str(root), timeout=400)
    return {key: next(r[key] for r in ranks if r[key] is not None) for key in ranks[0]}


@pytest.fixture(scope="module")
def tp2pp2_checkpoint(root, four_rank) -> Path:
    return root / "tp2pp2-ckpt-at-6"


def assert_continues(losses: dict, reference: dict, name: str, after: int = SAVED_AT) -> None:
    assert sorted(losses) == list(range(after + 1, ITERS + 1)), f"{name} ran iterations {sorted(losses)}"
    for it in losses:
        want = reference[it]
        assert abs(losses[it] - want) <= RTOL * abs(want), f"{name}: iteration {it} loss {losses[it]!r} vs {want!r}"


def test_the_reference_checkpoints_at_6_in_every_rank_directory(root, four_rank):
    assert sorted(four_rank["reference"]) == list(range(1, ITERS + 1))
    iteration = root / "tp2pp2-ckpt" / f"iter_{SAVED_AT:07d}"
    assert sorted(p.name for p in iteration.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
                                                           "mp_rank_01_001"]


def test_tp1_resumes_a_tp2_pp2_checkpoint(root, four_rank, tp2pp2_checkpoint):
    torch.set_num_threads(1)
    losses = run(TP1, root / "tp1-from-tp2pp2", load=tp2pp2_checkpoint)
    assert_continues(losses, four_rank["reference"], "TP1 from TP2xPP2")


@pytest.fixture(scope="module")
def dp2(root, four_rank) -> dict:
    return next(r for r in run_distributed(dp2_work, 2, str(root), timeout=300) if r is not None)


def test_dp2_distributed_optimizer_resumes_a_tp2_pp2_checkpoint(four_rank, dp2):
    assert_continues(dp2, four_rank["reference"], "DP2 distributed optimizer from TP2xPP2")


def test_tp1_resumes_the_pieces_of_a_dp2_distributed_optimizer_checkpoint(root, four_rank, dp2):
    """Same TP x PP, another DP size and the ordinary optimizer: the DP ranks' pieces are glued back."""
    torch.set_num_threads(1)
    losses = run(TP1, root / "tp1-from-dp2", load=checkpoint_at(root / "dp2-ckpt", 9))
    assert_continues(losses, four_rank["reference"], "TP1 from DP2 distributed optimizer", after=9)


def test_pp2_dp2_resumes_a_tp2_pp2_checkpoint(four_rank):
    assert_continues(four_rank["pp2dp2"], four_rank["reference"], "PP2xDP2 from TP2xPP2")


def test_tp2_pp2_resumes_a_tp1_checkpoint(four_rank, tp1):
    assert_continues(four_rank["reverse"], tp1, "TP2xPP2 from TP1")


def vpp_work(root: str):
    torch.set_num_threads(1)
    root = Path(root)
    return run(PP2_VPP2, root / "vpp", load=root / "tp1-ckpt-at-6", save=root / "vpp-ckpt", save_interval=3)


@pytest.fixture(scope="module")
def vpp(root, tp1) -> dict:
    """PP 2 with 2 virtual chunks per rank (model0, model1) resuming the TP 1 checkpoint at 6; it saves at 9."""
    return next(r for r in run_distributed(vpp_work, 2, str(root), timeout=300) if r is not None)


def test_pp2_vpp2_resumes_a_tp1_checkpoint_chunk_by_chunk(root, tp1, vpp):
    """Each (PP rank, chunk) is a pipeline position in model order: chunk c of rank r gets layer c x PP + r."""
    assert_continues(vpp, tp1, "PP2 VPP2 from TP1")
    saved = ckpt.load_checkpoint_file(root / "vpp-ckpt" / f"iter_{9:07d}" / "mp_rank_00_000" / ckpt.MODEL_FILENAME)
    assert "model" not in saved and sorted(k for k in saved if k.startswith("model")) == ["model0", "model1"]


def test_tp1_resumes_a_pp2_vpp2_checkpoint(root, tp1, vpp):
    torch.set_num_threads(1)
    losses = run(TP1, root / "tp1-from-vpp", load=checkpoint_at(root / "vpp-ckpt", 9))
    assert_continues(losses, tp1, "TP1 from PP2 VPP2", after=9)


# -- bad input ---------------------------------------------------------------------------------------

def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_rank_files_are_named_and_nothing_is_written(root, tp2pp2_checkpoint, tmp_path):
    load = _copy(tp2pp2_checkpoint, tmp_path / "load")
    shutil.rmtree(load / f"iter_{SAVED_AT:07d}" / "mp_rank_01_001")
    before = sorted(str(p) for p in load.rglob("*"))
    with pytest.raises(ckpt.CheckpointError, match=r"missing shard\(s\) \[\(1, 1\)\] \(tp, pp\) for TP 2 x PP 2"):
        run(TP1, tmp_path / "run", load=load, save=tmp_path / "save")
    assert sorted(str(p) for p in load.rglob("*")) == before and not (tmp_path / "save").exists()


def test_missing_distributed_optimizer_files_are_named(root, dp2, tmp_path):
    load = _copy(root / "dp2-ckpt", tmp_path / "load")
    (load / f"iter_{ITERS:07d}" / "mp_rank_00" / ckpt.distrib_optim_filename(1)).unlink()
    with pytest.raises(ckpt.CheckpointError, match="lacks distrib_optim_dp_001.pt .*1 of 2 DP ranks"):
        run(TP1, tmp_path / "run", load=load, save=tmp_path / "save")
    assert not (tmp_path / "save").exists()


def resume_tp1_with(model_changes: dict, load: Path, run_dir: Path):
    changed = recipe(TP1).to_dict()
    changed["model"].update(model_changes)
    try:
        proof.fit(recipe_from_dict(changed), run_dir, load=load)
    finally:
        ps.destroy_model_parallel()


def test_a_changed_model_shape_is_refused_with_the_changed_keys(tp2pp2_checkpoint, tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="changed keys that alter training: model.hidden_size, "
                                                   "model.num_attention_heads"):
        resume_tp1_with({"hidden_size": 64, "num_attention_heads": 8}, tp2pp2_checkpoint, tmp_path)


def test_another_vocabulary_padding_is_refused_with_the_fix(tp2pp2_checkpoint, tmp_path):
    """The TP 2 checkpoint pads 100 tokens to 128 (64 x TP 2); TP 1 with make_vocab_size_divisible_by 16 pads to 112."""
    with pytest.raises(ckpt.CheckpointError, match="pads the vocabulary to 128 rows .*this run to 112; pad alike: "
                                                   "--set make_vocab_size_divisible_by=128"):
        resume_tp1_with({"make_vocab_size_divisible_by": 16}, tp2pp2_checkpoint, tmp_path)
