"""Fused-kernel benchmark: achieved GB/s of each Triton fusion (softmax, cross entropy) against the device's
measured copy bandwidth, and speedup over the eager PyTorch reference (backend="torch"), forward and
forward+backward, at GPT shapes (tokens 12*1024, 12 heads of sequence 1024, vocab 32768).

GB/s counts the bytes of the main tensors read plus written once per pass (small vectors such as weights,
biases and per-row statistics are left out), so 100% of copy bandwidth is the bound for a kernel that
reads and writes each element exactly once. Each fusion is first checked against the reference, then timed.

Two times per call: `*_ms` is the wall time of back-to-back calls (what a host-bound loop sees: Python, the
launch and the kernels), `*_device_ms` the time the GPU spent in kernels (torch.profiler's CUDA activity).
Where the wall time is well above the device time, a call is bound by its launch, not by its kernels; the
speedups are given for both.

    python -m bench.kernels [--dtype bf16] [--iters 50] [--results-dir DIR]

On a machine without a CUDA GPU it says so and returns {"skipped": "needs a CUDA GPU"} (exit 0).
`--device cpu` runs the same flow through Triton's interpreter (TRITON_INTERPRET=1, small shapes): a check of
the benchmark itself, whose times say nothing about kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from bench.cli import results_path, write_result
from megatron_core.errors import UserError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CHECK_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@dataclass
class Case:
    """One fusion at one shape: how to call it, its inputs, and how many tensor-sized passes it makes."""

    name: str
    call: Callable[[str, list], torch.Tensor]  # (backend, inputs) -> output
    make_inputs: Callable[[], list]
    pass_bytes: int  # bytes of one pass over the main tensor
    fwd_passes: int
    bwd_passes: int


def _gpt_cases(tokens: int, vocab: int, heads: int, seq: int, dtype: torch.dtype, device: torch.device) -> list[Case]:
    from megatron_core.fusions import cross_entropy, scaled_causal_softmax

    element = torch.tensor([], dtype=dtype).element_size()

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype).requires_grad_()

    batch = tokens // seq
    labels = torch.randint(0, vocab, (tokens,), device=device)
    return [
        Case(
            "softmax",
            lambda b, a: scaled_causal_softmax(a[0], 0.125, backend=b),
            lambda: [randn(batch, heads, seq, seq, scale=4.0)],
            batch * heads * seq * seq * element,
            2,
            3,
        ),
        Case(
            "cross_entropy",
            lambda b, a: cross_entropy(a[0], labels, backend=b),
            lambda: [randn(tokens, vocab, scale=3.0)],
            tokens * vocab * element,
            1,
            2,
        ),
    ]


def _time_ms(step: Callable[[], None], iters: int, device: torch.device) -> float:
    """Wall milliseconds per call of `iters` back-to-back calls, after 3 warm-up calls."""
    for _ in range(3):
        step()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            step()
        return (time.perf_counter() - start) * 1e3 / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _device_ms(step: Callable[[], None], iters: int, device: torch.device) -> tuple[Optional[float], dict]:
    """GPU milliseconds per call spent in kernels, and each kernel's (None, {} off CUDA)."""
    if device.type != "cuda":
        return None, {}
    from torch.profiler import ProfilerActivity, profile

    from bench.profiling import time_table

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    total, table = time_table(prof, iters, "cuda")
    if not table:  # the profiler saw no GPU activity (no CUPTI): unknown, not zero
        return None, {}
    return total, {row["op"]: row["ms_per_call"] for row in table}


def copy_bandwidth_gbps(iters: int, device: torch.device, megabytes: int = 1024) -> float:
    """Read + write GB/s of torch's copy of a large tensor on `device`."""
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    ms = _time_ms(lambda: target.copy_(source), iters, device)
    return 2 * source.numel() / (ms * 1e-3) / 1e9


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.detach().float()
    return ((actual.detach().float() - expected).norm() / expected.norm()).item()


def _check(case: Case, dtype: torch.dtype) -> float:
    """Forward of Triton vs torch on the same inputs."""
    inputs = case.make_inputs()
    ours, theirs = case.call("triton", inputs), case.call("torch", inputs)
    error = _relative_error(ours, theirs)
    if not error <= CHECK_TOLERANCE[dtype]:
        raise RuntimeError(f"{case.name}: Triton differs from the torch reference by {error:.3e}; not timing it")
    return error


def _measure(case: Case, backend: str, iters: int, device: torch.device) -> dict:
    inputs = case.make_inputs()

    def fwd():
        with torch.no_grad():
            case.call(backend, inputs)

    with torch.no_grad():
        grad_out = torch.randn_like(case.call(backend, inputs))

    def fwd_bwd():
        for tensor in inputs:
            tensor.grad = None
        case.call(backend, inputs).backward(grad_out)

    measured = {}
    for phase, step in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        measured[f"{phase}_ms"] = _time_ms(step, iters, device)
        measured[f"{phase}_device_ms"], measured[f"{phase}_kernels"] = _device_ms(step, iters, device)
    return measured


