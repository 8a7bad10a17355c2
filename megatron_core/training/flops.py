"""Model FLOPs per iteration, the device peak table and MFU.

FLOPs (docs/metrics-and-flops.md, generalized to any ffn size F; equal to Megatron's
72*B*s*L*h^2*(1 + s/(6h) + V/(12*L*h)) when F = 4h): forward FLOPs per token are
2*(4h^2 + 2hF) + 4sh per layer plus 2Vh for the logits; backward is twice the forward, and full
activation recompute adds one more forward.
"""

from __future__ import annotations

from typing import Optional

# Dense peak TFLOP/s per device by name fragment, for (half precision bf16/fp16, fp32).
# Order matters: the first fragment found in the device name wins.
DEVICE_PEAK_TFLOPS: list[tuple[str, float, float]] = [
    ("H200", 989.0, 67.0),
    ("H100 PCIe", 756.0, 51.0),
    ("H100", 989.0, 67.0),  # SXM / HBM3
    ("GH200", 989.0, 67.0),
    ("A100", 312.0, 19.5),
    ("A800", 312.0, 19.5),
    ("L40S", 362.0, 91.6),
    ("L4", 121.0, 30.3),
    ("A10G", 70.0, 31.2),
    ("A10", 125.0, 31.2),
    ("V100", 125.0, 15.7),
    ("T4", 65.0, 8.1),
]


def model_flops_per_iteration(
    *,
    global_batch_size: int,
    seq_length: int,
    num_layers: int,
    hidden_size: int,
    ffn_hidden_size: int,
    padded_vocab_size: int,
    full_recompute: bool = False,
) -> float:
    b, s, L, h, f, v = global_batch_size, seq_length, num_layers, hidden_size, ffn_hidden_size, padded_vocab_size
    forward_per_token = L * (2 * (4 * h * h + 2 * h * f) + 4 * s * h) + 2 * v * h
    passes = 4 if full_recompute else 3
    return float(passes * b * s * forward_per_token)


def device_peak_tflops(device_name: str, precision: str) -> Optional[float]:
    """Peak dense TFLOP/s of a named accelerator, or None when unknown (CPUs are never in the table)."""
    for fragment, half, single in DEVICE_PEAK_TFLOPS:
        if fragment.lower() in device_name.lower():
            return single if precision == "fp32" else half
    return None


def tflops_per_device(flops_per_iteration: float, seconds_per_iteration: float, world_size: int) -> float:
    return flops_per_iteration / (seconds_per_iteration * world_size * 1e12)


def mfu(achieved_tflops_per_device: float, peak_tflops: Optional[float]) -> Optional[float]:
    return None if not peak_tflops else achieved_tflops_per_device / peak_tflops
