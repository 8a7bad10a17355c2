"""The GPU path in one device call: every path a GPU user takes, checked in order of risk.

    python -m bench.gpu_check                     # on a GPU node: about 5-7 minutes on one H100/H200
    python -m bench.gpu_check --device cpu        # the same parts on a CPU (CUDA-only parts say skipped)
    python -m bench.gpu_check --only precision    # one part (a second call after a failure)

Parts (each in its own process, under its own time limit; a failing part does not stop the next):
  train-resume   `invoke train --torchrun` (a process group of one: NCCL on a GPU, gloo on a CPU) of the smoke
                 recipe with dropout on, evaluation and saves; run twice from scratch (the run-to-run noise
                 floor: cuDNN/flash kernels need not be bitwise deterministic), then resumed from iteration 10
                 of the first run: iterations 11-20 must match the uninterrupted run within that floor.
  precision      fp16 (the CodeParrot recipes' own precision; CUDA only) and bf16: finite losses on the
                 iterations that stepped, the loss going down, skipped iterations counted.
  recompute      activation recompute none / selective / full: the same losses and grad norms, peak memory
                 of each (CUDA's allocator; none on a CPU).
  layout-8-ranks TP 2 x PP 2 (interleaved, 2 virtual stages) x DP 2 with sequence parallelism and the distributed
                 optimizer, 8 ranks on the one device (gloo carries the bytes; bench/collective_shim.py asserts
                 every collective's tensor is on the training device), against the single process.
  evaluation     the trained checkpoint's perplexity on the device in the recipe's GPU precision against the
                 CPU fp32 path (within 2%), and bench.eval: greedy tokens equal to transformers', generation
                 tokens/s of our KV-cached sampler beside transformers' `generate`.
  kernels-rng    the Triton kernel tests compiled for this GPU, and the RNG-device tests on a host with a
                 visible GPU (CUDA only: on a CPU both run in the test suite).

Writes <results-dir>/gpu-check-<stamp>.json: {device, torch, cuda, parts: [{name, ok, seconds, detail}], ok},
each part's own JSON beside it, and copies them to $OUT when that is set. Exit status 0 only when every part
that ran passed. `tests/test_gpu_check.py` runs it with --device cpu in .ci/run, so it cannot rot between
device loans.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from bench.cli import RESULTS
from megatron_core.launch import free_port
from megatron_core.training.logging import METRICS_FILENAME, read_metrics

ROOT = Path(__file__).resolve().parent.parent
RECIPE = "smoke"
SKIPPED = "skipped"


class PartFailed(AssertionError):
    """A part's check did not hold; the message says which number."""


# ----------------------------------------------------------------------------------------------
# Helpers the parts share
# ----------------------------------------------------------------------------------------------


def _device_overrides(device: str) -> list[str]:
    # On a GPU the user path: `auto` fusions (our Triton kernels where they win). On a CPU the torch ones,
    # so the CPU run compiles nothing.
    return ["training.device=" + device, "training.fusions=" + ("auto" if device == "cuda" else "torch")]


