"""Where time goes, from a torch.profiler run: one table per op or kernel, each counted once.

On CUDA the table lists GPU kernels (events on the device) by their time, and the total is their sum. A CPU
op's "self device time" is the time of the kernels it launched, which the kernels' own events already
count, so summing over every event counted each kernel twice (the bench.train profiles of stop 20 did:
`megatron_fusions::layer_norm_bwd` and `_layer_norm_bwd_kernel` each 98.5 ms of a 931 ms step). On a CPU
the table lists ops by their self CPU time.
"""

from __future__ import annotations

import re

from torch.autograd import DeviceType


def time_table(prof, calls: int, device_type: str, unit: str = "call") -> tuple[float, list[dict]]:
    """(total ms per call, rows sorted by time: op, calls, ms_per_<unit>, share) of a profile of `calls` calls
    (a call: one benchmarked call, or one training step with unit="step")."""
    averages = prof.key_averages()
    if device_type == "cuda":
        rows = [(e.key, e.count, e.self_device_time_total) for e in averages if e.device_type == DeviceType.CUDA]
    else:
        rows = [(e.key, e.count, e.self_cpu_time_total) for e in averages]
    rows = [row for row in rows if row[2] > 0]
    total_us = sum(us for _, _, us in rows)
    table = [
        {"op": key, "calls": count // calls, f"ms_per_{unit}": us / 1e3 / calls, "share": us / (total_us or 1.0)}
        for key, count, us in sorted(rows, key=lambda row: -row[2])
    ]
    return total_us / 1e3 / calls, table


# What counts as a matrix multiply in a time table. On a CPU: the aten ops that run the GEMMs themselves (by self
# time, so aten::linear and aten::matmul, which only dispatch to these, add nothing). On CUDA: kernels by name:
# cuBLAS/cuBLASLt (gemm, nvjet, xmma, cublas), CUTLASS, and the fused attention kernels (flash, fmha, cuDNN sdpa),
# which also do their softmax, so on a GPU the matmul share is an upper bound.
CPU_MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm"})
CUDA_MATMUL_NAME = re.compile(r"gemm|nvjet|xmma|cublas|cutlass|flash|fmha|sdpa", re.IGNORECASE)


def is_matmul(op: str, device_type: str) -> bool:
    return bool(CUDA_MATMUL_NAME.search(op)) if device_type == "cuda" else op in CPU_MATMUL_OPS


def matmul_split(table: list[dict], device_type: str, unit: str = "step") -> dict:
    """How a whole time_table divides between matrix multiplies and everything else, in ms per `unit`."""
    key = f"ms_per_{unit}"
    matmul = sum(row[key] for row in table if is_matmul(row["op"], device_type))
    return {f"matmul_{key}": matmul, f"other_{key}": sum(row[key] for row in table) - matmul}
