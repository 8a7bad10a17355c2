"""RNG states for dropout under tensor parallelism, and RNG-preserving activation recompute.

Megatron's rule: dropout OUTSIDE tensor-parallel regions (on replicated activations) must draw
the same mask on every TP rank, so it uses the default generator, seeded identically; dropout
INSIDE a TP region (attention probabilities of this rank's heads, sequence-parallel chunks) must
differ across TP ranks, so it runs under `get_rng_tracker().fork()`, whose generator is seeded
with `seed + 2718 + tp_rank`.

The tracker swaps states of the default generator of one device type: CUDA when available,
else the CPU generator (plain torch.Generator byte states), so the same code runs on a laptop.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.utils.checkpoint

from megatron_core import parallel_state

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Megatron's offset between the data-parallel seed and the tensor-parallel seeds.
TENSOR_PARALLEL_SEED_OFFSET = 2718


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _get_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_state(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states that can be swapped in for the default generator with `fork`."""

    def __init__(self, device_type: Optional[str] = None) -> None:
        self.device_type = device_type or _default_device_type()
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()

    def reset(self, device_type: Optional[str] = None) -> None:
        self.device_type = device_type or _default_device_type()
        self.states.clear()
        self.seeds.clear()

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


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_manual_seed(seed: int, device_type: Optional[str] = None) -> None:
    """Seed the default generators with `seed` (same on all TP ranks) and the tracker's
    model-parallel state with `seed + 2718 + tp_rank` (different on each TP rank)."""
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
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                                             context_fn=_tracker_preserving_contexts)
