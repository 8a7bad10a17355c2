"""Megatron layout <-> Hugging Face GPT2: convert, import back, and read a checkpoint of any layout merged.

Names are imported lazily, so `python -m megatron_core.convert.hf_to_megatron` runs its module once.
"""

import importlib

_EXPORTS = {
    "convert_checkpoint": "megatron_core.convert.megatron_to_hf",
    "import_hf_model": "megatron_core.convert.hf_to_megatron",
    "read_checkpoint": "megatron_core.convert.shards",
    "MergedCheckpoint": "megatron_core.convert.shards",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'megatron_core.convert' has no attribute {name!r}")
