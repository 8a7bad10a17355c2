"""The parallel proof: every TP x PP x DP layout trains the tiny GPT exactly like one process.

Each layout runs ITERATIONS iterations of the real training loop (megatron_core.training.trainer.
Trainer) on the real pieces: GPTModel, the pipeline schedule, DP grad sync, MegatronOptimizer or
the DistributedOptimizer, the LR scheduler. Model and optimizer are built by
megatron_core.pretrain_gpt.build_model_and_optimizer (in the recipe's precision) and handed in to
the Trainer, which allows it: below train()'s recipe checks, so fp16's machinery (loss scaler,
skipped steps, its checkpoints) is tested here on the CPU, where train() refuses fp16. Every rank
returns its parameter shards under their global names; `merge_params` glues them back.

Data: a synthetic dataset whose sample i is drawn from its own seeded generator; the trainer's
batch iterator splits each global batch over DP ranks as Megatron's sampler does.
The harness functions are imported by the other parallel test modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.distributed as dist

from megatron_core import parallel_state as ps
from megatron_core.config import Recipe, recipe_from_dict
from megatron_core.models.gpt import GPTModel
from megatron_core.training.logging import RunLogger, read_metrics

SEQ = 16
VOCAB = 100  # padded to 128 under TP 1 and TP 2 (make_vocab_size_divisible_by 64)
GLOBAL_BATCH = 8
ITERATIONS = 10
SEED = 1234


@dataclass(frozen=True)
class Layout:
    name: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch_size: int = 2
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    recompute: Optional[str] = None
    vpp_layers: Optional[int] = None  # num_layers_per_virtual_pipeline_stage (the interleaved schedule)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_microbatches(self) -> int:
        return GLOBAL_BATCH // (self.micro_batch_size * self.dp)


BASELINE = Layout("single process")


def make_recipe(layout: Layout, **training) -> Recipe:
    raw = {
        "name": "parallel-proof",
        "version": 1,
        "tokenizer": {"vocab_size": VOCAB},
        "model": dict(
            num_layers=4,
            hidden_size=32,
            num_attention_heads=4,
            ffn_hidden_size=64,
            seq_length=SEQ,
            max_position_embeddings=SEQ,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            make_vocab_size_divisible_by=64,
            attention_backend="unfused",
        ),
        "parallel": dict(
            world_size=layout.world_size,
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            sequence_parallel=layout.sequence_parallel,
            use_distributed_optimizer=layout.distributed_optimizer,
            recompute_granularity=layout.recompute,
            ddp_bucket_size=4000,
            num_layers_per_virtual_pipeline_stage=layout.vpp_layers,
        ),
        "training": {
            **dict(
                micro_batch_size=layout.micro_batch_size,
                global_batch_size=GLOBAL_BATCH,
                train_iters=ITERATIONS,
                lr=2e-3,
                min_lr=2e-4,
                lr_decay_style="cosine",
                lr_warmup_iters=2,
                lr_decay_iters=ITERATIONS,
                weight_decay=0.01,
                clip_grad=1.0,
                seed=SEED,
                log_interval=1,
                eval_interval=1000,
                eval_iters=0,
                fusions="torch",
                device="cpu",
            ),
            **training,
        },
    }
    return recipe_from_dict(raw)


class SyntheticTokens(torch.utils.data.Dataset):
    """GPT dataset items (tokens, labels, loss_mask, position_ids); sample i from generator seed i."""

    def __len__(self) -> int:
        return 4 * ITERATIONS * GLOBAL_BATCH

    def __getitem__(self, index: int) -> dict:
        generator = torch.Generator().manual_seed(10_000 + index)
        text = torch.randint(0, VOCAB, (SEQ + 1,), generator=generator)
        return {
            "tokens": text[:-1].contiguous(),
            "labels": text[1:].contiguous(),
            "loss_mask": torch.ones(SEQ),
            "position_ids": torch.arange(SEQ),
        }


def build(recipe: Recipe):
    """(model as the loop sees it, the GPTModel, optimizer) for this rank, built by
    megatron_core.pretrain_gpt.build_model_and_optimizer itself (any precision the recipe asks for)."""
    from megatron_core.pretrain_gpt import build_model_and_optimizer, seed_everything

    p = recipe.parallel
    if dist.is_initialized():
        ps.initialize_model_parallel(
            p.tensor_model_parallel_size,
            p.pipeline_model_parallel_size,
            p.virtual_pipeline_model_parallel_size(recipe.model.num_layers),
        )
    seed_everything(recipe.training.seed)
    _, model, module, optimizer = build_model_and_optimizer(
        recipe, recipe.padded_vocab_size(VOCAB), torch.device("cpu")
    )
    return model, module, optimizer


def trainer_for(
    recipe: Recipe,
    run_dir: Path,
    save: Optional[Path] = None,
    load: Optional[Path] = None,
    datasets=None,
    save_optim: bool = True,
):
    """The real Trainer over this rank's build(recipe), on `datasets` (train, valid, test), default
    the synthetic tokens. Below train()'s recipe checks: the CPU tests of fp16's machinery run here."""
    from megatron_core.pretrain_gpt import precision_of
    from megatron_core.training.trainer import Trainer, _is_log_writer

    model, module, optimizer = build(recipe)
    precision, dtype = precision_of(recipe)
    logger = RunLogger(run_dir, writer=_is_log_writer(), tensorboard=False)
    return Trainer(
        recipe,
        model,
        datasets or (SyntheticTokens(), None, None),
        recipe.padded_vocab_size(VOCAB),
        run_dir,
        optimizer=optimizer,
        device=torch.device("cpu"),
        save=save,
        load=load,
        save_optim=save_optim,
        logger=logger,
        precision=precision,
        params_dtype=str(dtype).replace("torch.", ""),
    ), module


def fit(
    recipe: Recipe,
    run_dir: Path,
    save: Optional[Path] = None,
    load: Optional[Path] = None,
    datasets=None,
    save_optim: bool = True,
):
    """Train with the real loop (trainer_for); returns (model as the loop saw it, GPTModel, optimizer,
    losses by iteration on the log-writing rank, else None)."""
    trainer, module = trainer_for(recipe, run_dir, save, load, datasets, save_optim)
    trainer.fit()
    losses = {m["iteration"]: m["lm_loss"] for m in read_metrics(run_dir) if m["type"] == "train"}
    return trainer.model, module, trainer.optimizer, (losses if trainer.logger.writer else None)


def rank_params(module: GPTModel) -> dict:
    """This rank's parameters by global name: (tensor, partition_dim or None, tp_rank)."""
    tp_rank = ps.get_tensor_model_parallel_rank()
    out = {}
    for name, param in module.named_parameters():
        dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
        out.setdefault(module.global_parameter_name(name), []).append((param.detach().clone(), dim, tp_rank))
    return out