def _ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    return numerator / denominator if numerator is not None and denominator else None


def _phase_entry(ours: dict, eager: dict, phase: str, moved: int, copy_gbps: float) -> dict:
    """One phase's figures: wall and device times of both backends, speedups, Triton's GB/s (by wall time)."""
    ms, device_ms = ours[f"{phase}_ms"], ours[f"{phase}_device_ms"]
    gbps = moved / (ms * 1e-3) / 1e9
    return {
        "triton_ms": ms,
        "torch_ms": eager[f"{phase}_ms"],
        "speedup": eager[f"{phase}_ms"] / ms,
        "triton_GBps": gbps,
        "fraction_of_copy": gbps / copy_gbps,
        "triton_device_ms": device_ms,
        "torch_device_ms": eager[f"{phase}_device_ms"],
        "device_speedup": _ratio(eager[f"{phase}_device_ms"], device_ms),
        "triton_device_fraction_of_copy": _ratio(moved / copy_gbps / 1e6, device_ms),
        "launch_bound": None if device_ms is None else device_ms < 0.5 * ms,
        "triton_kernels": ours[f"{phase}_kernels"],
        "torch_kernels": eager[f"{phase}_kernels"],
    }


def _describe(name: str, entry: dict) -> str:
    line = f"{name}:"
    for phase, label in (("fwd", "fwd"), ("fwd_bwd", "fwd+bwd")):
        e = entry[phase]
        line += f" {label} {e['triton_GBps']:.0f} GB/s ({e['fraction_of_copy']:.0%} of copy, {e['speedup']:.2f}x eager"
        if e["device_speedup"] is not None:
            line += (
                f"; device {e['triton_device_ms']:.3f} vs {e['torch_device_ms']:.3f} ms, "
                f"{e['device_speedup']:.2f}x{', launch-bound' if e['launch_bound'] else ''}"
            )
        line += ");"
    return line.rstrip(";")


def run(
    tokens: int = 12 * 1024,
    vocab: int = 32768,
    heads: int = 12,
    seq: int = 1024,
    dtype: str = "bf16",
    iters: int = 50,
    device: str = "cuda",
    copy_megabytes: int = 1024,
) -> dict:
    if device not in ("cuda", "cpu"):
        raise UserError(f"--device {device!r}: use cuda (the benchmark) or cpu (its check, in Triton's interpreter)")
    if device == "cuda" and not torch.cuda.is_available():
        print("bench.kernels needs a CUDA GPU; none is available here, so nothing was measured")
        return {"skipped": "needs a CUDA GPU"}
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if tokens % seq:
        raise UserError(f"tokens {tokens} must be a multiple of seq {seq} (tokens = micro batch x seq)")
    torch_dtype = DTYPES[dtype]
    from megatron_core.fusions import resolve_backends

    torch_device = torch.device(device)
    resolve_backends("triton", device=torch_device)  # fails here, clearly, if Triton cannot run
    copy_gbps = copy_bandwidth_gbps(iters, torch_device, copy_megabytes)
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s", flush=True)
    results = {}
    for case in _gpt_cases(tokens, vocab, heads, seq, torch_dtype, torch_device):
        check_error = _check(case, torch_dtype)
        ours, eager = _measure(case, "triton", iters, torch_device), _measure(case, "torch", iters, torch_device)
        fwd_bytes = case.pass_bytes * case.fwd_passes
        fwd_bwd_bytes = case.pass_bytes * (case.fwd_passes + case.bwd_passes)
        entry = {"check_rel_error": check_error}
        for phase, moved in (("fwd", fwd_bytes), ("fwd_bwd", fwd_bwd_bytes)):
            entry[phase] = _phase_entry(ours, eager, phase, moved, copy_gbps)
        results[case.name] = entry
        print(_describe(case.name, entry), flush=True)
        del ours, eager
        if torch_device.type == "cuda":
            torch.cuda.empty_cache()
    return {
        "device": torch.cuda.get_device_name() if torch_device.type == "cuda" else "cpu (Triton interpreter)",
        "dtype": dtype,
        "shapes": {"tokens": tokens, "vocab": vocab, "heads": heads, "seq": seq},
        "iters": iters,
        "copy_bandwidth_GBps": copy_gbps,
        "fusions": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=12 * 1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: check the benchmark itself through Triton's interpreter (TRITON_INTERPRET=1)",
    )
    parser.add_argument("--copy-megabytes", type=int, default=1024, help="size of the copy-bandwidth tensor")
    parser.add_argument(
        "--results-dir", type=Path, default=None, help="where the JSON goes (default work/bench-results)"
    )
    args = parser.parse_args(argv)
    results_dir = args.results_dir
    del args.results_dir
    try:
        result = run(**vars(args))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if "skipped" not in result:  # a skip measured nothing, so it leaves no results file
        result["results_file"] = str(write_result(result, results_path("kernels", results_dir)))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
