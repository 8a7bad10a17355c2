"""Helpers shared by the Triton launchers: output allocation, dtype checks, launch sizes, and the `Launch`
record each launcher builds.

Every launcher is split in two: `_<op>(..., launch)` allocates the outputs, works out the grid, the block
sizes and num_warps from the shapes, and hands one `Launch` per kernel to `launch`; the torch custom op
calls it with `run` (launch now), and megatron_core.fusions.aot calls it with meta tensors and a recorder,
then compiles each recorded kernel for a GPU from exactly those arguments. So the ahead-of-time compile and
the run-time launch share one signature and one choice of block sizes and cannot drift apart."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import triton

from megatron_core.errors import UserError

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# One program holds a whole row in registers; rows longer than this go to the torch backend.
MAX_ROW_ELEMENTS = 65536


def new_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Every tensor a launcher returns is allocated here (the tests replace it with a NaN-filled one)."""
    return torch.empty(shape, dtype=dtype, device=device)


def check_float(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise UserError(f"{name} has dtype {tensor.dtype}; the Triton kernels take float32, float16 or bfloat16")


def row_block(n_cols: int, what: str) -> int:
    """The power-of-two block that holds one row of `n_cols` elements."""
    if n_cols > MAX_ROW_ELEMENTS:
        raise UserError(
            f"{what} of {n_cols} elements exceeds the Triton kernel limit of {MAX_ROW_ELEMENTS}; "
            "use backend='torch' for this fusion"
        )
    return triton.next_power_of_2(n_cols)


def rows_per_block(block_n: int) -> int:
    """Rows one program handles together: short rows are batched so a program has ~4096 elements of work
    (this also keeps the number of programs, and so the interpreter's run time, small)."""
    return max(1, min(64, 4096 // block_n))


def warps_for(block: int) -> int:
    """Enough warps that each thread holds a handful of elements of a row."""
    return min(max(block // 256, 1), 16)


class KernelOp:
    """A launcher registered as a torch custom op, which is what torch.compile must see (one opaque op whose fake
    kernel gives the output shapes, as must any tracing dispatch mode), and called directly otherwise: there the op
    would only add the dispatcher's boxing and unboxing, 66 us a call on a 2-core AVX2 CPU against 3 us for the
    plain function, which is as long as a small fused kernel runs on a GPU."""

    def __init__(self, name: str, body: Callable) -> None:
        self.body = body
        self.op = torch.library.custom_op(name, mutates_args=())(body)
        functools.update_wrapper(self, body)

    def register_fake(self, fake: Callable) -> Callable:
        self.op.register_fake(fake)
        return fake

    def __call__(self, *args):
        # A dispatch mode (FakeTensorMode, make_fx, FlopCounterMode) must meet the op and its fake too.
        traced = torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
        return self.op(*args) if traced else self.body(*args)


def kernel_op(name: str) -> Callable[[Callable], KernelOp]:
    """Decorator: `@kernel_op("megatron_fusions::x")` over a launcher makes it a KernelOp."""
    return functools.partial(KernelOp, name)


@dataclass(frozen=True)
class Launch:
    """One launch of a @triton.jit kernel: positional arguments in the kernel's order (tensors and scalars),
    the constexpr keyword arguments, and the launch options."""

    kernel: Any  # triton.JITFunction (or the interpreter's InterpretedFunction)
    grid: tuple
    args: tuple
    constexprs: dict = field(default_factory=dict)
    num_warps: int = 4

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


def run(launch: Launch) -> None:
    """Launch it now (on the tensors' device, or under the interpreter)."""
    launch.kernel[launch.grid](*launch.args, **launch.constexprs, num_warps=launch.num_warps)