def rank_summary(layout: Layout, module, losses) -> dict:
    return {
        "layout": layout.name,
        "losses": losses,
        "params": rank_params(module),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(),
    }


def train_layout(layout: Layout, run_root: str) -> dict:
    """Train ITERATIONS iterations of `layout` on this rank; tear the groups down afterwards."""
    try:
        run_dir = Path(run_root) / layout.name.replace(" ", "_")
        _, module, _, losses = fit(make_recipe(layout), run_dir)
        return rank_summary(layout, module, losses)
    finally:
        ps.destroy_model_parallel()


def train_layouts(layouts: list[Layout], run_root: str) -> list[dict]:
    """Every layout of one spawn, one after the other (each builds and destroys its groups)."""
    torch.set_num_threads(1)
    return [train_layout(layout, run_root) for layout in layouts]


def merge_params(rank_results: list[dict]) -> dict[str, list[torch.Tensor]]:
    """Full tensors by global name from DP rank 0 of every (TP, PP) rank. A name can have two
    copies (the tied embedding on the first and last stage): each is merged and kept."""
    shards: dict[tuple[str, int], dict[int, tuple[torch.Tensor, Optional[int]]]] = {}
    for result in rank_results:
        if result["dp_rank"] != 0:
            continue
        for name, copies in result["params"].items():
            for tensor, dim, tp_rank in copies:
                shards.setdefault((name, result["pp_rank"]), {})[tp_rank] = (tensor, dim)
    merged: dict[str, list[torch.Tensor]] = {}
    for (name, _), by_tp in sorted(shards.items()):
        pieces = [by_tp[r] for r in sorted(by_tp)]
        dim = pieces[0][1]
        tensor = torch.cat([t for t, _ in pieces], dim=dim) if dim is not None else pieces[0][0]
        merged.setdefault(name, []).append(tensor)
    return merged


