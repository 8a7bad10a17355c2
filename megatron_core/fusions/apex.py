"""NVIDIA Apex, when present: what imports, its fused LayerNorm and its multi-tensor FusedAdam.

Nothing here raises when Apex is missing; callers ask `apex_status()` or `fused_adam_class()` and decide.
"""

from __future__ import annotations

import functools
import importlib

import torch

_PROBES = {
    "apex": ("apex", None),
    "amp_C": ("amp_C", None),
    "fused_layer_norm_cuda": ("fused_layer_norm_cuda", None),
    "apex.optimizers.FusedAdam": ("apex.optimizers", "FusedAdam"),
}


def apex_status() -> dict:
    """{name: bool} for apex, amp_C, fused_layer_norm_cuda and apex.optimizers.FusedAdam, plus
    "errors": {name: why it failed to import}. Imports are probed once per process; each call gets a copy."""
    status = _probe_apex()
    return {**status, "errors": dict(status["errors"])}


@functools.lru_cache(maxsize=1)
def _probe_apex() -> dict:
    status: dict = {"errors": {}}
    for name, (module, attribute) in _PROBES.items():
        try:
            loaded = importlib.import_module(module)
            if attribute is not None:
                getattr(loaded, attribute)
            status[name] = True
        except Exception as exc:  # an Apex built for another torch raises all sorts of errors, not only ImportError
            status[name] = False
            status["errors"][name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return status


def fused_adam_class():
    """apex.optimizers.FusedAdam when it and its multi-tensor CUDA kernels (amp_C) import, else None."""
    status = apex_status()
    if not (status["apex.optimizers.FusedAdam"] and status["amp_C"]):
        return None
    from apex.optimizers import FusedAdam  # lazy: Apex is optional (probed above)

    return FusedAdam


def fused_adam_problem(device_type: str) -> str | None:
    """Why `training.optimizer: apex` cannot run on `device_type` here ('cpu' or 'cuda'), or None when it can:
    FusedAdam's multi-tensor kernels (amp_C) are CUDA only, and both must import."""
    if device_type != "cuda":
        return (
            f"training.optimizer 'apex' (Apex's FusedAdam) runs on CUDA only but training runs on {device_type}: "
            "use --set optimizer=adam (torch's AdamW)"
        )
    status = apex_status()
    missing = [name for name in ("apex.optimizers.FusedAdam", "amp_C") if not status[name]]
    if missing:
        why = status["errors"].get(missing[0], "")
        return (
            f"training.optimizer 'apex' needs Apex's FusedAdam with its CUDA extensions, but "
            f"{' and '.join(missing)} do not import here ({why}): build Apex as docker/Dockerfile does, "
            "or use --set optimizer=adam"
        )
    return None


def apex_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Apex's fused LayerNorm over the last dimension (FusedLayerNormAffineFunction, with its own backward)."""
    from apex.normalization.fused_layer_norm import fused_layer_norm_affine  # lazy: Apex is optional

    return fused_layer_norm_affine(x, weight, bias, (x.shape[-1],), eps)
