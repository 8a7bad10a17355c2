"""Pipeline parallelism: p2p exchange between stages and the forward/backward schedules.

The contract of the schedules is in `megatron_core.pipeline_parallel.schedules`' docstring.
"""

from megatron_core.pipeline_parallel.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
)

__all__ = [
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "get_forward_backward_func",
]
