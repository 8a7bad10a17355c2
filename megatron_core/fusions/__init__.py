"""Fused kernels behind one small function each, with a `backend=` argument: "triton" (our Triton kernels,
softmax and cross entropy: the ones that beat PyTorch on an H200), "apex" (LayerNorm only), "torch" (the plain
reference, every fusion) or "auto" (on CUDA, Triton for softmax and cross entropy; torch otherwise and on a CPU).

Resolve once at start-up with `resolve_backends(recipe.training.fusions, overrides, device)`, log
`FusionBackends.describe()`, and pass the chosen names to the calls (e.g. `backend=backends.layer_norm`).
Importing this package does not import triton; the kernels load on first use.
`python -m megatron_core.fusions.aot --arch sm_80,sm_90 --json` compiles every Triton kernel for those GPUs on
any machine (no GPU needed) and reports registers and spills.
"""

from megatron_core.fusions.apex import apex_status, fused_adam_class
from megatron_core.fusions.backends import FusionBackends, resolve_backends
from megatron_core.fusions.bias_dropout_add import bias_dropout_add
from megatron_core.fusions.bias_gelu import bias_gelu
from megatron_core.fusions.cross_entropy import cross_entropy
from megatron_core.fusions.layer_norm import layer_norm
from megatron_core.fusions.softmax import scaled_causal_softmax

__all__ = [
    "layer_norm",
    "bias_gelu",
    "bias_dropout_add",
    "scaled_causal_softmax",
    "cross_entropy",
    "FusionBackends",
    "resolve_backends",
    "apex_status",
    "fused_adam_class",
]