def layout_losses(rank_results: list[dict]) -> list[float]:
    """Loss per iteration from the rank that logs it (last stage, TP 0, DP 0)."""
    writers = [r["losses"] for r in rank_results if r["losses"] is not None]
    assert len(writers) == 1, f"expected one log-writing rank, got {len(writers)}"
    return [writers[0][it] for it in sorted(writers[0])]


def assert_matches_baseline(rank_results: list[dict], baseline: dict, *, rtol: float = 1e-5, atol: float = 1e-5):
    """Loss of every iteration within rtol (relative) and every parameter within atol."""
    name = rank_results[0]["layout"]
    losses, expected = layout_losses(rank_results), layout_losses([baseline])
    assert len(losses) == len(expected)
    for it, (got, want) in enumerate(zip(losses, expected)):
        assert abs(got - want) <= rtol * abs(want), f"{name}: iteration {it} loss {got!r} vs single process {want!r}"
    merged, reference = merge_params(rank_results), merge_params([baseline])
    assert set(merged) == set(reference), f"{name}: parameter names differ: {set(merged) ^ set(reference)}"
    for pname, copies in merged.items():
        want = reference[pname][0]
        for got in copies:
            assert got.shape == want.shape, f"{name}: {pname} shape {tuple(got.shape)} vs {tuple(want.shape)}"
            diff = (got - want).abs().max().item()
            assert diff <= atol, f"{name}: {pname} differs by {diff:.3g} after {ITERATIONS} steps"


def single_process_baseline(run_root: str) -> dict:
    assert not dist.is_initialized()
    return train_layout(BASELINE, run_root)


def train_interrupted(layout: Layout, run_root: str, stop_at: int) -> dict:
    """Train to `stop_at` and checkpoint, then resume in a fresh model and run to ITERATIONS."""
    root = Path(run_root) / (layout.name.replace(" ", "_") + "-resume")
    save = root / "checkpoints"
    try:
        fit(make_recipe(layout, train_iters=stop_at), root / "first", save=save)
    finally:
        ps.destroy_model_parallel()
    try:
        _, module, _, losses = fit(make_recipe(layout), root / "second", save=save, load=save)
        return rank_summary(layout, module, losses)
    finally:
        ps.destroy_model_parallel()


def train_entry_point(layout: Layout, run_root: str) -> Optional[dict[int, float]]:
    """megatron_core.pretrain_gpt.train() itself (it builds groups, model and optimizer); losses on the writer rank."""
    from megatron_core.pretrain_gpt import train
    from megatron_core.training.trainer import _is_log_writer

    run_dir = Path(run_root) / ("entry-" + layout.name.replace(" ", "_"))
    try:
        train(make_recipe(layout), run_dir, None, datasets=(SyntheticTokens(), None, None), vocab_size=VOCAB)
        if not _is_log_writer():
            return None
        return {m["iteration"]: m["lm_loss"] for m in read_metrics(run_dir) if m["type"] == "train"}
    finally:
        ps.destroy_model_parallel()