def _run(cmd: list[str], log: Path, timeout: float, env: Optional[dict] = None) -> str:
    """Run a command from the repository root; its output goes to `log` and comes back; non-zero is a failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    with open(log, "a") as handle:
        handle.write("+ " + " ".join(cmd) + "\n")
        handle.flush()
        proc = subprocess.run(
            cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
        )
        handle.write(proc.stdout)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-15:])
        raise PartFailed(f"{' '.join(cmd[:6])} ... exited {proc.returncode}:\n{tail}")
    return proc.stdout


def _invoke_train(workdir: Path, overrides: list[str], log: Path, timeout: float) -> Path:
    """`invoke train --torchrun` of the smoke recipe; returns the run directory."""
    cmd = [
        sys.executable,
        "-m",
        "invoke",
        "train",
        "--recipe",
        RECIPE,
        "--workdir",
        str(workdir),
        "--torchrun",
        "--master-port",
        str(free_port()),
    ]
    for item in overrides:
        cmd += ["--set", item]
    out = _run(cmd, log, timeout)
    lines = [line for line in out.splitlines() if line.startswith("run directory: ")]
    if not lines:
        raise PartFailed("invoke train printed no run directory")
    return Path(lines[-1].split(": ", 1)[1])


def _records(run_dir: Path) -> list[dict]:
    if not (run_dir / METRICS_FILENAME).exists():
        raise PartFailed(f"{run_dir / METRICS_FILENAME} is missing")
    return read_metrics(run_dir)


def _train_records(run_dir: Path) -> list[dict]:
    return [r for r in _records(run_dir) if r.get("type") == "train"]


def _losses(run_dir: Path) -> dict[int, float]:
    """Iteration -> logged loss (log_interval 1) of the iterations that stepped."""
    return {
        r["iteration"]: r["lm_loss"]
        for r in _train_records(run_dir)
        if r.get("lm_loss") is not None and not r.get("skipped")
    }


def _max_rel_diff(a: dict[int, float], b: dict[int, float], iterations) -> float:
    missing = [i for i in iterations if i not in a or i not in b]
    if missing:
        raise PartFailed(f"iterations {missing} have no loss in one of the runs")
    return max(abs(a[i] - b[i]) / max(abs(b[i]), 1e-12) for i in iterations)


def _build_data(workdir: Path, log: Path) -> None:
    # preprocess builds its prerequisites first (corpus, tokenizer)
    _run([sys.executable, "-m", "invoke", "preprocess", "--recipe", RECIPE, "--workdir", str(workdir)], log, 300)


def _train_in_process(workdir: Path, overrides: list[str], run_dir: Path) -> dict:
    """pretrain_gpt.train() on the smoke recipe's data in this process (world 1): the summary, and peak memory."""
    import torch

    from megatron_core import workflow
    from megatron_core.config import load_recipe
    from megatron_core.pretrain_gpt import train

    recipe = load_recipe(RECIPE, overrides)
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resume of an earlier check's
    cuda = recipe.training.device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    summary = train(recipe, run_dir, workflow.data_prefixes(recipe, workdir), workflow.tokenizer_files(recipe, workdir))
    summary["peak_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    summary["records"] = _train_records(run_dir)
    return summary


# ----------------------------------------------------------------------------------------------
# The parts. Each returns its detail dict (with "skipped": why, where it cannot run here) or raises.
# ----------------------------------------------------------------------------------------------


def part_train_resume(device: str, workdir: Path, logs: Path) -> dict:
    overrides = _device_overrides(device) + [
        "model.hidden_dropout=0.1",
        "model.attention_dropout=0.1",
        "training.log_interval=1",
        "training.save_interval=10",
    ]
    log = logs / "train-resume.log"
    shutil.rmtree(workdir / RECIPE / "runs", ignore_errors=True)  # fresh runs, whatever an earlier check left
    first = _invoke_train(workdir, overrides, log, 240)
    runs = {}
    for name in ("uninterrupted", "again"):
        run_dir = first if name == "uninterrupted" else _invoke_train(workdir, overrides, log, 240)
        ckpt = run_dir / "checkpoints"
        for it in (10, 20):
            if not (ckpt / f"iter_{it:07d}").is_dir():
                raise PartFailed(f"{name} run: no checkpoint at iteration {it} in {ckpt}")
        if not any(r.get("type") == "valid" for r in _records(run_dir)):
            raise PartFailed(f"{name} run: no validation record in metrics.jsonl")
        kept = run_dir.with_name(run_dir.name + "." + name)
        shutil.rmtree(kept, ignore_errors=True)
        run_dir.rename(kept)
        runs[name] = _losses(kept)
    # The resumed run: the uninterrupted run's checkpoints up to iteration 10, in a run directory of its own.
    resumed_ckpt = first / "checkpoints"
    shutil.copytree(first.with_name(first.name + ".uninterrupted") / "checkpoints", resumed_ckpt)
    shutil.rmtree(resumed_ckpt / "iter_0000020")
    (resumed_ckpt / "latest_checkpointed_iteration.txt").write_text("10")
    _invoke_train(workdir, overrides, log, 240)
    resumed = _losses(first)
    if min(resumed, default=0) != 11:
        raise PartFailed(
            f"the resumed run logged iterations {sorted(resumed)}, expected 11..20 (it did not resume "
            "from iteration 10)"
        )
    steps = range(1, 21)
    floor = _max_rel_diff(runs["again"], runs["uninterrupted"], steps)
    resume_diff = _max_rel_diff(resumed, runs["uninterrupted"], range(11, 21))
    # Within twice the floor, and never tighter than 1e-5: a resumed process allocates its buffers in another
    # order than an uninterrupted one, and GEMM kernels that pick their path by alignment then differ in the
    # last bits (seen on a CPU: 1.1e-6 after resume while two fresh runs agreed exactly).
    tolerance = max(2 * floor, 1e-5)
    detail = {
        "noise_floor_rel": floor,
        "resume_max_rel_diff": resume_diff,
        "tolerance": tolerance,
        "losses": {"uninterrupted": runs["uninterrupted"], "again": runs["again"], "resumed": resumed},
    }
    if not all(math.isfinite(x) for x in runs["uninterrupted"].values()):
        raise PartFailed(f"non-finite losses: {runs['uninterrupted']}")
    if resume_diff > tolerance:
        raise PartFailed(
            f"resumed losses differ from the uninterrupted run by {resume_diff:.3g} relative "
            f"(noise floor {floor:.3g}): {json.dumps(detail)}"
        )
    return detail


def part_precision(device: str, workdir: Path, logs: Path) -> dict:  # noqa: ARG001 - every part's signature
    detail = {}
    for precision in ("fp16", "bf16"):
        if precision == "fp16" and device != "cuda":
            detail[precision] = {SKIPPED: "fp16 trains on CUDA only (the recipe check refuses it on a CPU)"}
            continue
        # fp16 runs 40 iterations: at 2^32 with hysteresis 2 about the first 16 are skipped
        flags = (
            ["training.fp16=true", "training.bf16=false", "training.train_iters=40"]
            if precision == "fp16"
            else ["training.fp16=false", "training.bf16=true"]
        )
        # fp16 at the recipes' own loss-scale settings (2^32, hysteresis 2): the first iterations are skipped.
        summary = _train_in_process(
            workdir, _device_overrides(device) + flags + ["training.log_interval=1"], workdir / f"precision-{precision}"
        )
        stepped = [r["lm_loss"] for r in summary["records"] if not r.get("skipped")]
        skipped_logged = sum(int(r.get("skipped") or 0) for r in summary["records"])
        row = {
            "losses": stepped,
            "skipped_iterations": summary["skipped_iterations"],
            "skipped_in_log": skipped_logged,
            "peak_memory_mb": summary["peak_memory_mb"],
        }
        detail[precision] = row
        if len(stepped) < 6 or not all(x is not None and math.isfinite(x) for x in stepped):
            raise PartFailed(f"{precision}: the iterations that stepped logged {stepped}")
        if sum(stepped[-3:]) >= sum(stepped[:3]):
            raise PartFailed(f"{precision}: the loss did not go down: {stepped}")
        if skipped_logged != summary["skipped_iterations"]:
            raise PartFailed(
                f"{precision}: {summary['skipped_iterations']} skipped iterations, {skipped_logged} in the log"
            )
    return detail


def part_recompute(device: str, workdir: Path, logs: Path) -> dict:  # noqa: ARG001
    detail, reference = {}, None
    for granularity in ("none", "selective", "full"):
        flags = _device_overrides(device) + [
            "model.hidden_dropout=0.1",
            "model.attention_dropout=0.1",
            "training.log_interval=1",
            "training.train_iters=6",
            "training.save_interval=null",
        ]
        if granularity != "none":
            flags.append(f"parallel.recompute_granularity={granularity}")
        summary = _train_in_process(workdir, flags, workdir / f"recompute-{granularity}")
        seen = [(r["lm_loss"], r["grad_norm"]) for r in summary["records"]]
        detail[granularity] = {"loss_and_grad_norm": seen, "peak_memory_mb": summary["peak_memory_mb"]}
        if reference is None:
            reference = seen
            continue
        for (loss, norm), (want_loss, want_norm) in zip(seen, reference):
            if abs(loss - want_loss) > 1e-5 * abs(want_loss) or abs(norm - want_norm) > 1e-4 * abs(want_norm):
                raise PartFailed(
                    f"recompute {granularity}: (loss, grad norm) {seen} against no recompute's {reference}"
                )
    return detail


def part_layout_8_ranks(device: str, workdir: Path, logs: Path) -> dict:
    from megatron_core import workflow
    from megatron_core.config import load_recipe
    from megatron_core.launch import torchrun_command

    # micro batch 2: DP 2 then leaves 2 micro batches per iteration, a multiple of PP 2 (the interleaved schedule)
    common = _device_overrides(device) + [
        "model.num_layers=4",
        "training.micro_batch_size=2",
        "training.log_interval=1",
        "training.train_iters=4",
        "training.save_interval=null",
        "training.eval_iters=0",
    ]
    layout = [
        "parallel.tensor_model_parallel_size=2",
        "parallel.pipeline_model_parallel_size=2",
        "parallel.num_layers_per_virtual_pipeline_stage=1",
        "parallel.sequence_parallel=true",
        "parallel.use_distributed_optimizer=true",
    ]
    single = _train_in_process(workdir, common, workdir / "layout-single")
    recipe = load_recipe(RECIPE, common + layout + ["parallel.world_size=8"])
    vocab, merges = workflow.tokenizer_files(recipe, workdir)
    run_dir, report = workdir / "layout-8", workdir / "layout-8-collectives"
    cmd = torchrun_command(
        RECIPE,
        common + layout,
        8,
        master_port=free_port(),
        extra_args=[
            "--run-dir",
            str(run_dir),
            "--vocab-file",
            str(vocab),
            "--merge-file",
            str(merges),
            "--data-path",
            *[str(p) for p in workflow.data_prefixes(recipe, workdir)],
        ],
    )
    at = cmd.index("megatron_core.pretrain_gpt") - 1  # its "-m": run it under the shim instead
    cmd[at : at + 2] = [
        "-m",
        "bench.collective_shim",
        "--expect-device",
        device,
        "--report",
        str(report),
        "megatron_core.pretrain_gpt",
    ]
    _run(cmd, logs / "layout-8-ranks.log", 300, env={"MEGATRON_DISTRIBUTED_BACKEND": "gloo"})
    calls: dict[str, int] = {}
    for path in sorted(report.glob("collectives-rank*.json")):
        for op, n in json.loads(path.read_text())["calls"].items():
            calls[op] = calls.get(op, 0) + n
    ranks = len(list(report.glob("collectives-rank*.json")))
    want = {r["iteration"]: r["lm_loss"] for r in single["records"]}
    got = _losses(run_dir)
    diff = _max_rel_diff(got, want, sorted(want))
    detail = {
        "ranks_reporting": ranks,
        "collective_calls": calls,
        "max_rel_loss_diff": diff,
        "losses": {"single": want, "tp2_pp2_vpp2_dp2_sp_distopt": got},
    }
    # every kind of collective the layout uses reached the shim (a shim that saw nothing proves nothing)
    needed = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "batch_isend_irecv")
    if ranks != 8 or any(calls.get(op, 0) == 0 for op in needed):
        raise PartFailed(f"the collective shim saw {calls} from {ranks} ranks; expected all 8 and each of {needed}")
    if diff > 1e-4:
        raise PartFailed(f"8-rank losses differ from the single process by {diff:.3g} relative: {detail['losses']}")
    return detail


