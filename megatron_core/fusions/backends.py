"""Which implementation runs attention and each fusion: chosen once, checked, and described for the start-up log.

Attention (the recipe's `model.attention_backend`): "sdpa" (F.scaled_dot_product_attention, also what
"auto", the default, runs) or "unfused" (explicit softmax(QK^T)V through the softmax fusion).

Backends: "triton" (our @triton.jit kernels: softmax and cross entropy only), "apex" (NVIDIA Apex, LayerNorm
only), "torch" (the plain PyTorch reference, every fusion). "auto" means, on CUDA, Triton for softmax and cross
entropy and torch for the rest; torch everywhere on a CPU.

The recipe-wide choice ("fusions: triton|apex") runs the fusions that backend has and gives the others
"auto"'s choice, except that "triton" (the fused GPU kernels) gives LayerNorm to Apex where Apex runs; the
start-up description says which. Otherwise Apex is used only when asked for. A per-fusion override naming a
backend without a kernel for that fusion is refused.

Triton on a CPU works only through Triton's interpreter, which must be switched on with TRITON_INTERPRET=1
*before the process first imports triton* (triton decorates its own library functions, e.g. ``tl.rand``, at
import time). The tests do this; anything else asking for "triton" on a CPU gets a UserError.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from megatron_core.errors import UserError
from megatron_core.fusions.apex import apex_status

# "auto" is SDPA everywhere; it stays a choice so that recipes naming it keep their meaning and hash.
ATTENTION_CHOICES = ("auto", "sdpa", "unfused")
FUSION_NAMES = ("layer_norm", "bias_gelu", "bias_dropout_add", "softmax", "cross_entropy")
BACKEND_NAMES = ("triton", "apex", "torch")
# Only Triton kernels that beat PyTorch on the GPU ship (bench/results/kernels-20261204-155904.json); "auto"
# runs them on CUDA.
_TRITON_FUSIONS = frozenset({"softmax", "cross_entropy"})
_APEX_FUSIONS = frozenset({"layer_norm"})
# The fusions each backend has a kernel for.
_SERVES = {"triton": _TRITON_FUSIONS, "apex": _APEX_FUSIONS, "torch": frozenset(FUSION_NAMES)}


def backend_choices(fusion: str) -> tuple[str, ...]:
    """What a per-fusion override may name for `fusion`."""
    return ("auto", *(backend for backend in BACKEND_NAMES if fusion in _SERVES[backend]))


def _no_kernel(fusion: str, backend: str) -> str:
    why = {
        "triton": f"there is no Triton kernel for {fusion} (ours ran slower than PyTorch on the GPU and was deleted)",
        "apex": f"Apex has no kernel for {fusion}",
    }[backend]
    return f"{why}; use one of {', '.join(backend_choices(fusion))}"


def _device_type(device) -> str:
    if isinstance(device, torch.device):
        return device.type
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise UserError(f"unknown device {device!r}; use 'cpu' or 'cuda[:N]'") from exc


# Device types on which Triton was found usable (see _usable_once).
_TRITON_USABLE_ON: set[str] = set()


def _triton_import_problem() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton)"
    return None


def _triton_interpreter_problem() -> str | None:
    """Why the Triton interpreter cannot run here, or None when it can."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return (
            "Triton runs on a CPU only under its interpreter; set TRITON_INTERPRET=1 in the environment "
            "before Python starts, or use backend 'torch'"
        )
    # Lazy: triton is optional, and importing it here (only once the variable is set) cannot fix the mode.
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.random.randint, InterpretedFunction):
        return (
            "TRITON_INTERPRET=1 was set after triton had already been imported in this process; set it "
            "before the first `import triton` (e.g. in the environment of the process)"
        )
    return None


def _usable_once(usable_on: set[str], kind: str, find_problem) -> str | None:
    """None when device type `kind` passed before, else `find_problem(kind)`, remembered in `usable_on` when it
    finds none: usability cannot change later in the process, and a remembered answer keeps the checks out
    of every fusion call (and out of a torch.compile trace)."""
    if kind in usable_on:
        return None
    problem = find_problem(kind)
    if problem is None:
        usable_on.add(kind)
    return problem


def _triton_problem_on(kind: str) -> str | None:
    problem = _triton_import_problem()
    if problem is not None:
        return problem
    if kind == "cuda":
        if not torch.cuda.is_available():
            return "no CUDA device is available to this process"
        if os.environ.get("TRITON_INTERPRET") == "1":
            return (
                "TRITON_INTERPRET=1 is set, so the kernels would run in Triton's interpreter on host copies "
                "of the CUDA tensors, not compiled for the GPU; unset it"
            )
        return None
    if kind == "cpu":
        return _triton_interpreter_problem()
    return f"Triton kernels are not supported on device type {kind!r}"


def triton_problem(device) -> str | None:
    """Why Triton cannot run on `device`, or None when it can."""
    return _usable_once(_TRITON_USABLE_ON, _device_type(device), _triton_problem_on)


def apex_problem(device) -> str | None:
    """Why Apex's fused LayerNorm cannot run on `device`, or None when it can."""
    if _device_type(device) != "cuda":
        return "Apex kernels need a CUDA device"
    status = apex_status()
    missing = [name for name in ("apex", "fused_layer_norm_cuda") if not status[name]]
    if missing:
        return (
            f"Apex is not usable: {', '.join(missing)} failed to import "
            f"({status['errors'].get(missing[0], '')}); install Apex with its CUDA extensions or use "
            "'torch'"
        )
    return None