def first_step_grads(layout: Layout) -> dict:
    """The gradients one forward_backward leaves (the schedule of this layout, grad sync and
    finish_grad_sync included, before any optimizer step), under their global names."""
    from megatron_core.distributed.grad_sync import gradient
    from megatron_core.pipeline_parallel import get_forward_backward_func
    from megatron_core.training.data_iterators import batch_iterator
    from megatron_core.training.trainer import gpt_forward_step

    try:
        recipe = make_recipe(layout)
        model, module, _ = build(recipe)
        iterator = batch_iterator(
            SyntheticTokens(),
            consumed_samples=0,
            micro_batch_size=layout.micro_batch_size,
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size(),
            device=torch.device("cpu"),
        )
        losses = get_forward_backward_func()(
            gpt_forward_step,
            iterator,
            model,
            layout.num_microbatches,
            seq_length=SEQ,
            micro_batch_size=layout.micro_batch_size,
        )
        summary = rank_summary(layout, module, None)
        summary["losses"] = [float(d["lm loss"]) for d in losses]
        tp_rank = ps.get_tensor_model_parallel_rank()
        summary["params"] = {}
        for name, param in module.named_parameters():
            dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
            summary["params"].setdefault(module.global_parameter_name(name), []).append(
                (gradient(param).detach().clone(), dim, tp_rank)
            )
        return summary
    finally:
        ps.destroy_model_parallel()


def two_and_four_rank_work(
    layouts: list[Layout], resume: Optional[Layout], run_root: str, entry_layouts: tuple = (), grad_layouts: tuple = ()
) -> dict:
    torch.set_num_threads(1)
    results = {
        "layouts": [train_layout(layout, run_root) for layout in layouts],
        "entry": [train_entry_point(layout, run_root) for layout in entry_layouts],
        "grads": [first_step_grads(layout) for layout in grad_layouts],
    }
    if resume is not None:
        results["resume"] = train_interrupted(resume, run_root, stop_at=ITERATIONS // 2)
    return results


# ----------------------------------------------------------------------------------------------
# The tests: one spawn of 2 ranks and one of 4 ranks run every layout; each layout is one test.
# ----------------------------------------------------------------------------------------------

# The interleaved schedule: 2 model chunks of 1 layer per rank (rank 0: layers 0, 2; rank 1: 1, 3).
PP2_VPP2 = Layout("PP2 VPP2", pp=2, vpp_layers=1)
TWO_RANK_LAYOUTS = [
    Layout("TP2", tp=2),
    Layout("TP2 SP", tp=2, sequence_parallel=True),
    Layout("PP2", pp=2),
    Layout("PP2 4 micro batches", pp=2, micro_batch_size=2),  # M = 4
    Layout("PP2 1 micro batch", pp=2, micro_batch_size=8),  # M = 1: no steady state on stage 0
    Layout("PP2 full recompute", pp=2, recompute="full"),
    Layout("DP2", dp=2),
    Layout("DP2 distributed optimizer", dp=2, distributed_optimizer=True),
    PP2_VPP2,  # M = 4: warm-up, steady 1F1B and cool-down
    Layout("PP2 VPP2 2 micro batches", pp=2, vpp_layers=1, micro_batch_size=4),  # M = 2: all warm-up on rank 0
]
TP2_PP2 = Layout("TP2xPP2", tp=2, pp=2)
FOUR_RANK_LAYOUTS = [
    TP2_PP2,
    Layout("TP2xPP2 SP", tp=2, pp=2, sequence_parallel=True),  # p2p tensors are [s/tp, b, h]
    Layout("DP2xTP2", tp=2, dp=2),
    Layout("PP4", pp=4, micro_batch_size=2),  # M = 4
    Layout("PP4 2 micro batches", pp=4, micro_batch_size=4),  # M < pp - 1
    Layout("DP2xPP2 distributed optimizer", pp=2, dp=2, distributed_optimizer=True),
    Layout("TP2xPP2 VPP2", tp=2, pp=2, vpp_layers=1),
    Layout("TP2xPP2 VPP2 SP", tp=2, pp=2, vpp_layers=1, sequence_parallel=True),
    Layout("DP2xPP2 VPP2 distributed optimizer", pp=2, dp=2, vpp_layers=1, distributed_optimizer=True),
]
assert all(layout.num_microbatches >= 1 for layout in TWO_RANK_LAYOUTS + FOUR_RANK_LAYOUTS)


# Through megatron_core.pretrain_gpt.train() itself, not only the Trainer with this module's build().
ENTRY_LAYOUTS = (
    Layout("PP2", pp=2),
    Layout("DP2 distributed optimizer", dp=2, distributed_optimizer=True),
    Layout("PP2 VPP2", pp=2, vpp_layers=1),
)
ENTRY_XFAIL: dict[str, str] = {}  # layouts of the entry point known not to match (none)


# Gradients after one forward_backward, compared directly (the interleaved schedule's own proof;
# the layouts above compare losses and weights after ITERATIONS steps).
GRAD_LAYOUTS = {
    2: (PP2_VPP2,),
    4: (Layout("TP2xPP2 VPP2", tp=2, pp=2, vpp_layers=1), Layout("DP2xPP2 VPP2", pp=2, dp=2, vpp_layers=1)),
}


@pytest.fixture(scope="module")
def run_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("parallel-proof"))