def part_evaluation(device: str, workdir: Path, logs: Path, results_dir: Path) -> dict:  # noqa: ARG001
    from bench import eval as bench_eval
    from megatron_core.config import load_recipe
    from megatron_core.evaluate import evaluate

    ckpt = next(iter(sorted(workdir.glob(f"{RECIPE}/runs/*.uninterrupted/checkpoints"))), None)
    if ckpt is None:
        raise PartFailed("no checkpoint of the train-resume part to evaluate")
    recipe = load_recipe(RECIPE, _device_overrides(device))
    per_place = {}
    places = [("cpu", "fp32")] + ([("cuda", "bf16")] if device == "cuda" else [])
    for where, dtype in places:
        results = evaluate(
            recipe,
            str(ckpt),
            workdir=str(workdir),
            out_dir=str(workdir / f"eval-{where}"),
            humaneval=False,
            device=where,
            dtype=dtype,
        )
        per_place[f"{where}-{dtype}"] = {split: r["ppl"] for split, r in results["perplexity"].items()}
    detail = {"perplexity": per_place}
    if device == "cuda":
        for split, cpu_ppl in per_place["cpu-fp32"].items():
            gpu_ppl = per_place["cuda-bf16"][split]
            if abs(gpu_ppl - cpu_ppl) > 0.02 * cpu_ppl:
                raise PartFailed(
                    f"{split} perplexity on the GPU (bf16) {gpu_ppl:.4g} against the CPU fp32 path "
                    f"{cpu_ppl:.4g}: more than 2% apart"
                )
    size = (
        dict(problems=2, samples=16, batch=16, max_new_tokens=128, repeats=2)
        if device == "cuda"
        else dict(problems=1, samples=2, batch=2, max_new_tokens=8, repeats=1)
    )
    generation = bench_eval.run(
        **size,
        vocab_size=2048 if device == "cpu" else 8192,
        device=device,
        echo=lambda *_: None,
        results_dir=results_dir,
    )  # raises if greedy tokens differ
    detail["generation"] = {
        k: generation[k]
        for k in (
            "device",
            "dtype",
            "ours_tokens_per_s",
            "baseline_tokens_per_s",
            "ratio",
            "greedy_check",
            "results_file",
        )
    }
    return detail


