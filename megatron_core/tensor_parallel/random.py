"""RNG states for dropout under tensor parallelism, and RNG-preserving activation recompute.

Megatron's rule: dropout OUTSIDE tensor-parallel regions (on replicated activations) must draw
the same mask on every TP rank, so it uses the default generator, seeded identically; dropout
INSIDE a TP region (attention probabilities of this rank's heads, sequence-parallel chunks) must
differ across TP ranks, so it runs under `get_rng_tracker().fork()`, whose generator is seeded
with `seed + 2718 + tp_rank`.

The tracker swaps states of the default generator of one device type: the TRAINING device's,
passed down by the caller (never "is CUDA visible": a `device: cpu` run on a GPU host draws its
dropout from the CPU generator, so forking the CUDA one would isolate nothing and would open a
CUDA context in every CPU rank). CPU states are plain torch.Generator byte states.

Under torch.compile a graph must not swap generator states (dynamo breaks the graph at
get_rng_state/set_rng_state), so `tracked_dropout` draws through two opaque custom ops there: the
forward forks the tracker inside the op and returns the state it drew from; the backward replays
that state to redraw the same mask (dropout is linear in its input, so the gradient is the
dropout of the incoming gradient under the same mask). The masks are the eager ones, bit for bit.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from megatron_core import parallel_state
from megatron_core.errors import UserError

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Megatron's offset between the data-parallel seed and the tensor-parallel seeds.
TENSOR_PARALLEL_SEED_OFFSET = 2718


DEVICE_TYPES = ("cpu", "cuda")


def _check_device_type(device_type: str) -> str:
    if device_type not in DEVICE_TYPES:
        raise UserError(
            f"the RNG tracker's device type is {device_type!r}; pass the training device's type, "
            f"one of {', '.join(DEVICE_TYPES)}"
        )
    return device_type


def _get_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_state(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states that can be swapped in for the default generator with `fork`."""

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = _check_device_type(device_type)
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()

    def reset(self, device_type: str = "cpu") -> None:
        self.device_type = _check_device_type(device_type)
        self.states.clear()
        self.seeds.clear()

    def misfit(self, states: dict[str, torch.Tensor]) -> Optional[str]:
        """Why `states` cannot drive this tracker's generator (None when they can): a CPU generator's
        state is 5056 bytes, a CUDA (Philox) one's 16, and torch only fails at the first fork."""
        size = _get_state(self.device_type).numel()
        wrong = sorted(name for name, state in states.items() if state.numel() != size)
        if wrong:
            return f"{', '.join(wrong)} do not fit the {self.device_type} generator ({size} bytes)"
        return None

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states:
            raise ValueError(f"RNG state {name!r} is already tracked")
        self.seeds.add(seed)
        if self.device_type == "cuda":
            saved = torch.cuda.get_rng_state()
            torch.cuda.manual_seed(seed)
            self.states[name] = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(saved)
        else:
            self.states[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block with the named state as the default generator, then put both back."""
        if name not in self.states:
            raise RuntimeError(f"RNG state {name!r} is not set: call model_parallel_manual_seed(seed) first")
        outside = _get_state(self.device_type)
        _set_state(self.device_type, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device_type)
            _set_state(self.device_type, outside)


_TRACKER = RNGStatesTracker()


def _draw_dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    # Contiguous: the mask is then a function of the shape and the generator state alone, so a
    # replay on the (contiguous) gradient redraws it element for element.
    return F.dropout(x.contiguous(), p=p, training=True)


@contextlib.contextmanager
def _generator_state(device_type: str, state: torch.Tensor):
    outside = _get_state(device_type)
    _set_state(device_type, state)
    try:
        yield
    finally:
        _set_state(device_type, outside)


# nondeterministic_seeded: the partitioner must never recompute the forward op in the backward.
@torch.library.custom_op("megatron::tracked_dropout", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def _tracked_dropout_op(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(dropout(x) drawn under the tracker's fork, the tracker state it was drawn from)."""
    if MODEL_PARALLEL_RNG not in _TRACKER.states:
        raise RuntimeError(f"RNG state {MODEL_PARALLEL_RNG!r} is not set: call model_parallel_manual_seed(seed) first")
    state = _TRACKER.states[MODEL_PARALLEL_RNG].clone()
    with _TRACKER.fork():
        return _draw_dropout(x, p), state


@_tracked_dropout_op.register_fake
def _(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ARG001 - a fake takes the op's arguments
    size = _TRACKER.states[MODEL_PARALLEL_RNG].numel() if MODEL_PARALLEL_RNG in _TRACKER.states else 0
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(
        size, dtype=torch.uint8, device="cpu"
    )


@torch.library.custom_op("megatron::replayed_dropout", mutates_args=())
def _replayed_dropout_op(grad: torch.Tensor, p: float, state: torch.Tensor) -> torch.Tensor:
    """dropout(grad) with the mask drawn from `state` again; the generators are left as they were."""
    with _generator_state(_TRACKER.device_type, state):
        return _draw_dropout(grad, p)


@_replayed_dropout_op.register_fake
def _(grad: torch.Tensor, p: float, state: torch.Tensor) -> torch.Tensor:  # noqa: ARG001 - a fake takes the op's arguments
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


def _tracked_dropout_setup(ctx, inputs, output) -> None:
    ctx.p = inputs[1]
    ctx.save_for_backward(output[1])


def _tracked_dropout_backward(ctx, grad, _grad_state):
    (state,) = ctx.saved_tensors
    return torch.ops.megatron.replayed_dropout(grad, ctx.p, state), None


_tracked_dropout_op.register_autograd(_tracked_dropout_backward, setup_context=_tracked_dropout_setup)


def tracked_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Dropout inside a TP region: the mask comes from the tracker's model-parallel state (different
    on each TP rank). Eager: under `get_rng_tracker().fork()`; compiled: through the custom op, which
    keeps the state swap out of the graph and draws the same mask."""
    if not training or p == 0.0:
        return x
    if torch.compiler.is_compiling():
        return torch.ops.megatron.tracked_dropout(x, float(p))[0]
    with _TRACKER.fork():
        return _draw_dropout(x, p)


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_manual_seed(seed: int, device_type: str = "cpu") -> None:
    """Seed the default generators with `seed` (same on all TP ranks) and the tracker's
    model-parallel state with `seed + 2718 + tp_rank` (different on each TP rank), for the
    generator of `device_type`: the training device's."""
    if _check_device_type(device_type) == "cpu":
        torch.default_generator.manual_seed(seed)  # torch.manual_seed would reach into torch.cuda
    else:
        torch.manual_seed(seed)  # CPU and every CUDA device
    tp_seed = seed + TENSOR_PARALLEL_SEED_OFFSET + parallel_state.get_tensor_model_parallel_rank()
    _TRACKER.reset(device_type)
    _TRACKER.add(MODEL_PARALLEL_RNG, tp_seed)


def _tracker_preserving_contexts():
    """torch.utils.checkpoint context_fn: the recompute sees the tracker states of the forward.

    checkpoint(preserve_rng_state=True) already restores the default generators; this restores
    the tracker's states too, so dropout inside TP regions draws the same masks when recomputed.
    """
    at_forward: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def forward_context():
        at_forward.update(_TRACKER.get_states())
        yield

    @contextlib.contextmanager
    def recompute_context():
        current = _TRACKER.get_states()
        _TRACKER.set_states(at_forward)
        try:
            yield
        finally:
            _TRACKER.set_states(current)

    return forward_context(), recompute_context()


def checkpoint(function: Callable, *args):
    """Recompute `function(*args)` in backward instead of keeping its activations; the losses and
    gradients are identical to running it directly (all RNG states are replayed)."""
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=True, context_fn=_tracker_preserving_contexts
    )
