"""Where a fusion backend's loss drift comes from: an update that went wrong, or a forward that computes differently.

Two training runs of our model from the same weights on the same batches, dropout off: the reference (every
fusion on `torch`) and the candidate (`--fusions`, default `triton`: our Triton softmax and cross entropy, the
other fusions on their best other backend, as the start-up line says). After `--steps` steps it compares them
tensor by tensor (model weights, the optimizer's fp32 masters and Adam moments), then runs the next step's
micro batches forward only, crossing weights and fusions: each run's weights under each backend. The same
weights giving different losses under the two backends is the forward; the candidate's weights giving a
different loss under the reference backend is the update.

Written for stop 20's open question: on an H200 with every fusion on Triton (five kernels then; the LayerNorm,
bias-GeLU and bias-dropout-add ones have since been deleted as slower than PyTorch), bench.train's third-step
loss was 1.0e-3 below transformers' while all-torch matched to 2e-6. Step 1 runs at lr 0, so step 3 is the
first forward after a real update.

    python -m bench.drift --recipe codeparrot-small-1gpu --set ... [--fusions triton] [--steps 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import torch

from bench.cli import RESULTS, finish, results_path, write_result
from bench.train import Setup, build_ours
from megatron_core import config
from megatron_core.errors import UserError

NO_DROPOUT = ["hidden_dropout=0", "attention_dropout=0"]
TOP = 10  # tensors listed, largest difference first


def _snapshot(model: torch.nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """Every tensor an update writes, in fp32 on the CPU: `param/<name>`, `<state>/<name>` (fp32_param, the
    master, where the weights are 16-bit; exp_avg, exp_avg_sq)."""
    tensors = {f"param/{name}": p.detach().float().cpu() for name, p in model.named_parameters()}
    saved = optimizer.state_dict()
    param_state = saved["param_state"] if "param_state" in saved else optimizer.param_state()  # distributed: apart
    for name, state in param_state.items():
        tensors.update(
            {
                f"{key}/{name}": value.detach().float().cpu()
                for key, value in state.items()
                if isinstance(value, torch.Tensor)
            }
        )  # the distributed optimizer adds shard offsets
    return tensors


def compare_tensors(reference: dict[str, torch.Tensor], candidate: dict[str, torch.Tensor]) -> list[dict]:
    """Per tensor: the largest absolute difference, and it over the reference's largest magnitude."""
    if reference.keys() != candidate.keys():
        raise RuntimeError(f"the two runs hold different tensors: {sorted(reference.keys() ^ candidate.keys())[:5]}")
    rows = []
    for name, ref in reference.items():
        diff = float((candidate[name] - ref).abs().max()) if ref.numel() else 0.0
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        rows.append({"tensor": name, "max_abs_diff": diff, "relative": diff / scale if scale else diff})
    return sorted(rows, key=lambda row: -row["relative"])


@torch.no_grad()
def forward_losses(setup: Setup, recipe: config.Recipe, state: dict, batches: list[dict]) -> list[float]:
    """Each micro batch's loss under `recipe`'s fusions, with the weights `state`, forward only (the model
    alone: no optimizer, trainer or batch reader)."""
    from megatron_core import pretrain_gpt as train_lib
    from megatron_core.training.trainer import gpt_forward_step

    fusions = train_lib.resolve_run_backends(recipe, setup.device)
    model = train_lib.build_model(recipe, setup.padded_vocab, setup.device, setup.param_dtype, fusions)
    model.load_state_dict(state)
    losses = []
    for batch in batches:
        output, loss_func = gpt_forward_step(iter([batch]), model)
        losses.append(float(loss_func(output)[0]))
    return losses


def run(
    recipe_spec: str, overrides=(), workdir: str = "./work", fusions: str = "triton", steps: int = 2, echo=print
) -> dict:
    if steps < 1:
        raise UserError(f"--steps {steps}: need at least 1 step before the comparison")
    recipes = {
        side: config.load_recipe(recipe_spec, [*overrides, *NO_DROPOUT, f"fusions={backend}"])
        for side, backend in (("reference", "torch"), ("candidate", fusions))
    }
    setup = Setup(recipes["reference"], workdir)
    try:
        micro = setup.recipe.num_micro_batches
        stream = setup.batches()
        for _ in range(steps * micro):  # the batches the training steps take
            next(stream)
        next_batches = [next(stream) for _ in range(micro)]
        losses, snapshots, states = {}, {}, {}
        for side, recipe in recipes.items():
            step, model, description, optimizer = build_ours(setup, recipe)
            losses[side] = [float(step()) for _ in range(steps)]  # the step leaves its loss unread on the device
            snapshots[side] = _snapshot(model, optimizer)
            states[side] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            shown = ", ".join(f"{x:.6f}" for x in losses[side])
            echo(f"{side} ({description['backends'].split(';')[0]}): losses {shown}")
            del step, model, optimizer
        tensors = compare_tensors(snapshots["reference"], snapshots["candidate"])
        forward = {
            f"{weights} weights, {side} fusions": forward_losses(setup, recipes[side], states[weights], next_batches)
            for weights in recipes
            for side in recipes
        }
    finally:
        setup.close()

    def gap(key: str) -> float:
        base = forward["reference weights, reference fusions"]
        return max(abs(a - b) / abs(b) for a, b in zip(forward[key], base))

    forward_gap, update_gap = gap("reference weights, candidate fusions"), gap("candidate weights, reference fusions")
    by_kind: dict[str, float] = {}
    for row in tensors:
        kind = row["tensor"].split("/", 1)[0]
        by_kind[kind] = max(by_kind.get(kind, 0.0), row["relative"])
    verdict = (
        "the two runs agree"
        if max(forward_gap, update_gap) == 0.0
        else f"mostly the {'forward' if forward_gap >= update_gap else 'update'}: same weights, backends apart by "
        f"{forward_gap:.2e}; candidate's weights under the reference backend apart by {update_gap:.2e}"
    )
    echo(f"next step's micro batches: {verdict}")
    for row in tensors[:3]:
        echo(f"  largest difference: {row['tensor']} {row['max_abs_diff']:.3e} ({row['relative']:.2e} of its max)")
    return {
        "benchmark": "drift",
        "recipe": setup.recipe.name,
        "overrides": list(overrides),
        "device": setup.device_name,
        "precision": setup.precision,
        "reference_fusions": "torch",
        "candidate_fusions": fusions,
        "steps": steps,
        "losses": losses,
        "next_step_forward_losses": forward,
        "forward_gap": forward_gap,
        "update_gap": update_gap,
        "largest_relative_difference_by_kind": by_kind,
        "tensors": tensors[:TOP],
        "verdict": verdict,
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.drift", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="codeparrot-tiny")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--workdir", default="./work")
    parser.add_argument("--fusions", default="triton", help="the candidate's fusions (the reference's are torch)")
    parser.add_argument("--steps", type=int, default=2, help="training steps before the comparison")
    parser.add_argument("--results-dir", default=str(RESULTS), help="where the JSON goes")
    args = parser.parse_args(argv)

    def measured() -> dict:
        result = run(args.recipe, args.overrides, args.workdir, args.fusions, args.steps)
        result["results_file"] = str(write_result(result, results_path("drift", Path(args.results_dir))))
        return result

    return finish(measured)


if __name__ == "__main__":
    sys.exit(main())
