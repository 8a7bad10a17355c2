"""Models built from the tensor-parallel layers."""

from megatron_core.models.gpt import GPTModel

__all__ = ["GPTModel"]