def part_kernels_rng(device: str, workdir: Path, logs: Path) -> dict:  # noqa: ARG001
    if device != "cuda":
        return {SKIPPED: "CUDA only: on a CPU the kernel tests (Triton's interpreter) and the RNG tests run in .ci/run"}
    out = _run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_fusions_triton.py",
            "tests/test_fusions_reference.py",
            "tests/test_rng_device.py",
            "--deselect",
            "tests/test_fusions_reference.py::test_vocab_parallel_cross_entropy_on_two_gloo_ranks",
        ],
        logs / "kernels-rng.log",
        240,
        env={"MEGATRON_FUSIONS_TEST_MODE": "compiled"},
    )
    summary = out.strip().splitlines()[-1]
    if "skipped" in summary or "passed" not in summary:  # a test that did not run on this GPU proves nothing
        raise PartFailed(f"not every kernel or RNG test ran on the GPU: {summary}")
    return {"pytest": summary}


PARTS: dict[str, tuple[Callable, float]] = {  # name -> (function, seconds it may take on one GPU)
    "train-resume": (part_train_resume, 150),
    "precision": (part_precision, 60),
    "recompute": (part_recompute, 60),
    "layout-8-ranks": (part_layout_8_ranks, 120),
    "evaluation": (part_evaluation, 90),
    "kernels-rng": (part_kernels_rng, 120),
}


