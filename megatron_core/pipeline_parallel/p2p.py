"""Point-to-point exchange of activations and their gradients between adjacent pipeline stages.

Every exchange is between this rank and the previous / next stage of its pipeline (global ranks
from parallel_state). Shapes are not sent: both sides know them from (seq_length, micro batch,
hidden), [s/tp, b, h] with sequence parallelism. Sends and receives that happen at the same
time (the steady 1F1B state sends a result to one neighbour and receives from the other) are
issued together as one `batch_isend_irecv`, which NCCL needs to avoid a deadlock and gloo runs
as independent asynchronous ops.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_core import parallel_state as ps


# Activations flow forward (to the next stage), gradients backward. Under the interleaved schedule
# with PP 2 the previous and the next stage are the same rank and one batch can carry both kinds to
# it: each kind has its own tag (gloo matches by tag), and every rank issues the activation ops
# before the gradient ops (NCCL matches a pair's messages in issue order), so the two never swap.
_ACTIVATION_TAG, _GRADIENT_TAG = 1, 2


def _communicate(
    *,
    send_next: Optional[torch.Tensor],
    send_prev: Optional[torch.Tensor],
    recv_prev: bool,
    recv_next: bool,
    shape: tuple,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Send to / receive from the neighbours in one batch. Returns (from_prev, from_next)."""
    group = ps.get_pipeline_model_parallel_group()
    prev_rank, next_rank = ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()
    ops, from_prev, from_next = [], None, None
    if send_next is not None:  # activations
        ops.append(dist.P2POp(dist.isend, send_next.contiguous(), next_rank, group, _ACTIVATION_TAG))
    if recv_prev:
        from_prev = torch.empty(shape, dtype=dtype, device=device, requires_grad=False)
        ops.append(dist.P2POp(dist.irecv, from_prev, prev_rank, group, _ACTIVATION_TAG))
    if send_prev is not None:  # gradients
        ops.append(dist.P2POp(dist.isend, send_prev.contiguous(), prev_rank, group, _GRADIENT_TAG))
    if recv_next:
        from_next = torch.empty(shape, dtype=dtype, device=device, requires_grad=False)
        ops.append(dist.P2POp(dist.irecv, from_next, next_rank, group, _GRADIENT_TAG))
    if ops:
        # wait() makes the current stream wait for the transfers (NCCL) or blocks until they are done (gloo):
        # the received tensors are ready for the kernels queued after it, without a host sync.
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return from_prev, from_next


class StageLink:
    """The channel of one pipeline stage to its neighbours, for one tensor shape and dtype.

    First stages never receive activations, last stages never send them; each method is a no-op
    (returning None) where its direction does not exist, so the schedule reads the same on every
    stage.
    """

    def __init__(self, shape: tuple, dtype: torch.dtype, device: torch.device):
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.first = ps.is_pipeline_first_stage()
        self.last = ps.is_pipeline_last_stage()

    def _go(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        return _communicate(
            send_next=send_next,
            send_prev=send_prev,
            recv_prev=recv_prev,
            recv_next=recv_next,
            shape=self.shape,
            dtype=self.dtype,
            device=self.device,
        )

    def exchange(
        self,
        send_next: Optional[torch.Tensor] = None,
        send_prev: Optional[torch.Tensor] = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Exactly the given sends and receives, in one batch; (from_prev, from_next). The interleaved
        schedule decides itself which directions exist: its chunks pass activations from the last
        stage round to the first (the ring wraps), so stage position alone does not tell."""
        return self._go(
            send_next=None if send_next is None else send_next.detach(),
            send_prev=send_prev,
            recv_prev=recv_prev,
            recv_next=recv_next,
        )

    def recv_forward(self) -> Optional[torch.Tensor]:
        """Activations from the previous stage (None on the first stage)."""
        return None if self.first else self._go(recv_prev=True)[0]

    def send_forward(self, output: Optional[torch.Tensor]) -> None:
        if not self.last:
            self._go(send_next=output.detach())

    def recv_backward(self) -> Optional[torch.Tensor]:
        """Gradient of this stage's output from the next stage (None on the last stage)."""
        return None if self.last else self._go(recv_next=True)[1]

    def send_backward(self, input_grad: Optional[torch.Tensor]) -> None:
        if not self.first:
            self._go(send_prev=input_grad)

    def send_forward_recv_backward(self, output: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if self.last:
            return None
        return self._go(send_next=output.detach(), recv_next=True)[1]

    def send_backward_recv_forward(self, input_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if self.first:
            return None
        return self._go(send_prev=input_grad, recv_prev=True)[0]
