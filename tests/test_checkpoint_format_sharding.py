"""The model declares its sharding: `parameter_sharding` reads the tensor-parallel layers' own attributes,
and checkpoint merging and splitting follow that map (no table of names to keep in step)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from megatron_core.checkpoint_format import (
    CheckpointError,
    TensorSharding,
    layer_generic_name,
    merge_rank_states,
    split_rank_state,
)
from megatron_core.config import ModelConfig, ParallelConfig
from megatron_core.models import gpt
from megatron_core.models.gpt import GPTModel, parameter_sharding
from megatron_core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

VOCAB = 64


def tiny_config(**overrides) -> ModelConfig:
    return ModelConfig(
        **{
            **dict(
                num_layers=2,
                hidden_size=16,
                num_attention_heads=2,
                ffn_hidden_size=32,
                seq_length=8,
                max_position_embeddings=8,
            ),
            **overrides,
        }
    )


def attributes_of(param: torch.Tensor) -> TensorSharding:
    """What the layer set on the parameter, read directly."""
    if not getattr(param, "tensor_model_parallel", False):
        return TensorSharding(None, False)
    return TensorSharding(param.partition_dim, getattr(param, "vocab_padded", False))


@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
def test_the_map_is_the_layers_own_attributes(untie):
    config = tiny_config(untie_embeddings_and_output_weights=untie)
    sharding = parameter_sharding(config)
    # Real (CPU) stages of the 2-layer model: the whole model and a last stage that holds the head alone.
    stages = [
        GPTModel(config, ParallelConfig(), VOCAB),
        GPTModel(config, ParallelConfig(), VOCAB, pre_process=False, post_process=True, layer_offset=0),
    ]
    declared = {layer_generic_name(n): attributes_of(p) for s in stages for n, p in s.named_parameters()}
    assert sharding == declared
    # The GPT's splits as Megatron lays them out (what the deleted name tables said).
    layer = "encoder.layers.*."
    split = {name: s.partition_dim for name, s in sharding.items() if s.partition_dim is not None}
    head = "output_layer.weight" if untie else "word_embeddings_for_head.weight"
    assert split == {
        "embedding.word_embeddings.weight": 0,
        head: 0,
        layer + "self_attention.query_key_value.weight": 0,
        layer + "self_attention.query_key_value.bias": 0,
        layer + "mlp.dense_h_to_4h.weight": 0,
        layer + "mlp.dense_h_to_4h.bias": 0,
        layer + "self_attention.dense.weight": 1,
        layer + "mlp.dense_4h_to_h.weight": 1,
    }
    assert {n for n, s in sharding.items() if s.vocab_padded} == {"embedding.word_embeddings.weight", head}
    assert ("output_layer.weight" in sharding) == untie and ("word_embeddings_for_head.weight" in sharding) != untie


def test_a_new_tensor_parallel_layer_is_merged_and_split_without_a_table_edit(monkeypatch):
    original_init = gpt.MLP.__init__

    def with_gate(self, config, parallel, ops, output_std):  # a SwiGLU-style gate and an extra row projection
        original_init(self, config, parallel, ops, output_std)
        self.gate = ColumnParallelLinear(config.hidden_size, config.ffn_size, initialize=False)
        self.back = RowParallelLinear(config.ffn_size, config.hidden_size, initialize=False)

    monkeypatch.setattr(gpt.MLP, "__init__", with_gate)
    sharding = parameter_sharding(tiny_config())
    assert sharding["encoder.layers.*.mlp.gate.weight"] == TensorSharding(0)
    assert sharding["encoder.layers.*.mlp.back.weight"] == TensorSharding(1)
    assert sharding["encoder.layers.*.mlp.back.bias"] == TensorSharding(None)

    full = {
        "encoder.layers.0.mlp.gate.weight": torch.arange(32.0 * 16).view(32, 16),
        "encoder.layers.0.mlp.back.weight": torch.arange(16.0 * 32).view(16, 32),
        "encoder.layers.0.mlp.back.bias": torch.arange(16.0),
    }
    ranks = [split_rank_state(full, 2, 1, t, 0, num_layers=1, tied=True, sharding=sharding) for t in range(2)]
    assert ranks[1]["encoder.layers.0.mlp.gate.weight"].shape == (16, 16)
    assert_close(ranks[1]["encoder.layers.0.mlp.back.weight"], full["encoder.layers.0.mlp.back.weight"][:, 16:])
    assert_close(ranks[1]["encoder.layers.0.mlp.back.bias"], full["encoder.layers.0.mlp.back.bias"])
    merged = merge_rank_states({(t, 0): ranks[t] for t in range(2)}, 2, 1, sharding)
    assert merged.keys() == full.keys() and all(torch.equal(merged[n], full[n]) for n in full)


def test_a_weight_the_model_does_not_have_is_refused():
    sharding = parameter_sharding(tiny_config())
    stage = {"encoder.layers.0.mlp.gate.weight": torch.zeros(4, 4)}
    with pytest.raises(CheckpointError, match=r"'encoder.layers.0.mlp.gate.weight', which this GPT model does not"):
        merge_rank_states({(0, 0): stage, (1, 0): stage}, 2, 1, sharding)
    with pytest.raises(CheckpointError, match="mlp.gate.weight"):
        split_rank_state(stage, 2, 1, 0, 0, num_layers=1, tied=True, sharding=sharding)
