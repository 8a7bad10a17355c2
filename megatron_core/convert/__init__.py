"""Megatron layout <-> Hugging Face GPT2: convert, import back, and load our own model merged."""

from megatron_core.convert.hf_to_megatron import import_hf_model
from megatron_core.convert.load import MegatronCausalLM, load_megatron_model
from megatron_core.convert.megatron_to_hf import convert_checkpoint
from megatron_core.convert.shards import MergedCheckpoint, ModelShape, read_checkpoint

__all__ = ["convert_checkpoint", "import_hf_model", "load_megatron_model", "MegatronCausalLM", "read_checkpoint",
           "MergedCheckpoint", "ModelShape"]