def _auto_backend(fusion: str, device) -> str:
    if fusion in _TRITON_FUSIONS and _device_type(device) == "cuda" and triton_problem(device) is None:
        return "triton"
    return "torch"


def choose_backend(fusion: str, requested: str, device) -> str:
    """The concrete backend one call of `fusion` on `device` runs with; raises UserError when it cannot run."""
    if fusion not in FUSION_NAMES:
        raise UserError(f"unknown fusion {fusion!r}; known fusions: {', '.join(FUSION_NAMES)}")
    if requested == "auto":
        return _auto_backend(fusion, device)
    if requested not in BACKEND_NAMES:
        raise UserError(f"unknown backend {requested!r} for {fusion}; use one of {', '.join(backend_choices(fusion))}")
    if fusion not in _SERVES[requested]:
        raise UserError(_no_kernel(fusion, requested))
    checks = {"apex": apex_problem, "triton": triton_problem}
    problem = checks[requested](device) if requested in checks else None
    if problem:
        raise UserError(f"cannot use backend {requested!r} for {fusion}: {problem}")
    return requested


def attention_kernel(requested: str) -> str:
    """The attention kernel ("sdpa" or "unfused") that `requested` (one of ATTENTION_CHOICES) runs."""
    if requested not in ATTENTION_CHOICES:
        raise UserError(f"attention_backend: {requested!r} is not one of {', '.join(ATTENTION_CHOICES)}")
    return "sdpa" if requested == "auto" else requested


@dataclass(frozen=True)
class FusionBackends:
    """The kernel attention runs with and the backend each fusion runs with; pass the fusions' as `backend=`
    to the fusion functions."""

    layer_norm: str = "torch"
    bias_gelu: str = "torch"
    bias_dropout_add: str = "torch"
    softmax: str = "torch"
    cross_entropy: str = "torch"
    device: str = "cpu"
    note: str = ""  # what else the log should say: fusions "triton" has no kernel for, an unusable Triton
    attention: str = "sdpa"  # the attention kernel ("sdpa" or "unfused")

    def describe(self, gelu_approximation: str | None = None) -> str:
        """Every choice in one line; given the model's `gelu_approximation`, bias-GeLU names it (the fused
        bias-GeLU is the tanh one: "none", the exact erf GeLU, runs in plain PyTorch)."""
        fusions = []
        for name in FUSION_NAMES:
            backend = getattr(self, name)
            if name == "bias_gelu" and gelu_approximation is not None:
                name = f"bias_gelu[{gelu_approximation}]"
                backend = backend if gelu_approximation == "tanh" else "torch (exact erf)"
            fusions.append(f"{name}={backend}")
        return f"backends on {self.device}: attention={self.attention}, {', '.join(fusions)}" + (
            f" ({self.note})" if self.note else ""
        )


def _stand_in(fusion: str, requested: str, device) -> str:
    """The backend for a fusion that the recipe-wide `requested` has no kernel for: "auto"'s choice, except
    that "triton" (the fused GPU kernels) takes Apex's fused LayerNorm where Apex runs."""
    if requested == "triton" and fusion in _APEX_FUSIONS and apex_problem(device) is None:
        return "apex"
    return _auto_backend(fusion, device)


def resolve_backends(
    fusions: str = "auto", overrides: dict | None = None, device="cpu", attention: str = "auto"
) -> FusionBackends:
    """Resolve the recipe's `fusions` key (auto|triton|apex|torch), per-fusion overrides and `attention`
    (model.attention_backend) for `device`.

    A recipe-wide backend runs the fusions it has a kernel for; the others get `_stand_in`'s choice, which the
    description's note names for "triton". An override must name a backend with a kernel for its fusion.
    Every explicit choice is checked now, so a missing Triton/Apex fails at start-up, not mid-run.
    """
    if fusions not in ("auto", *BACKEND_NAMES):
        raise UserError(f"fusions: {fusions!r} is not one of auto, {', '.join(BACKEND_NAMES)}")
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(FUSION_NAMES))
    if unknown:
        raise UserError(f"fusion overrides name unknown fusions {unknown}; known: {', '.join(FUSION_NAMES)}")
    chosen, stood_in = {}, []
    for name in FUSION_NAMES:
        if name in overrides:
            chosen[name] = choose_backend(name, overrides[name], device)
        elif fusions == "auto" or name in _SERVES[fusions]:
            chosen[name] = choose_backend(name, fusions, device)
        else:
            chosen[name] = _stand_in(name, fusions, device)
            stood_in.append(name)
    kind = _device_type(device)
    notes = []
    if fusions == "triton" and stood_in:
        notes.append(f"triton has no kernel for {', '.join(stood_in)}: they run the best other backend")
    # Without Triton on CUDA, "auto" fell back to torch (an explicit "triton" would have raised above).
    problem = triton_problem(device) if kind == "cuda" else None
    if problem:
        notes.append(f"Triton unavailable: {problem}")
    return FusionBackends(**chosen, device=kind, note="; ".join(notes), attention=attention_kernel(attention))


__all__ = [
    "ATTENTION_CHOICES",
    "FUSION_NAMES",
    "FusionBackends",
    "resolve_backends",
    "attention_kernel",
    "choose_backend",
    "backend_choices",
    "triton_problem",
    "apex_problem",
]
