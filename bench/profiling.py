"""Where time goes, from a torch.profiler run: one table per op or kernel, each counted once.

On CUDA the table lists GPU kernels (events on the device) by their time, and the total is their sum. A CPU
op's "self device time" is the time of the kernels it launched, which the kernels' own events already
count, so summing over every event counted each kernel twice (the bench.train profiles of stop 20 did:
`megatron_fusions::layer_norm_bwd` and `_layer_norm_bwd_kernel` each 98.5 ms of a 931 ms step). On a CPU
the table lists ops by their self CPU time.
"""

from __future__ import annotations

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
    table = [{"op": key, "calls": count // calls, f"ms_per_{unit}": us / 1e3 / calls, "share": us / (total_us or 1.0)}
             for key, count, us in sorted(rows, key=lambda row: -row[2])]
    return total_us / 1e3 / calls, table
