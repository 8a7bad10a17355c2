"""Compile every Triton kernel ahead of time for real GPUs, on any machine: no GPU or driver needed.

    python -m megatron_core.fusions.aot --arch sm_80,sm_90 --json > triton-aot.json

For each architecture, each of fp32/fp16/bf16 and each shape set (CodeParrot-small's, and an awkward one
whose sizes are not powers of two), every forward and backward kernel of the scaled causal softmax and the
cross entropy is compiled with `triton.compile(ASTSource(...), target=GPUTarget("cuda", capability, 32))`,
down to a cubin by Triton's bundled ptxas, whose `-v` report gives the registers per thread and the spill
bytes.

Nothing here restates a kernel's arguments or block sizes: each launcher's `_<op>(..., launch)` (see
triton_kernels/_common.py) is called with meta tensors of the shapes below and a recorder for `launch`, so
the recorded `Launch` holds exactly the grid, arguments, constexpr block sizes and num_warps the run-time
launch would use; the signature, constexprs and alignment attributes are then derived from those arguments
by Triton's own launch-time specialisation (the binder `JITFunction.run` uses), for the target's backend.

A progress line per kernel goes to stderr; with --json the result list is printed last, on stdout, as one
JSON list of {"kernel", "arch", "dtype", "ok", "registers", "spills", ...}. "spills" is the bytes of spill
stores ptxas reports. Exit status 1 when any kernel fails to compile or spills.

Compiled kernels are cached in Triton's cache (TRITON_CACHE_DIR, default ~/.triton/cache), with ptxas'
report stored beside each cubin, so a second run only re-reads them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import time
from dataclasses import dataclass

import torch

from megatron_core.errors import UserError


@dataclass(frozen=True)
class Shapes:
    """A GPT micro-batch: `heads` attention score matrices of seq x seq per sample, and tokens = batch * seq
    rows of logits over the (padded) vocab."""

    name: str
    batch: int
    seq: int
    heads: int
    vocab: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


CODEPARROT_SMALL = Shapes("codeparrot-small", batch=12, seq=1024, heads=12, vocab=32768)
AWKWARD = Shapes("awkward", batch=3, seq=37, heads=5, vocab=9000)
SHAPES = {shapes.name: shapes for shapes in (CODEPARROT_SMALL, AWKWARD)}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
FUSIONS = ("softmax", "cross_entropy")
ARCHITECTURES = (80, 90)  # A100, H100/H200


def parse_arch(text: str) -> int:
    match = re.fullmatch(r"sm_?(\d+)a?", text.strip())
    if not match:
        raise UserError(f"--arch {text!r}: name architectures like sm_80 or sm_90")
    capability = int(match.group(1))
    if capability not in ARCHITECTURES:
        raise UserError(f"--arch {text}: known architectures are {', '.join(f'sm_{c}' for c in ARCHITECTURES)}")
    return capability


def _kernel_modules():
    """The kernel modules (they import triton)."""
    # Lazy, as triton itself below: importing this module (for SHAPES or ptxas_figures) must not import triton,
    # which would fix the interpreter mode of the importing process (see fusions/backends.py).
    from megatron_core.fusions.triton_kernels import cross_entropy, softmax

    return softmax, cross_entropy


def recorded_launches(fusion: str, shapes: Shapes, dtype: torch.dtype):
    """[(kernel label, Launch)] of `fusion`'s forward and backward at `shapes`, as the launchers build them
    (on meta tensors: nothing is allocated, nothing runs)."""
    softmax, cross_entropy = _kernel_modules()
    recorded = []

    def recorder(label):
        return lambda launch: recorded.append((label, launch))

    def meta(*shape, dtype=dtype):
        return torch.empty(shape, dtype=dtype, device="meta")

    if fusion == "softmax":
        scores = meta(shapes.batch, shapes.heads, shapes.seq, shapes.seq)
        probs = softmax._causal_softmax_fwd(scores, 0.125, recorder("softmax_fwd"))
        softmax._causal_softmax_bwd(torch.empty_like(probs), probs, 0.125, recorder("softmax_bwd"))
    elif fusion == "cross_entropy":
        logits, labels = meta(shapes.tokens, shapes.vocab), meta(shapes.tokens, dtype=torch.int64)
        row_max, _, _ = cross_entropy._cross_entropy_fwd(logits, labels, 0, recorder("cross_entropy_fwd"))
        # backward takes the fp32 [rows] log-sum-exp and incoming gradient, shaped like the row statistics
        cross_entropy._cross_entropy_bwd(
            logits, labels, torch.empty_like(row_max), torch.empty_like(row_max), 0, recorder("cross_entropy_bwd")
        )
    else:
        raise UserError(f"unknown fusion {fusion!r}; known: {', '.join(FUSIONS)}")
    return recorded


_PTXAS_REPORT = "ptxas-v.log"  # stored beside the cubin in Triton's cache


def ptxas_figures(report: str) -> dict:
    """Registers, spill stores/loads and stack frame bytes from ptxas' -v report of one kernel."""
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    stack = re.search(r"(\d+) bytes stack frame", report)
    if not (registers and spills and stack):
        raise RuntimeError(f"could not read registers and spills from ptxas' report:\n{report}")
    return {
        "registers": int(registers.group(1)),
        "spills": int(spills.group(1)),
        "spill_loads": int(spills.group(2)),
        "stack_bytes": int(stack.group(1)),
    }


