"""Which implementation runs attention and each fusion: chosen once, checked, and described for the start-up log.

Attention (the recipe's `model.attention_backend`): "sdpa" (F.scaled_dot_product_attention), "unfused"
(explicit softmax(QK^T)V through the softmax fusion), "blocked" (our CPU kernel, fusions/causal_attention.py,
without attention dropout) or "auto": the blocked kernel on a CPU in fp32/fp64/bf16 (_AUTO_BLOCKED_DTYPES)
outside a compiled graph while no attention dropout is drawn, SDPA otherwise. resolve_backends settles it
for the run twice over: for calls that draw no attention dropout and for training calls that do. A registry
built without a run's facts (FusionBackends(), or `unresolved_attention`) keeps "auto" and settles it per
call from the activations (`FusionBackends.attention_kernel`).

Backends: "triton" (our @triton.jit kernels: softmax and cross entropy only), "apex" (NVIDIA Apex, LayerNorm
only), "compile" (the torch backend's own formulas through torch.compile, as Megatron's ``jit_fuser`` does:
inductor fuses each into generated C++ loops on a CPU, Triton kernels on CUDA; bias-GeLU only), "torch" (the
plain PyTorch reference, every fusion). "auto" means, on CUDA, Triton for softmax and cross entropy and torch for
the rest; on a CPU torch, except bias-GeLU in fp32, bf16 and fp16 (_AUTO_COMPILE_ON_CPU, _AUTO_COMPILE_DTYPES),
where it takes "compile" when a C++ compiler is there (the first compile takes about 20 s; inductor's disk cache
serves later processes).

The recipe-wide choice ("fusions: triton|apex|compile") runs the fusions that backend has and gives the others
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

ATTENTION_CHOICES = ("auto", "sdpa", "unfused", "blocked")
# The dtypes "auto" runs the blocked kernel in (those it has: causal_attention.SUPPORTED_DTYPES). Swapping
# the CPU attention kernel is this line and fusions/causal_attention.py.
_AUTO_BLOCKED_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
FUSION_NAMES = ("layer_norm", "bias_gelu", "bias_dropout_add", "softmax", "cross_entropy")
BACKEND_NAMES = ("triton", "apex", "compile", "torch")
# Only Triton kernels that beat PyTorch on the GPU ship (bench/results/kernels-20261204-155904.json); "auto"
# runs them on CUDA.
_TRITON_FUSIONS = frozenset({"softmax", "cross_entropy"})
_APEX_FUSIONS = frozenset({"layer_norm"})
# Where torch.compile beats the torch backend's few passes (scratch timings on a 2-core AVX2 CPU, fp32,
# forward + backward: bias-GeLU at [2048, 512] 8-9 -> 6 ms). Not cross entropy: its forward's exp_/sum is
# already in place and compiled it took 11.3 ms against 12.3 at [2048, 4096], forward and backward 56
# against 45. Layer norm and softmax are one aten kernel already.
_COMPILE_FUSIONS = frozenset({"bias_gelu"})
# On a CPU, A/B in one process on a 2-core AVX-512 Xeon. bf16/fp16: the torch backend's bias-GeLU is
# F.gelu(x + bias), whose tanh runs slowly (the sigmoid form in place would round at every pass); compiled,
# forward and backward at [512, 3072] took 1.7 ms against 3.9 and the 12 x 768 step 950-973 ms against
# 994-1036. fp32: the torch backend's in-place passes each take a fresh 4 MB buffer whose pages fault in
# (an addcmul 0.8 ms inside the step, 0.15 alone); compiled, the codeparrot-tiny step took 241-247 ms
# against 250-260 (medians of 40 steps). (On the AVX2 machine before, alternating whole runs did not
# separate fp32 from the noise.) fp64 stays eager: it is for checking, not for speed.
_AUTO_COMPILE_ON_CPU = frozenset({"bias_gelu"})
_AUTO_COMPILE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The fusions each backend has a kernel for.
_SERVES = {"triton": _TRITON_FUSIONS, "apex": _APEX_FUSIONS, "compile": _COMPILE_FUSIONS,
           "torch": frozenset(FUSION_NAMES)}


def backend_choices(fusion: str) -> tuple[str, ...]:
    """What a per-fusion override may name for `fusion`."""
    return ("auto", *(backend for backend in BACKEND_NAMES if fusion in _SERVES[backend]))


def _no_kernel(fusion: str, backend: str) -> str:
    why = {"triton": f"there is no Triton kernel for {fusion} (ours ran slower than PyTorch on the GPU and was "
                     "deleted)",
           "apex": f"Apex has no kernel for {fusion}",
           "compile": f"there is no compiled {fusion}"}[backend]
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
        return ("Triton runs on a CPU only under its interpreter; set TRITON_INTERPRET=1 in the environment "
                "before Python starts, or use backend 'torch'")
    # Lazy: triton is optional, and importing it here (only once the variable is set) cannot fix the mode.
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.random.randint, InterpretedFunction):
        return ("TRITON_INTERPRET=1 was set after triton had already been imported in this process; set it "
                "before the first `import triton` (e.g. in the environment of the process)")
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
            return ("TRITON_INTERPRET=1 is set, so the kernels would run in Triton's interpreter on host copies "
                    "of the CUDA tensors, not compiled for the GPU; unset it")
        return None
    if kind == "cpu":
        return _triton_interpreter_problem()
    return f"Triton kernels are not supported on device type {kind!r}"


def triton_problem(device) -> str | None:
    """Why Triton cannot run on `device`, or None when it can."""
    return _usable_once(_TRITON_USABLE_ON, _device_type(device), _triton_problem_on)


# Device types on which torch.compile was found usable (see _usable_once).
_COMPILE_USABLE_ON: set[str] = set()
_COMPILED: dict = {}


def _cpp_compiler_problem() -> str | None:
    # Lazy: importing inductor took 10 s cold here, and only "compile" needs it.
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()  # the compiler inductor itself will run (CXX, read when inductor loads)
    except Exception as exc:  # inductor's own InvalidCxxCompiler, or whatever its search raises
        return (f"torch.compile builds CPU kernels with a C++ compiler and found none ({exc}); "
                "apt install g++ (or set CXX before starting Python), or use 'torch'")
    return None


def _compile_problem_on(kind: str) -> str | None:
    if kind == "cpu":
        return _cpp_compiler_problem()
    if kind == "cuda":
        return _triton_import_problem() or (None if torch.cuda.is_available() else "no CUDA device is available")
    return f"torch.compile fusions are not supported on device type {kind!r}"


def compile_problem(device) -> str | None:
    """Why torch.compile cannot build the fusions for `device`, or None when it can."""
    return _usable_once(_COMPILE_USABLE_ON, _device_type(device), _compile_problem_on)


def compiled(fn):
    """`fn` through torch.compile, wrapped once per function. Inductor compiles on the first call and again
    for each new dtype or flag argument, or a shape it has not generalized yet; its on-disk cache serves
    later processes. (A plain dict, not functools.cache, which a whole-model trace cannot see through.)"""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn)
    return _COMPILED[fn]


def apex_problem(device) -> str | None:
    """Why Apex's fused LayerNorm cannot run on `device`, or None when it can."""
    if _device_type(device) != "cuda":
        return "Apex kernels need a CUDA device"
    status = apex_status()
    missing = [name for name in ("apex", "fused_layer_norm_cuda") if not status[name]]
    if missing:
        return (f"Apex is not usable: {', '.join(missing)} failed to import "
                f"({status['errors'].get(missing[0], '')}); install Apex with its CUDA extensions or use "
                "'torch'")
    return None


