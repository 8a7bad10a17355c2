"""Weight mapping between our canonical Megatron names and Hugging Face GPT2 names (both ways).

Megatron linears are [out, in]; GPT2's Conv1D stores [in, out], so every linear weight transposes.
Megatron's QKV rows go per head [q, k, v] ([np, 3, hn]); GPT2's c_attn output is [Q | K | V]
([3, np, hn]).
"""

from __future__ import annotations

import torch

from megatron_core.config import ModelSpec

# Megatron layer-local name -> (GPT2 layer-local name, transposed?)
_LAYER_MAP = {
    "input_layernorm.weight": ("ln_1.weight", False),
    "input_layernorm.bias": ("ln_1.bias", False),
    "self_attention.dense.weight": ("attn.c_proj.weight", True),
    "self_attention.dense.bias": ("attn.c_proj.bias", False),
    "post_attention_layernorm.weight": ("ln_2.weight", False),
    "post_attention_layernorm.bias": ("ln_2.bias", False),
    "mlp.dense_h_to_4h.weight": ("mlp.c_fc.weight", True),
    "mlp.dense_h_to_4h.bias": ("mlp.c_fc.bias", False),
    "mlp.dense_4h_to_h.weight": ("mlp.c_proj.weight", True),
    "mlp.dense_4h_to_h.bias": ("mlp.c_proj.bias", False),
}
_QKV = ("self_attention.query_key_value.weight", "attn.c_attn.weight")
_QKV_BIAS = ("self_attention.query_key_value.bias", "attn.c_attn.bias")
_GLOBAL_MAP = {
    "embedding.word_embeddings.weight": "transformer.wte.weight",
    "embedding.position_embeddings.weight": "transformer.wpe.weight",
    "encoder.final_layernorm.weight": "transformer.ln_f.weight",
    "encoder.final_layernorm.bias": "transformer.ln_f.bias",
    "output_layer.weight": "lm_head.weight",
}


def _qkv_to_hf(t: torch.Tensor, shape: ModelSpec) -> torch.Tensor:
    np_, hn = shape.num_attention_heads, shape.head_dim
    rest = t.shape[1:]
    return t.view(np_, 3, hn, *rest).transpose(0, 1).reshape(t.shape)


def _qkv_from_hf(t: torch.Tensor, shape: ModelSpec) -> torch.Tensor:
    np_, hn = shape.num_attention_heads, shape.head_dim
    rest = t.shape[1:]
    return t.view(3, np_, hn, *rest).transpose(0, 1).reshape(t.shape)


def megatron_to_gpt2_state(state: dict, shape: ModelSpec) -> dict:
    """Canonical merged Megatron state -> GPT2LMHeadModel state (no lm_head when tied)."""
    out = {}
    for L in range(shape.num_layers):
        src, dst = f"encoder.layers.{L}.", f"transformer.h.{L}."
        for name, (hf_name, transpose) in _LAYER_MAP.items():
            t = state[src + name]
            out[dst + hf_name] = t.t() if transpose else t
        out[dst + _QKV[1]] = _qkv_to_hf(state[src + _QKV[0]], shape).t()
        out[dst + _QKV_BIAS[1]] = _qkv_to_hf(state[src + _QKV_BIAS[0]], shape)
    for name, hf_name in _GLOBAL_MAP.items():
        if name in state:
            out[hf_name] = state[name]
    return {k: v.contiguous() for k, v in out.items()}


def gpt2_to_megatron_state(hf: dict, shape: ModelSpec) -> dict:
    """GPT2LMHeadModel state -> canonical Megatron state (inverse of megatron_to_gpt2_state), in
    GPTModel.state_dict() order: embeddings, layers, final norm, output layer."""
    out = {}
    for name in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight"):
        out[name] = hf[_GLOBAL_MAP[name]]
    for L in range(shape.num_layers):
        src, dst = f"transformer.h.{L}.", f"encoder.layers.{L}."
        out[dst + "input_layernorm.weight"] = hf[src + "ln_1.weight"]
        out[dst + "input_layernorm.bias"] = hf[src + "ln_1.bias"]
        out[dst + _QKV[0]] = _qkv_from_hf(hf[src + _QKV[1]].t().contiguous(), shape)
        out[dst + _QKV_BIAS[0]] = _qkv_from_hf(hf[src + _QKV_BIAS[1]], shape)
        for name, (hf_name, transpose) in _LAYER_MAP.items():
            if name.startswith("input_layernorm"):
                continue
            t = hf[src + hf_name]
            out[dst + name] = t.t() if transpose else t
    for name in ("encoder.final_layernorm.weight", "encoder.final_layernorm.bias"):
        out[name] = hf[_GLOBAL_MAP[name]]
    if not shape.tied_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    return {k: v.contiguous() for k, v in out.items()}