def compile_launch(launch, capability: int):
    """Compile `launch`'s kernel for sm_<capability> as the launch would specialise it; returns the
    CompiledKernel and ptxas' -v report."""
    import triton  # lazy: see _kernel_modules
    from triton import knobs
    from triton.compiler import ASTSource
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import get_cache_manager
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    # What JITFunction.run does before binding (triton 3.x), so the options and the cache key match a launch.
    kwargs = {
        **launch.constexprs,
        "num_warps": launch.num_warps,
        "debug": kernel.debug or knobs.runtime.debug,
        "instrumentation_mode": knobs.compilation.instrumentation_mode,
        "fpsan_homomorphic_casts": knobs.compilation.fpsan_homomorphic_casts,
    }
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    source = ASTSource(kernel, signature, constexprs, attrs)

    def build(always: bool):
        with knobs.nvidia.scope(), knobs.compilation.scope():
            knobs.nvidia.dump_ptxas_log = True  # ptxas' -v report, printed when ptxas runs
            knobs.compilation.always_compile = always
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                compiled = triton.compile(source, target=target, options=options.__dict__)
        return compiled, printed.getvalue()

    compiled, report = build(always=False)
    cache = get_cache_manager(compiled.hash)
    if "Used " in report:
        cache.put(report, _PTXAS_REPORT, binary=False)
    else:  # a cache hit: the report stored with it, or (cached by a plain launch) compile once more to get one
        stored = cache.get_file(_PTXAS_REPORT)
        if stored is not None:
            with open(stored) as handle:
                report = handle.read()
        else:
            compiled, report = build(always=True)
            cache.put(report, _PTXAS_REPORT, binary=False)
    return compiled, report


def _short(value) -> str:
    return str(value).replace(" ", "")


def compile_all(capabilities, dtype_names, shape_names, fusions, progress=None) -> list[dict]:
    if os.environ.get("TRITON_INTERPRET") == "1":  # @triton.jit then makes interpreted functions: no compiling
        raise UserError(
            "TRITON_INTERPRET=1 is set: Triton's interpreter replaces compilation, so nothing could be "
            "compiled; unset it for this command"
        )
    progress = progress or sys.stderr
    jobs = []
    for capability in capabilities:
        for shape_name in shape_names:
            for dtype_name in dtype_names:
                for fusion in fusions:
                    for label, launch in recorded_launches(fusion, SHAPES[shape_name], DTYPES[dtype_name]):
                        jobs.append((capability, shape_name, dtype_name, label, launch))
    results = []
    for index, (capability, shape_name, dtype_name, label, launch) in enumerate(jobs, 1):
        entry = {
            "kernel": label,
            "arch": f"sm_{capability}",
            "dtype": dtype_name,
            "shapes": shape_name,
            "triton_kernel": launch.name,
            "num_warps": launch.num_warps,
            "constexprs": {key: value for key, value in launch.constexprs.items()},
        }
        start = time.perf_counter()
        try:
            _, report = compile_launch(launch, capability)
            entry.update(ptxas_figures(report))
            entry["ok"] = entry["spills"] == 0
            if entry["spills"]:
                entry["error"] = f"{entry['spills']} bytes of register spills"
        except Exception as exc:  # report every failure, then exit non-zero
            entry.update(ok=False, registers=None, spills=None, error=f"{type(exc).__name__}: {exc}"[:2000])
        entry["seconds"] = round(time.perf_counter() - start, 2)
        results.append(entry)
        figures = (
            f"{entry['registers']} registers, {entry['spills']} spill bytes"
            if entry["registers"] is not None
            else entry["error"].splitlines()[0]
        )
        print(
            f"[{index:3d}/{len(jobs)}] {entry['arch']} {dtype_name:4s} {shape_name:16s} {label:26s} "
            f"{'ok  ' if entry['ok'] else 'FAIL'} {figures}; {launch.num_warps} warps "
            f"{_short(entry['constexprs'])} ({entry['seconds']:.1f} s)",
            file=progress,
            flush=True,
        )
    return results


def _names(text: str, known, what: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise UserError(f"--{what} {text!r}: choose from {', '.join(known)}")
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_core.fusions.aot", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_80,sm_90", help="comma-separated, e.g. sm_80,sm_90")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="subset of fp32,fp16,bf16")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"subset of {','.join(SHAPES)}")
    parser.add_argument("--fusions", default=",".join(FUSIONS), help=f"subset of {','.join(FUSIONS)}")
    parser.add_argument("--json", action="store_true", help="print the result list as JSON, last, on stdout")
    args = parser.parse_args(argv)
    try:
        capabilities = [parse_arch(arch) for arch in args.arch.split(",") if arch.strip()]
        results = compile_all(
            capabilities,
            _names(args.dtypes, DTYPES, "dtypes"),
            _names(args.shapes, SHAPES, "shapes"),
            _names(args.fusions, FUSIONS, "fusions"),
        )
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    failed = [entry for entry in results if not entry["ok"]]
    print(
        f"{len(results) - len(failed)}/{len(results)} kernels compiled without spills"
        + (
            f"; FAILED: {', '.join(sorted({e['kernel'] + ' ' + e['arch'] + ' ' + e['dtype'] for e in failed}))}"
            if failed
            else ""
        ),
        file=sys.stderr,
    )
    if args.json:
        print(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
