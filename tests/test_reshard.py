"""Resharding on resume: a checkpoint written under one TP x PP x DP layout (either optimizer)
continues under another exactly like the run that wrote it.

A TP 2 x PP 2 run trains 12 iterations and checkpoints at iteration 6; TP 1, DP 2 with the
distributed optimizer and PP 2 x DP 2 resume from that checkpoint and must reproduce its losses of
iterations 7-12 within 1e-4 (relative). The reverse: TP 2 x PP 2 resumes from a TP 1 checkpoint and
must reproduce the TP 1 run's losses; TP 1 resumes the DP 2 run's distributed-optimizer pieces
(checkpoint at 9). The same TP 2 x PP 2 run in bf16 and in fp16
(fp16 at the Trainer level: train() refuses fp16 on a CPU) is resumed by TP 1 and by DP 2 with the
distributed optimizer; a TP 2 + sequence-parallel run resumes the TP 1 checkpoint and is resumed by
TP 1. What must carry over: weights, fp32 masters, Adam moments, the fp16 loss scaler,
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
from megatron_core import checkpoint_format as cf
from megatron_core import parallel_state as ps
from megatron_core.config import recipe_from_dict
from megatron_core.training.logging import read_metrics

ITERS, SAVED_AT, RTOL = 12, 6, 1e-4
TP2_PP2 = proof.Layout("TP2xPP2", tp=2, pp=2)
TP1 = proof.Layout("TP1")
TP2_SP = proof.Layout("TP2 SP", tp=2, sequence_parallel=True)
# The recipe values of each precision. bf16 and fp16 keep fp32 masters; the resumed runs must match
# the reference run's own losses within the same RTOL as fp32: a bf16/fp16 resume restores its
# weights bit for bit and its fp32 masters and moments exactly, so what is left is the new layout's
# reduction order in a 16-bit forward. Measured here (losses 7-12, relative): bf16 1.8e-5 at most,
# fp16 2.3e-6 at most; even a bf16 TP 1 run from scratch stays within 3.6e-5 of the TP 2 x PP 2 one
# (this tiny model's loss is reduced in fp32). So 1e-4 is honest, but too loose to tell restored
# masters from masters rebuilt from the bf16 weights (that resume measured 2e-5 off): that is
# checked directly (test_resumed_masters_are_the_checkpoints_fp32_values). fp16's loss scale grows
# every 4 clean steps, so at iteration 6 the scaler holds a scale (2048) and a growth count (2) that
# a resume must carry: it doubles again at 8, not at 10 (growth count lost) or from 1024 (scaler lost).
PRECISIONS = {
    "fp32": {},
    "bf16": {"bf16": True},
    "fp16": {"fp16": True, "initial_loss_scale": 1024.0, "loss_scale_window": 4},
}


DP2_DISTOPT = proof.Layout("DP2 distributed optimizer", dp=2, distributed_optimizer=True)
PP2_DP2 = proof.Layout("PP2xDP2", pp=2, dp=2)
PP2_VPP2 = proof.Layout("PP2 VPP2", pp=2, vpp_layers=1)


def named(name: str, precision: str) -> str:
    """The directory name of a run or checkpoint of `precision` (fp32 keeps the plain name)."""
    return name if precision == "fp32" else f"{name}-{precision}"


def recipe(layout: proof.Layout, **training):
    return proof.make_recipe(
        layout, **{"train_iters": ITERS, "lr_decay_iters": ITERS, "save_interval": SAVED_AT, **training}
    )


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
        (copy / cf.TRACKER_FILENAME).write_text(f"{iteration}\n")
    return copy


def loss_scales(run_dir: Path) -> dict[int, float]:
    return {m["iteration"]: m["loss_scale"] for m in read_metrics(run_dir) if m["type"] == "train"}


def four_rank_work(root: str) -> dict:
    """The TP 2 x PP 2 reference in each precision (checkpoints at 6), PP 2 x DP 2 resuming the fp32
    one, and TP 2 x PP 2 resuming from the TP 1 checkpoint."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    root = Path(root)
    results = {}
    for precision, values in PRECISIONS.items():
        save = root / named("tp2pp2-ckpt", precision)
        results[named("reference", precision)] = run(TP2_PP2, root / named("tp2pp2", precision), save=save, **values)
        if dist.get_rank() == 0:
            checkpoint_at(save)
    dist.barrier()
    return {
        **results,
        "pp2dp2": run(PP2_DP2, root / "pp2dp2", load=root / "tp2pp2-ckpt-at-6"),
        "reverse": run(TP2_PP2, root / "reverse", load=checkpoint_at(root / "tp1-ckpt")),
    }


