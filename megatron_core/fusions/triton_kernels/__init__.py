"""Triton kernels behind the fusions. Imported only when a Triton backend is used, so importing
`megatron_core.fusions` neither needs triton nor fixes TRITON_INTERPRET for the process.

Each module holds the @triton.jit forward/backward kernels of one fusion, their launchers registered as
torch custom ops (namespace `megatron_fusions`, opaque to torch.compile, with fake kernels for tracing;
called directly, past the dispatcher, outside a compile trace: _common.KernelOp), and the torch.autograd.Function
that ties them together. A launcher's body is `_<op>(..., launch)`, which megatron_core.fusions.aot also calls to
compile the same launches ahead of time (see _common.Launch).
Kernel modules import only `_common` and `megatron_core.fusions._collectives`, never the dispatchers above.
"""