# ----------------------------------------------------------------------------------------------
# Driver: each part in a child process (a crash or hang costs that part only)
# ----------------------------------------------------------------------------------------------


def _run_part(name: str, device: str, workdir: Path, results_dir: Path, out_json: Path) -> None:
    """Child: run one part, write {ok, detail} to out_json."""
    fn, _ = PARTS[name]
    logs = results_dir / "logs"
    try:
        args = (device, workdir, logs) + ((results_dir,) if name == "evaluation" else ())
        detail, ok = fn(*args), True
    except PartFailed as exc:
        detail, ok = {"error": str(exc)}, False
    out_json.write_text(json.dumps({"ok": ok, "detail": detail}, default=str))


def _environment(device: str) -> dict:
    import torch

    cuda = device == "cuda"
    return {
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
    }


def run(
    device: str, workdir: Path, results_dir: Path, only: Optional[list[str]] = None, scale: float = 1.0, echo=print
) -> dict:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    results_dir.mkdir(parents=True, exist_ok=True)
    logs = results_dir / "logs"
    logs.mkdir(exist_ok=True)
    _build_data(workdir, logs / "data.log")
    parts = []
    for name, (_, limit) in PARTS.items():
        if only and name not in only:
            continue
        echo(f"== {name} (limit {limit * scale:.0f} s)")
        start = time.time()
        out_json = workdir / f"part-{name}.json"
        out_json.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "bench.gpu_check",
            "--part",
            name,
            "--device",
            device,
            "--workdir",
            str(workdir),
            "--results-dir",
            str(results_dir),
            "--part-json",
            str(out_json),
        ]
        try:
            proc = subprocess.run(
                cmd,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                timeout=limit * scale,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            (logs / f"part-{name}.log").write_text(proc.stdout)
            result = (
                json.loads(out_json.read_text())
                if out_json.exists()
                else {
                    "ok": False,
                    "detail": {"error": f"exited {proc.returncode}: " + "\n".join(proc.stdout.splitlines()[-15:])},
                }
            )
        except subprocess.TimeoutExpired:
            result = {"ok": False, "detail": {"error": f"ran past its limit of {limit * scale:.0f} s"}}
        skipped = isinstance(result["detail"], dict) and SKIPPED in result["detail"]
        row = {
            "name": name,
            "ok": result["ok"],
            "skipped": skipped,
            "seconds": round(time.time() - start, 1),
            "detail": result["detail"],
        }
        parts.append(row)
        part_file = results_dir / f"gpu-check-{stamp}-{name}.json"
        part_file.write_text(json.dumps(row, indent=2, default=str) + "\n")
        echo(
            f"== {name}: {'skipped' if skipped else 'ok' if row['ok'] else 'FAILED'} after {row['seconds']} s"
            + ("" if row["ok"] else f"\n{row['detail'].get('error', '')}")
        )
    # On a GPU every part must run: a skip there is a gap in the proof, not a pass.
    ok = all(p["ok"] and not (device == "cuda" and p["skipped"]) for p in parts)
    summary = {**_environment(device), "parts": parts, "ok": ok}
    path = results_dir / f"gpu-check-{stamp}.json"
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    summary["results_file"] = str(path)
    out = os.environ.get("OUT")
    if out:
        for item in results_dir.glob(f"gpu-check-{stamp}*.json"):
            shutil.copy(item, out)
        shutil.copytree(logs, Path(out) / "logs", dirs_exist_ok=True)
    return summary


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default=os.environ.get("DEVICE", "auto"))
    parser.add_argument("--workdir", help="scratch directory (default: a fresh one under /tmp)")
    parser.add_argument(
        "--results-dir",
        default=str(RESULTS),
        help="where the JSON and logs go (default "
        "work/bench-results; a device run's are copied to $OUT too, to commit under bench/results/)",
    )
    parser.add_argument("--only", nargs="+", choices=sorted(PARTS), help="run only these parts")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply every part's time limit")
    parser.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)  # the child's job
    parser.add_argument("--part-json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and os.environ.get("TRITON_INTERPRET"):
        print("error: TRITON_INTERPRET is set; this check compiles the kernels for the GPU, unset it", file=sys.stderr)
        return 2
    import tempfile

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="gpu-check-"))
    if args.part:
        _run_part(args.part, device, workdir, Path(args.results_dir), Path(args.part_json))
        return 0
    summary = run(device, workdir, Path(args.results_dir), args.only, args.time_scale)
    print(json.dumps({k: summary[k] for k in ("device", "ok", "results_file")}))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
