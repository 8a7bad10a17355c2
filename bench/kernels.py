"""Fused-kernel benchmark: achieved GB/s of each Triton fusion against the device's measured copy bandwidth,
and speedup over the eager PyTorch reference (backend="torch"), forward and forward+backward, at GPT
shapes (tokens 12*1024, hidden 768, 12 heads of sequence 1024, vocab 32768).

GB/s counts the bytes of the main tensors read plus written once per pass (small vectors such as weights,
biases and per-row statistics are left out), so 100% of copy bandwidth is the bound for a kernel that
reads and writes each element exactly once. Each fusion is first checked against the reference, then timed.

    python -m bench.kernels [--dtype bf16] [--iters 50]

On a machine without a CUDA GPU it says so and returns {"skipped": "needs a CUDA GPU"} (exit 0).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Callable

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


def _gpt_cases(tokens: int, hidden: int, vocab: int, heads: int, seq: int, dtype: torch.dtype) -> list[Case]:
    from megatron_core.fusions import bias_dropout_add, bias_gelu, cross_entropy, layer_norm, scaled_causal_softmax

    device = torch.device("cuda")
    element = torch.tensor([], dtype=dtype).element_size()

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype).requires_grad_()

    batch = tokens // seq
    labels = torch.randint(0, vocab, (tokens,), device=device)
    return [
        Case("layer_norm", lambda b, a: layer_norm(*a, eps=1e-5, backend=b),
             lambda: [randn(tokens, hidden), randn(hidden), randn(hidden)], tokens * hidden * element, 2, 3),
        Case("bias_gelu", lambda b, a: bias_gelu(*a, backend=b),
             lambda: [randn(tokens, 4 * hidden), randn(4 * hidden)], tokens * 4 * hidden * element, 2, 3),
        Case("bias_dropout_add",
             lambda b, a: bias_dropout_add(a[0], a[1], a[2], 0.1, True, generator_seed=1234, backend=b),
             lambda: [randn(tokens, hidden), randn(hidden), randn(tokens, hidden)], tokens * hidden * element, 3, 2),
        Case("softmax", lambda b, a: scaled_causal_softmax(a[0], 0.125, backend=b),
             lambda: [randn(batch, heads, seq, seq, scale=4.0)], batch * heads * seq * seq * element, 2, 3),
        Case("cross_entropy", lambda b, a: cross_entropy(a[0], labels, backend=b),
             lambda: [randn(tokens, vocab, scale=3.0)], tokens * vocab * element, 1, 2),
    ]


def _time_ms(step: Callable[[], None], iters: int) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def copy_bandwidth_gbps(iters: int, megabytes: int = 1024) -> float:
    """Read + write GB/s of torch's device-to-device copy of a large tensor."""
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    ms = _time_ms(lambda: target.copy_(source), iters)
    return 2 * source.numel() / (ms * 1e-3) / 1e9


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.detach().float()
    return ((actual.detach().float() - expected).norm() / expected.norm()).item()


def _check(case: Case, dtype: torch.dtype) -> float:
    """Forward of Triton vs torch on the same inputs (dropout: both seeded, so compare only the eval path)."""
    inputs = case.make_inputs()
    if case.name == "bias_dropout_add":
        from megatron_core.fusions import bias_dropout_add

        ours = bias_dropout_add(*inputs, 0.1, False, backend="triton")
        theirs = bias_dropout_add(*inputs, 0.1, False, backend="torch")
    else:
        ours, theirs = case.call("triton", inputs), case.call("torch", inputs)
    error = _relative_error(ours, theirs)
    if not error <= CHECK_TOLERANCE[dtype]:
        raise RuntimeError(f"{case.name}: Triton differs from the torch reference by {error:.3e}; not timing it")
    return error


def _measure(case: Case, backend: str, iters: int) -> dict:
    inputs = case.make_inputs()
    with torch.no_grad():
        fwd_ms = _time_ms(lambda: case.call(backend, inputs), iters)
    with torch.no_grad():
        grad_out = torch.randn_like(case.call(backend, inputs))

    def fwd_bwd():
        for tensor in inputs:
            tensor.grad = None
        case.call(backend, inputs).backward(grad_out)

    return {"fwd_ms": fwd_ms, "fwd_bwd_ms": _time_ms(fwd_bwd, iters)}


def run(tokens: int = 12 * 1024, hidden: int = 768, vocab: int = 32768, heads: int = 12, seq: int = 1024,
        dtype: str = "bf16", iters: int = 50) -> dict:
    if not torch.cuda.is_available():
        print("bench.kernels needs a CUDA GPU; none is available here, so nothing was measured")
        return {"skipped": "needs a CUDA GPU"}
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if tokens % seq:
        raise UserError(f"tokens {tokens} must be a multiple of seq {seq} (tokens = micro batch x seq)")
    torch_dtype = DTYPES[dtype]
    from megatron_core.fusions import resolve_backends

    backends = resolve_backends("triton", device="cuda")  # fails here, clearly, if Triton cannot run
    print(backends.describe(), flush=True)
    copy_gbps = copy_bandwidth_gbps(iters)
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s", flush=True)
    results = {}
    for case in _gpt_cases(tokens, hidden, vocab, heads, seq, torch_dtype):
        check_error = _check(case, torch_dtype)
        ours, eager = _measure(case, "triton", iters), _measure(case, "torch", iters)
        fwd_bytes = case.pass_bytes * case.fwd_passes
        fwd_bwd_bytes = case.pass_bytes * (case.fwd_passes + case.bwd_passes)
        entry = {"check_rel_error": check_error}
        for phase, moved in (("fwd", fwd_bytes), ("fwd_bwd", fwd_bwd_bytes)):
            ms = ours[f"{phase}_ms"]
            gbps = moved / (ms * 1e-3) / 1e9
            entry[phase] = {"triton_ms": ms, "torch_ms": eager[f"{phase}_ms"], "speedup": eager[f"{phase}_ms"] / ms,
                            "triton_GBps": gbps, "fraction_of_copy": gbps / copy_gbps}
        results[case.name] = entry
        print(f"{case.name}: fwd {entry['fwd']['triton_GBps']:.0f} GB/s ({entry['fwd']['fraction_of_copy']:.0%} "
              f"of copy, {entry['fwd']['speedup']:.2f}x eager); fwd+bwd {entry['fwd_bwd']['triton_GBps']:.0f} GB/s "
              f"({entry['fwd_bwd']['fraction_of_copy']:.0%}, {entry['fwd_bwd']['speedup']:.2f}x)", flush=True)
        del ours, eager
        torch.cuda.empty_cache()
    return {
        "device": torch.cuda.get_device_name(),
        "dtype": dtype,
        "shapes": {"tokens": tokens, "hidden": hidden, "vocab": vocab, "heads": heads, "seq": seq},
        "iters": iters,
        "copy_bandwidth_GBps": copy_gbps,
        "fusions": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=12 * 1024)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)
    try:
        result = run(**vars(args))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if "skipped" not in result:  # a skip measured nothing, so it leaves no results file
        result["results_file"] = str(write_result(result, results_path("kernels")))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