def reference_checkpoint(root: Path, precision: str = "fp32") -> Path:
    """The TP 2 x PP 2 reference's checkpoint at 6 in `precision` (made by four_rank_work)."""
    return root / f"{named('tp2pp2-ckpt', precision)}-at-{SAVED_AT}"


def dp2_work(root: str) -> dict:
    """DP 2 with the distributed optimizer resuming the TP 2 x PP 2 checkpoint of each precision
    (the fp32 run saves at 9 and 12 for the cases that resume it)."""
    torch.set_num_threads(1)
    root = Path(root)
    saves = {"fp32": {"save": root / "dp2-ckpt", "save_interval": 3}}
    return {
        precision: run(
            DP2_DISTOPT,
            root / named("dp2", precision),
            load=reference_checkpoint(root, precision),
            **saves.get(precision, {}),
            **values,
        )
        for precision, values in PRECISIONS.items()
    }


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
def four_rank(root, tp1) -> dict:  # noqa: ARG001 - reads the files tp1 writes in root
    ranks = run_distributed(four_rank_work, 4, str(root), timeout=400)
    return {key: next(r[key] for r in ranks if r[key] is not None) for key in ranks[0]}


@pytest.fixture(scope="module")
def tp2pp2_checkpoint(root, four_rank) -> Path:  # noqa: ARG001 - four_rank writes it
    return reference_checkpoint(root)


def assert_continues(losses: dict, reference: dict, name: str, after: int = SAVED_AT) -> None:
    assert sorted(losses) == list(range(after + 1, ITERS + 1)), f"{name} ran iterations {sorted(losses)}"
    for it in losses:
        want = reference[it]
        assert abs(losses[it] - want) <= RTOL * abs(want), f"{name}: iteration {it} loss {losses[it]!r} vs {want!r}"


def assert_resumes_the_reference(root: Path, four_rank: dict, precision: str, run_dir: Path, losses: dict) -> None:
    """The run in `run_dir` continued the TP 2 x PP 2 reference of `precision` from iteration 6: its
    losses within RTOL and, every iteration, the reference's loss scale (fp16's scaler carried over)."""
    reference_dir = root / named("tp2pp2", precision)
    assert_continues(losses, four_rank[named("reference", precision)], f"{run_dir.name} from TP2xPP2")
    assert loss_scales(run_dir) == {it: scale for it, scale in loss_scales(reference_dir).items() if it > SAVED_AT}


def test_the_reference_checkpoints_at_6_in_every_rank_directory(root, four_rank):
    assert sorted(four_rank["reference"]) == list(range(1, ITERS + 1))
    iteration = root / "tp2pp2-ckpt" / f"iter_{SAVED_AT:07d}"
    assert sorted(p.name for p in iteration.iterdir()) == [
        "manifest.json",
        "mp_rank_00_000",
        "mp_rank_00_001",
        "mp_rank_01_000",
        "mp_rank_01_001",
    ]
    # fp16's scale at the checkpoint is neither the initial one nor at a growth step (see PRECISIONS)
    assert [loss_scales(root / "tp2pp2-fp16")[it] for it in (3, 4, 6, 8)] == [1024.0, 2048.0, 2048.0, 4096.0]


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_tp1_resumes_a_tp2_pp2_checkpoint(root, four_rank, precision):
    torch.set_num_threads(1)
    run_dir = root / named("tp1-from-tp2pp2", precision)
    losses = run(TP1, run_dir, load=reference_checkpoint(root, precision), **PRECISIONS[precision])
    assert_resumes_the_reference(root, four_rank, precision, run_dir, losses)