def _auto_backend(fusion: str, device, dtype: torch.dtype | None) -> str:
    kind = _device_type(device)
    if fusion in _TRITON_FUSIONS and kind == "cuda" and triton_problem(device) is None:
        return "triton"
    if (fusion in _AUTO_COMPILE_ON_CPU and kind == "cpu" and dtype in _AUTO_COMPILE_DTYPES
            and compile_problem(device) is None):
        return "compile"
    return "torch"


def choose_backend(fusion: str, requested: str, device, dtype: torch.dtype | None = None) -> str:
    """The concrete backend one call of `fusion` runs with (`dtype`: the activations', which "auto" may
    consider); raises UserError when it cannot run."""
    if fusion not in FUSION_NAMES:
        raise UserError(f"unknown fusion {fusion!r}; known fusions: {', '.join(FUSION_NAMES)}")
    if requested == "auto":
        return _auto_backend(fusion, device, dtype)
    if requested not in BACKEND_NAMES:
        raise UserError(f"unknown backend {requested!r} for {fusion}; use one of {', '.join(backend_choices(fusion))}")
    if fusion not in _SERVES[requested]:
        raise UserError(_no_kernel(fusion, requested))
    checks = {"apex": apex_problem, "triton": triton_problem, "compile": compile_problem}
    problem = checks[requested](device) if requested in checks else None
    if problem:
        raise UserError(f"cannot use backend {requested!r} for {fusion}: {problem}")
    return requested


