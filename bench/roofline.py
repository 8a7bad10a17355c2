"""The matmul roofline of a training step: this machine's GEMM throughput at the model's own shapes.

A GPT step's FLOPs (Megatron's formula, training/flops.py) are its matrix multiplies: per layer QKV
[T,h]x[h,3h], the attention output [T,h]x[h,h], MLP in [T,h]x[h,F] and out [T,F]x[F,h], the attention
scores and context (batched over b*heads, [s,d]x[d,s] and [s,s]x[s,d]), and the logits [T,h]x[h,V],
with T = micro batch x seq tokens; backward runs each twice more (input and weight gradients).
Timing exactly those GEMMs, in the model's dtype on its device, gives the time a step would take
if everything else cost nothing; `fraction_of_gemm` = that time / the measured step time =
achieved model FLOP/s / measured matmul FLOP/s. On a GPU the same number says how close to the
hardware the step runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Gemm:
    name: str
    batch: int  # independent products (b*heads for attention, 1 otherwise)
    m: int
    k: int
    n: int
    count: int  # how many per micro batch (num_layers for a layer's GEMM)

    @property
    def flops(self) -> float:
        """Forward + input gradient + weight (or other operand) gradient: three products of 2mkn."""
        return 3 * 2.0 * self.batch * self.m * self.k * self.n * self.count


def model_gemms(
    *,
    micro_batch_size: int,
    seq_length: int,
    num_layers: int,
    hidden_size: int,
    ffn_hidden_size: int,
    num_attention_heads: int,
    padded_vocab_size: int,
) -> list[Gemm]:
    b, s, L, h, f, v = micro_batch_size, seq_length, num_layers, hidden_size, ffn_hidden_size, padded_vocab_size
    t, heads, d = b * s, num_attention_heads, hidden_size // num_attention_heads
    return [
        Gemm("qkv", 1, t, h, 3 * h, L),
        Gemm("attention scores", b * heads, s, d, s, L),
        Gemm("attention context", b * heads, s, s, d, L),
        Gemm("attention output", 1, t, h, h, L),
        Gemm("mlp in", 1, t, h, f, L),
        Gemm("mlp out", 1, t, f, h, L),
        Gemm("logits", 1, t, h, v, 1),
    ]


def _time_gemm(gemm: Gemm, dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    """Seconds for one forward + two backward products of this shape (best of `repeats`)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(gemm.batch, gemm.m, gemm.k, generator=gen).to(device, dtype)
    w = torch.randn(gemm.batch, gemm.k, gemm.n, generator=gen).to(device, dtype)
    g = torch.randn(gemm.batch, gemm.m, gemm.n, generator=gen).to(device, dtype)

    # Outputs allocated once: fresh ones time the allocator's page faults too, which a training step in
    # its steady state does not pay (at CodeParrot-small's shape on a CPU, single passes over fresh
    # outputs took 7.4 s per iteration against 5.1 s for the best of three).
    out_forward = torch.empty(gemm.batch, gemm.m, gemm.n, device=device, dtype=dtype)
    out_input = torch.empty(gemm.batch, gemm.m, gemm.k, device=device, dtype=dtype)
    out_weight = torch.empty(gemm.batch, gemm.k, gemm.n, device=device, dtype=dtype)

    def once() -> None:
        torch.bmm(a, w, out=out_forward)  # forward      [m,k]x[k,n]
        torch.bmm(g, w.transpose(1, 2), out=out_input)  # input grad   [m,n]x[n,k]
        torch.bmm(a.transpose(1, 2), g, out=out_weight)  # weight grad  [k,m]x[m,n]

    once()  # warm-up (kernel selection, caches)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        once()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure(gemms: list[Gemm], micro_batches: int, dtype: torch.dtype, device: torch.device, repeats: int = 3) -> dict:
    """The GEMM time and FLOP/s of one training iteration (micro_batches x the model's GEMMs)."""
    rows, total_seconds, total_flops = [], 0.0, 0.0
    for gemm in gemms:
        seconds = _time_gemm(gemm, dtype, device, repeats) * gemm.count * micro_batches
        flops = gemm.flops * micro_batches
        rows.append(
            {
                "gemm": gemm.name,
                "shape": [gemm.batch, gemm.m, gemm.k, gemm.n],
                "per_iteration": gemm.count * micro_batches,
                "ms": seconds * 1e3,
                "tflops": flops / seconds / 1e12,
            }
        )
        total_seconds += seconds
        total_flops += flops
    return {
        "dtype": _name(dtype),
        "gemm_ms_per_iteration": total_seconds * 1e3,
        "gemm_flops_per_iteration": total_flops,
        "gemm_tflops": total_flops / total_seconds / 1e12,
        "gemms": rows,
    }


# Below this fraction of float32's matmul speed a 16-bit GEMM is taken as emulated: on a CPU without
# AVX512-BF16/AMX torch multiplies bf16 in a scalar fallback (an AMD EPYC with AVX2: 0.76 GFLOP/s against
# 99 in fp32, 130x slower), where hardware bf16 runs as fast as fp32 or faster (AMX: 1.8 TFLOP/s).
NATIVE_FRACTION_OF_FP32 = 0.25


def gemm_speed_check(dtype: torch.dtype, device: torch.device, size: int = 256, repeats: int = 3) -> dict:
    """Whether this device multiplies `dtype` at hardware speed: a [size]^3 GEMM's GFLOP/s (forward and
    both gradients, timed as the roofline times them) in `dtype` against float32, and the CPU's bf16
    instructions as torch reports them."""
    probe = Gemm("probe", 1, size, size, size, 1)
    gflops = {
        kind: probe.flops / _time_gemm(probe, kind, device, repeats) / 1e9
        for kind in dict.fromkeys((dtype, torch.float32))
    }
    check = {
        "dtype": _name(dtype),
        "gflops": gflops[dtype],
        "fp32_gflops": gflops[torch.float32],
        "native": gflops[dtype] >= NATIVE_FRACTION_OF_FP32 * gflops[torch.float32],
    }
    if device.type == "cpu":  # private but stable helpers (torch.cpu); absent ones read as unknown
        check["cpu_bf16_instructions"] = {
            name: getattr(torch.cpu, f"_is_{name}_supported", lambda: None)() for name in ("avx512_bf16", "amx_tile")
        }
    return check


def emulated_summary(check: dict) -> str:
    """The figures behind a gemm_speed_check that found the dtype emulated, for the refusal and the warning."""
    cpu = check.get("cpu_bf16_instructions")  # only on a CPU: a GPU's message would read "None" otherwise
    return (
        f"{check['dtype']} matmuls are emulated here ({check['gflops']:.1f} GFLOP/s against "
        f"{check['fp32_gflops']:.0f} in float32" + (f"; CPU bf16 instructions {cpu})" if cpu else ")")
    )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
