"""Our own GPT model, merged from a checkpoint of any layout, on the CPU (one process, TP 1 x PP 1)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_core.config import ModelConfig, ParallelConfig
from megatron_core.convert.shards import ModelShape, read_checkpoint


def model_config_for(shape: ModelShape, attention_backend: str = ModelConfig.attention_backend) -> ModelConfig:
    return ModelConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        ffn_hidden_size=shape.ffn_hidden_size,
        seq_length=shape.max_position_embeddings,
        max_position_embeddings=shape.max_position_embeddings,
        layernorm_epsilon=shape.layernorm_epsilon,
        bias_gelu_fusion=shape.gelu_approximation == "tanh",
        openai_gelu=False,
        untie_embeddings_and_output_weights=not shape.tied_embeddings,
        attention_backend=attention_backend,
    )


class MegatronCausalLM(nn.Module):
    """GPTModel with position ids filled in: forward(input_ids [b, s]) -> logits [b, s, V] (fp32)."""

    def __init__(self, gpt: nn.Module, shape: ModelShape, iteration, recipe_hash: Optional[str]) -> None:
        super().__init__()
        self.gpt, self.shape, self.iteration, self.recipe_hash = gpt, shape, iteration, recipe_hash

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        return self.gpt(input_ids, positions).float()


def load_megatron_model(load_dir, iteration=None, dtype: torch.dtype = torch.float32,
                        attention_backend: str = ModelConfig.attention_backend, fusions=None) -> MegatronCausalLM:
    """Read + merge every shard of one iteration and load it into a single-process GPTModel (eval mode)."""
    from megatron_core.models.gpt import GPTModel

    ckpt = read_checkpoint(load_dir, iteration)
    config = model_config_for(ckpt.shape, attention_backend)
    gpt = GPTModel(config, ParallelConfig(), ckpt.shape.padded_vocab_size, pre_process=True, post_process=True,
                   layer_offset=0, fusions=fusions, init_seed=0)
    gpt.load_state_dict({k: v.to(dtype) for k, v in ckpt.state.items()}, strict=True)
    gpt.to(dtype).eval()
    print(f"load: GPTModel {ckpt.shape.num_layers}x{ckpt.shape.hidden_size} from {ckpt.source} "
          f"(TP {ckpt.tensor_parallel} x PP {ckpt.pipeline_parallel}), {gpt.describe_backends()}", flush=True)
    return MegatronCausalLM(gpt, ckpt.shape, ckpt.iteration, ckpt.recipe_hash)