def resumed_masters(layout: proof.Layout, load: Path, run_dir: Path, **training) -> tuple[list[tuple], object]:
    """((fp32 master, model weight) of every parameter, the optimizer) right after `layout` resumed
    `load`, before any step."""
    try:
        trainer, _ = proof.trainer_for(recipe(layout, **training), run_dir, load=load)
        trainer.maybe_resume()
        optimizer = trainer.optimizer
        return list(zip(optimizer.master_params, optimizer.model_params)), optimizer
    finally:
        ps.destroy_model_parallel()


def masters_hold_more_than_the_weights(pairs: list[tuple]) -> float:
    """The fraction of master values the 16-bit weights cannot hold (each weight being its master
    rounded): 0 for masters rebuilt from the weights, near 1 for masters that took fp32 Adam steps."""
    held = total = 0
    for master, weight in pairs:
        assert master.dtype == torch.float32 and torch.equal(master.to(weight.dtype), weight)
        held += int((master.to(weight.dtype).float() == master).sum())
        total += master.numel()
    return 1 - held / total


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.usefixtures("four_rank")
def test_resumed_masters_are_the_checkpoints_fp32_values(root, precision, tmp_path):
    """TP 1 resuming the TP 2 x PP 2 checkpoint takes its fp32 masters, not the 16-bit weights made
    fp32 again (the losses cannot tell those apart at RTOL, see PRECISIONS): after 6 fp32 Adam steps
    nearly every master has bits its 16-bit weight lacks. A resume that rebuilt the masters from the
    weights (reload_model_params, what the trainer does before the optimizer state is loaded) has none."""
    torch.set_num_threads(1)
    pairs, optimizer = resumed_masters(TP1, reference_checkpoint(root, precision), tmp_path, **PRECISIONS[precision])
    assert masters_hold_more_than_the_weights(pairs) > 0.9
    optimizer.reload_model_params()
    assert masters_hold_more_than_the_weights(pairs) == 0.0


@pytest.fixture(scope="module")
def dp2(root, four_rank) -> dict:  # noqa: ARG001 - resumes the checkpoints four_rank writes in root
    return next(r for r in run_distributed(dp2_work, 2, str(root), timeout=300) if r["fp32"] is not None)


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_dp2_distributed_optimizer_resumes_a_tp2_pp2_checkpoint(root, four_rank, dp2, precision):
    assert_resumes_the_reference(root, four_rank, precision, root / named("dp2", precision), dp2[precision])


@pytest.mark.usefixtures("dp2")
def test_tp1_resumes_a_dp2_distributed_optimizer_checkpoint(root, four_rank, tmp_path):
    """Same TP x PP, another DP size and the ordinary optimizer: the DP ranks' pieces are glued back."""
    torch.set_num_threads(1)
    losses = run(TP1, tmp_path / "tp1-from-dp2", load=checkpoint_at(root / "dp2-ckpt", 9))
    assert_continues(losses, four_rank["reference"], "TP1 from DP2 distributed optimizer", after=9)


def test_pp2_dp2_resumes_a_tp2_pp2_checkpoint(four_rank):
    assert_continues(four_rank["pp2dp2"], four_rank["reference"], "PP2xDP2 from TP2xPP2")


def test_tp2_pp2_resumes_a_tp1_checkpoint(four_rank, tp1):
    assert_continues(four_rank["reverse"], tp1, "TP2xPP2 from TP1")


TWO_RANK_RESUMES = {"sp": TP2_SP, "vpp": PP2_VPP2}


def resume_tp1_at_6_work(root: str, name: str):
    torch.set_num_threads(1)
    root = Path(root)
    return run(
        TWO_RANK_RESUMES[name], root / name, load=root / "tp1-ckpt-at-6", save=root / f"{name}-ckpt", save_interval=3
    )


def two_rank_resume(root: Path, name: str) -> dict:
    """The two-rank layout `name` resuming the TP 1 checkpoint at 6; it saves at 9 under {name}-ckpt."""
    return next(r for r in run_distributed(resume_tp1_at_6_work, 2, str(root), name, timeout=300) if r is not None)


@pytest.fixture(scope="module")
def sp(root, tp1) -> dict:  # noqa: ARG001 - reads the files tp1 writes in root
    """TP 2 with sequence parallelism."""
    return two_rank_resume(root, "sp")