@pytest.fixture(scope="module")
def baseline(run_root) -> dict:
    torch.set_num_threads(1)
    return single_process_baseline(run_root)


@pytest.fixture(scope="module")
def two_rank(run_root) -> dict:
    from distributed_utils import run_distributed

    return run_distributed(
        two_and_four_rank_work, 2, TWO_RANK_LAYOUTS, PP2_VPP2, run_root, ENTRY_LAYOUTS, GRAD_LAYOUTS[2], timeout=300
    )


@pytest.fixture(scope="module")
def four_rank(run_root) -> dict:
    from distributed_utils import run_distributed

    return run_distributed(
        two_and_four_rank_work, 4, FOUR_RANK_LAYOUTS, TP2_PP2, run_root, (), GRAD_LAYOUTS[4], timeout=300
    )


def test_baseline_learns(baseline):
    losses = layout_losses([baseline])
    assert len(losses) == ITERATIONS and losses[-1] < losses[0]


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(TWO_RANK_LAYOUTS)), ids=[layout.name for layout in TWO_RANK_LAYOUTS])
def test_two_rank_layout_matches_single_process(two_rank, baseline, index):
    assert_matches_baseline([rank["layouts"][index] for rank in two_rank], baseline)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(FOUR_RANK_LAYOUTS)), ids=[layout.name for layout in FOUR_RANK_LAYOUTS])
def test_four_rank_layout_matches_single_process(four_rank, baseline, index):
    assert_matches_baseline([rank["layouts"][index] for rank in four_rank], baseline)