def attention_kernel(requested: str, device, dtype: torch.dtype | None, dropout: float = 0.0,
                     compiling: bool = False) -> str:
    """The attention kernel ("sdpa", "unfused" or "blocked") that `requested` (one of ATTENTION_CHOICES) runs
    on `device` in `dtype`, for a call drawing attention dropout `dropout` (0 when none is drawn: evaluation,
    or attention_dropout 0), inside a compiled graph or not. "auto" with the dtype unknown stays "auto"."""
    if requested not in ATTENTION_CHOICES:
        raise UserError(f"attention_backend: {requested!r} is not one of {', '.join(ATTENTION_CHOICES)}")
    if requested == "blocked" and dropout > 0.0:
        raise UserError(f"attention_backend blocked has no attention dropout, but attention_dropout is {dropout} in "
                        "training; use --set attention_backend=auto (SDPA while dropout is drawn) or --set "
                        "attention_dropout=0")
    if requested != "auto":
        return requested
    # Not inside a compiled graph: the blocked kernel's autograd Function writes through out= (untraceable);
    # SDPA is the same function there. It has no dropout, so SDPA serves calls that draw it.
    if _device_type(device) != "cpu" or dropout > 0.0 or compiling:
        return "sdpa"
    if dtype is None:
        return "auto"
    return "blocked" if dtype in _AUTO_BLOCKED_DTYPES else "sdpa"


@dataclass(frozen=True)
class FusionBackends:
    """The kernel attention runs with and the backend each fusion runs with; pass the fusions' as `backend=`
    to the fusion functions, and ask `attention_kernel` per attention call."""

    layer_norm: str = "torch"
    bias_gelu: str = "torch"
    bias_dropout_add: str = "torch"
    softmax: str = "torch"
    cross_entropy: str = "torch"
    device: str = "cpu"
    note: str = ""  # what else the log should say: fusions "triton" has no kernel for, an unusable Triton
    attention_request: str = "auto"  # the recipe's model.attention_backend these were resolved for
    attention: str = "auto"  # the kernel for calls that draw no attention dropout ("auto": decided per call)
    attention_with_dropout: str = "auto"  # the kernel for training calls that draw attention dropout

    def attention_kernel(self, x: torch.Tensor, dropout: float) -> str:
        """The kernel one attention call on activations `x` runs, drawing attention dropout `dropout` (0 when
        it draws none). Resolved choices are read as they are; "auto" (no run's facts) and "blocked" (which
        refuses dropout) go through the policy with this call's facts."""
        chosen = self.attention_with_dropout if dropout > 0.0 else self.attention
        if chosen in ("auto", "blocked"):
            return attention_kernel(chosen, x.device, x.dtype, dropout, torch.compiler.is_compiling())
        return chosen

    def describe(self, gelu_approximation: str | None = None) -> str:
        """Every choice in one line; given the model's `gelu_approximation`, bias-GeLU names it (the fused
        bias-GeLU is the tanh one: "none", the exact erf GeLU, runs in plain PyTorch)."""
        attention = self.attention
        if self.attention_with_dropout != self.attention:
            attention += f" ({self.attention_with_dropout} while training draws attention dropout)"
        if self.attention == "auto":
            attention = ("auto (per call: blocked on a CPU in fp32/fp64/bf16 unless training draws attention "
                         "dropout, else sdpa)")
        fusions = []
        for name in FUSION_NAMES:
            backend = getattr(self, name)
            if name == "bias_gelu" and gelu_approximation is not None:
                name = f"bias_gelu[{gelu_approximation}]"
                backend = backend if gelu_approximation == "tanh" else "torch (exact erf)"
            fusions.append(f"{name}={backend}")
        return (f"backends on {self.device}: attention={attention}, {', '.join(fusions)}"
                + (f" ({self.note})" if self.note else ""))