def test_tp2_sequence_parallel_resumes_a_tp1_checkpoint(tp1, sp):
    assert_continues(sp, tp1, "TP2 SP from TP1")


@pytest.mark.usefixtures("sp")
def test_tp1_resumes_a_tp2_sequence_parallel_checkpoint(root, tp1):
    torch.set_num_threads(1)
    losses = run(TP1, root / "tp1-from-sp", load=checkpoint_at(root / "sp-ckpt", 9))
    assert_continues(losses, tp1, "TP1 from TP2 SP", after=9)


@pytest.fixture(scope="module")
def vpp(root, tp1) -> dict:  # noqa: ARG001 - reads the files tp1 writes in root
    """PP 2 with 2 virtual chunks per rank (model0, model1)."""
    return two_rank_resume(root, "vpp")


def test_pp2_vpp2_resumes_a_tp1_checkpoint_chunk_by_chunk(root, tp1, vpp):
    """Each (PP rank, chunk) is a pipeline position in model order: chunk c of rank r gets layer c x PP + r."""
    assert_continues(vpp, tp1, "PP2 VPP2 from TP1")
    saved = cf.load_checkpoint_file(root / "vpp-ckpt" / f"iter_{9:07d}" / "mp_rank_00_000" / cf.MODEL_FILENAME)
    assert "model" not in saved and sorted(k for k in saved if k.startswith("model")) == ["model0", "model1"]


@pytest.mark.usefixtures("vpp")
def test_tp1_resumes_a_pp2_vpp2_checkpoint(root, tp1):
    torch.set_num_threads(1)
    losses = run(TP1, root / "tp1-from-vpp", load=checkpoint_at(root / "vpp-ckpt", 9))
    assert_continues(losses, tp1, "TP1 from PP2 VPP2", after=9)


# -- bad input ---------------------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_rank_files_are_named_and_nothing_is_written(tp2pp2_checkpoint, tmp_path):
    load = _copy(tp2pp2_checkpoint, tmp_path / "load")
    shutil.rmtree(load / f"iter_{SAVED_AT:07d}" / "mp_rank_01_001")
    before = sorted(str(p) for p in load.rglob("*"))
    with pytest.raises(
        cf.CheckpointError,
        match=r"iter_0000006/mp_rank_01_001/model_optim_rng.pt is missing or truncated \(the manifest ",
    ):
        run(TP1, tmp_path / "run", load=load, save=tmp_path / "save")
    assert sorted(str(p) for p in load.rglob("*")) == before and not (tmp_path / "save").exists()


@pytest.mark.usefixtures("dp2")
def test_missing_distributed_optimizer_files_are_named(root, tmp_path):
    load = _copy(root / "dp2-ckpt", tmp_path / "load")
    for older in load.glob("iter_*"):  # nothing to fall back to: the damaged iteration's reason is the error
        if older.name != f"iter_{ITERS:07d}":
            shutil.rmtree(older)
    (load / f"iter_{ITERS:07d}" / "mp_rank_00" / cf.distrib_optim_filename(1)).unlink()
    with pytest.raises(cf.CheckpointError, match="mp_rank_00/distrib_optim_dp_001.pt is missing or truncated"):
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
    with pytest.raises(
        cf.CheckpointError, match="changed keys that alter training: model.hidden_size, model.num_attention_heads"
    ):
        resume_tp1_with({"hidden_size": 64, "num_attention_heads": 8}, tp2pp2_checkpoint, tmp_path)


def test_another_vocabulary_padding_is_refused_with_the_fix(tp2pp2_checkpoint, tmp_path):
    """The TP 2 checkpoint pads 100 tokens to 128 (64 x TP 2); TP 1 with make_vocab_size_divisible_by 16 pads to 112."""
    with pytest.raises(
        cf.CheckpointError,
        match="pads the vocabulary to 128 rows .*this run to 112; pad alike: --set make_vocab_size_divisible_by=128",
    ):
        resume_tp1_with({"make_vocab_size_divisible_by": 16}, tp2pp2_checkpoint, tmp_path)