def assert_resume_is_exact(resumed_ranks: list[dict], straight_ranks: list[dict]) -> None:
    uninterrupted = layout_losses(straight_ranks)
    resumed = [r["losses"] for r in resumed_ranks if r["losses"] is not None][0]
    assert sorted(resumed) == list(range(ITERATIONS // 2 + 1, ITERATIONS + 1)), resumed
    assert [resumed[it] for it in sorted(resumed)] == uninterrupted[ITERATIONS // 2 :]  # bit for bit
    continued, straight = merge_params(resumed_ranks), merge_params(straight_ranks)
    assert set(continued) == set(straight)
    for name, copies in straight.items():
        for got, want in zip(continued[name], copies):
            assert torch.equal(got, want), f"{name} differs after resume"


@pytest.mark.slow
def test_tp2_pp2_checkpoint_resume_is_exact(four_rank):
    assert_resume_is_exact([rank["resume"] for rank in four_rank], [rank["layouts"][0] for rank in four_rank])


@pytest.mark.slow
def test_pp2_vpp2_checkpoint_resume_is_exact(two_rank):
    index = TWO_RANK_LAYOUTS.index(PP2_VPP2)
    assert_resume_is_exact([rank["resume"] for rank in two_rank], [rank["layouts"][index] for rank in two_rank])


@pytest.mark.slow
def test_pp2_vpp2_checkpoint_holds_chunks_and_converts_to_the_trained_model(two_rank, run_root):
    """Each rank file holds model0 and model1 (Megatron's layout; the tied embedding in chunk 0 of
    the first stage and, as word_embeddings_for_head, in the last chunk of the last stage), and the
    converter's reader merges them into exactly the weights the run ended with."""
    from megatron_core.checkpoint_format import load_checkpoint_file
    from training_fixtures import checkpoint_file
    from megatron_core.convert import read_checkpoint

    save = Path(run_root) / "PP2_VPP2-resume" / "checkpoints"
    first, last = (load_checkpoint_file(checkpoint_file(save, ITERATIONS, 0, r, 2)) for r in range(2))
    for state in (first, last):
        assert "model" not in state and {"model0", "model1"} <= set(state)
        assert state["args"].virtual_pipeline_model_parallel_size == 2
        assert state["args"].num_layers_per_virtual_pipeline_stage == 1
        for chunk in ("model0", "model1"):
            assert sorted(k for k in state[chunk]["language_model"]["encoder"] if k.startswith("layers.")) == sorted(
                f"layers.0.{n}" for n in _LAYER_PARAMS
            )  # one layer per chunk, numbered locally
    assert "embedding" in first["model0"]["language_model"] and "embedding" not in first["model1"]["language_model"]
    assert "word_embeddings_for_head" in last["model1"] and "word_embeddings_for_head" not in last["model0"]
    assert "final_layernorm.weight" in last["model1"]["language_model"]["encoder"]
    merged = read_checkpoint(save)
    assert (merged.pipeline_parallel, merged.iteration) == (2, ITERATIONS)
    trained = merge_params([rank["resume"] for rank in two_rank])
    assert set(merged.state) == set(trained)
    for name, tensor in merged.state.items():
        assert torch.equal(tensor, trained[name][0]), name


_LAYER_PARAMS = [
    f"{module}.{leaf}"
    for module in (
        "input_layernorm",
        "self_attention.query_key_value",
        "self_attention.dense",
        "post_attention_layernorm",
        "mlp.dense_h_to_4h",
        "mlp.dense_4h_to_h",
    )
    for leaf in ("weight", "bias")
]


@pytest.fixture(scope="module")
def entry_baseline(run_root) -> dict[int, float]:
    return train_entry_point(BASELINE, run_root)


@pytest.mark.parametrize(
    "index",
    [
        pytest.param(
            i,
            id=layout.name,
            marks=[pytest.mark.xfail(reason=ENTRY_XFAIL[layout.name], strict=True)]
            if layout.name in ENTRY_XFAIL
            else [],
        )
        for i, layout in enumerate(ENTRY_LAYOUTS)
    ],
)
@pytest.mark.slow
def test_train_entry_point_matches_single_process(two_rank, entry_baseline, index):
    losses = [rank["entry"][index] for rank in two_rank if rank["entry"][index] is not None][0]
    assert sorted(losses) == sorted(entry_baseline) == list(range(1, ITERATIONS + 1))
    for it, want in entry_baseline.items():
        assert losses[it] == pytest.approx(want, rel=1e-5), f"iteration {it}"


@pytest.fixture(scope="module")
def baseline_grads() -> dict:
    torch.set_num_threads(1)
    return first_step_grads(BASELINE)


@pytest.mark.parametrize(
    "world,index",
    [(w, i) for w in sorted(GRAD_LAYOUTS) for i in range(len(GRAD_LAYOUTS[w]))],
    ids=[layout.name for w in sorted(GRAD_LAYOUTS) for layout in GRAD_LAYOUTS[w]],
)
def test_interleaved_first_step_grads_match_single_process(request, baseline_grads, world, index):
    """Every gradient (both copies of the tied embedding included) and every micro batch's loss
    of one interleaved forward_backward equal the single process's."""
    ranks = request.getfixturevalue("two_rank" if world == 2 else "four_rank")
    results = [rank["grads"][index] for rank in ranks]
    name = results[0]["layout"]
    layout = GRAD_LAYOUTS[world][index]
    for r in results:  # the last stage of DP rank d holds the losses of micro batches d, d + dp, ...
        if r["pp_rank"] != layout.pp - 1:
            assert r["losses"] == []
            continue
        want = baseline_grads["losses"][r["dp_rank"] :: layout.dp]
        assert r["losses"] == pytest.approx(want, rel=1e-6, abs=0), f"{name}: losses {r['losses']} vs {want}"
    merged, reference = merge_params(results), merge_params([baseline_grads])
    assert set(merged) == set(reference)
    for pname, copies in merged.items():
        want = reference[pname][0]
        for got in copies:
            diff = (got - want).abs().max().item()
            assert diff <= 1e-6 * max(want.abs().max().item(), 1e-3), f"{name}: grad of {pname} differs by {diff:.3g}"
