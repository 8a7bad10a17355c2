"""Where evaluation runs: the recipe's device and precision, or what --device/--dtype say.

auto: the first CUDA GPU in the precision the recipe trained in (bf16/fp16), fp32 on a CPU.
"cuda:all" spreads the model over every visible GPU (transformers' device_map="auto").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_core.errors import UserError

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DEVICES_HELP = "auto | cpu | cuda | cuda:N | cuda:all"


@dataclass(frozen=True)
class Placement:
    device: torch.device  # where inputs go (the first GPU of a spread model)
    dtype: torch.dtype
    device_map: Optional[str] = None  # "auto": spread over all GPUs

    @property
    def dtype_name(self) -> str:
        return next(name for name, d in DTYPES.items() if d == self.dtype)

    def describe(self) -> str:
        where = f"{torch.cuda.device_count()} GPUs (device_map=auto)" if self.device_map else str(self.device)
        if self.device.type == "cuda":
            where += f" [{torch.cuda.get_device_name(self.device)}]"
        return f"{where}, {self.dtype_name}"

    def to_json(self) -> dict:
        return {"device": "cuda:all" if self.device_map else str(self.device), "dtype": self.dtype_name}


def resolve_placement(recipe, device: str = "auto", dtype: str = "auto") -> Placement:
    """One line of UserError for a device that is not here or a dtype that is not known."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = device or "auto"
    if device == "auto":
        device = "cuda" if gpus else "cpu"
    if device == "cpu":
        placement_device, device_map = torch.device("cpu"), None
    elif device == "cuda" or device.startswith("cuda:"):
        if not gpus:
            raise UserError(f"--device {device}: no CUDA GPU is visible here; use --device cpu (or auto)")
        index = device.partition(":")[2] or "0"
        if index == "all":
            placement_device, device_map = torch.device("cuda:0"), "auto"
        elif index.isdigit() and int(index) < gpus:
            placement_device, device_map = torch.device(f"cuda:{index}"), None
        else:
            raise UserError(
                f"--device {device}: this machine has {gpus} GPU(s), cuda:0..cuda:{gpus - 1}; "
                f"use one of those or cuda:all"
            )
    else:
        raise UserError(f"--device {device!r} is not a device; use one of {DEVICES_HELP}")
    dtype = dtype or "auto"
    if dtype == "auto":
        dtype = recipe.precision if placement_device.type == "cuda" else "fp32"
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r} is not known; use auto, {', '.join(DTYPES)}")
    return Placement(placement_device, DTYPES[dtype], device_map)