def unresolved_attention(requested: str) -> FusionBackends:
    """The PyTorch reference fusions with attention `requested`, settled per call: for a model built without
    a run's device and dtype (tests, tools)."""
    attention_kernel(requested, "cpu", None)  # refuses an unknown choice now
    return FusionBackends(attention_request=requested, attention=requested, attention_with_dropout=requested)


def _stand_in(fusion: str, requested: str, device, dtype: torch.dtype | None) -> str:
    """The backend for a fusion that the recipe-wide `requested` has no kernel for: "auto"'s choice, except
    that "triton" (the fused GPU kernels) takes Apex's fused LayerNorm where Apex runs."""
    if requested == "triton" and fusion in _APEX_FUSIONS and apex_problem(device) is None:
        return "apex"
    return _auto_backend(fusion, device, dtype)


def resolve_backends(fusions: str = "auto", overrides: dict | None = None, device="cpu",
                     dtype: torch.dtype | None = None, attention: str = "auto",
                     compile: bool = False) -> FusionBackends:
    """Resolve the recipe's `fusions` key (auto|triton|apex|compile|torch), per-fusion overrides and
    `attention` (model.attention_backend) for `device` and the model's activation `dtype` (None: unknown, "auto"
    then ignores it), with the layers compiled (training.compile) or not.

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
            chosen[name] = choose_backend(name, overrides[name], device, dtype)
        elif fusions == "auto" or name in _SERVES[fusions]:
            chosen[name] = choose_backend(name, fusions, device, dtype)
        else:
            chosen[name] = _stand_in(name, fusions, device, dtype)
            stood_in.append(name)
    kind = _device_type(device)
    notes = []
    if fusions == "triton" and stood_in:
        notes.append(f"triton has no kernel for {', '.join(stood_in)}: they run the best other backend")
    # Without Triton on CUDA, "auto" fell back to torch (an explicit "triton" would have raised above).
    problem = triton_problem(device) if kind == "cuda" else None
    if problem:
        notes.append(f"Triton unavailable: {problem}")
    # Both attention kernels: whether a call draws dropout is the call's (train or eval mode). "blocked" stays
    # itself with dropout, to refuse it when a training call draws some (evaluation draws none).
    quiet = attention_kernel(attention, device, dtype, 0.0, compile)
    dropping = "blocked" if attention == "blocked" else attention_kernel(attention, device, dtype, 1.0, compile)
    return FusionBackends(**chosen, device=kind, note="; ".join(notes), attention_request=attention, attention=quiet,
                          attention_with_dropout=dropping)


__all__ = ["ATTENTION_CHOICES", "FUSION_NAMES", "FusionBackends", "resolve_backends", "attention_kernel",
           "unresolved_attention", "choose_backend", "backend_choices",
           "triton_problem", "apex_problem", "compile_problem", "compiled"]
