"""A slim, typed parallel-GPT core in the spirit of Megatron-LM's `megatron/core`."""

__version__ = "0.1.0"
