"""ModelSpec: one shape-and-layout value built from a recipe, a checkpoint's args or an HF config, and
one problems() that recipe validation, GPTModel and the converters all refuse with."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_core.config import ModelSpec, ParallelConfig, recipe_from_dict
from megatron_core.errors import UserError

SPEC = ModelSpec(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=256,
    max_position_embeddings=32,
    seq_length=32,
    padded_vocab_size=512,
)


def _recipe(model=None, parallel=None, training=None):
    return recipe_from_dict(
        {
            "name": "spec-test",
            "version": 1,
            "model": {
                "num_layers": 4,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "seq_length": 32,
                "max_position_embeddings": 32,
                "untie_embeddings_and_output_weights": True,
                "bias_gelu_fusion": False,
                **(model or {}),
            },
            "parallel": {
                "world_size": 8,
                "tensor_model_parallel_size": 2,
                "pipeline_model_parallel_size": 2,
                "sequence_parallel": True,
                **(parallel or {}),
            },
            "training": {"micro_batch_size": 1, "global_batch_size": 4, **(training or {})},
            "tokenizer": {"vocab_size": 300},
        }
    )


def test_problems_name_every_key_and_number_that_disagrees():
    bad = dataclasses.replace(
        SPEC,
        num_attention_heads=6,
        hidden_size=60,
        ffn_hidden_size=90,
        num_layers=5,
        padded_vocab_size=501,
        tp=4,
        pp=2,
        world_size=12,
        sequence_parallel=True,
        seq_length=30,
    )
    assert bad.problems() == [
        "parallel.world_size 12 is not divisible by tensor_model_parallel_size 4 x pipeline_model_parallel_size 2",
        "model.num_attention_heads 6 is not divisible by TP 4",
        "model.ffn_hidden_size 90 is not divisible by TP 4",
        "padded vocab size 501 is not divisible by TP 4",
        "model.num_layers 5 is not divisible by PP 2",
        "model.seq_length 30 is not divisible by TP 4 (sequence parallel)",
    ]
    # sizes below 1 are all that is said (the other rules would divide by them)
    assert dataclasses.replace(SPEC, tp=0, num_layers=0).problems() == [
        "model.num_layers must be >= 1 (got 0)",
        "parallel.tensor_model_parallel_size must be >= 1 (got 0)",
    ]
    assert dataclasses.replace(SPEC, layers_per_virtual_stage=3, pp=2).problems() == [
        "model.num_layers 4 is not divisible by pipeline_model_parallel_size 2 x "
        "parallel.num_layers_per_virtual_pipeline_stage 3 = 6"
    ]
    assert (
        SPEC.problems() == []
        and dataclasses.replace(SPEC, tp=4, pp=2, layers_per_virtual_stage=1, world_size=16).problems() == []
    )
    with pytest.raises(UserError, match=r"^model.num_layers 4 is not divisible by PP 3; choose a --pp$"):
        dataclasses.replace(SPEC, pp=3).check("choose a --pp")


def test_a_recipe_its_checkpoint_args_and_its_hf_config_give_the_same_spec():
    from megatron_core.training.checkpointing import megatron_args

    recipe = _recipe(parallel={"num_layers_per_virtual_pipeline_stage": 1})
    spec = ModelSpec.from_recipe(recipe, padded_vocab_size=512)
    assert (spec.tp, spec.pp, spec.world_size, spec.data_parallel_size, spec.virtual_stages) == (2, 2, 8, 2, 2)
    assert (spec.gelu_approximation, spec.tied_embeddings, spec.ffn_hidden_size) == ("none", False, 256)
    args = megatron_args(recipe, 512, iteration=1, consumed_train_samples=0, params_dtype="float32")
    assert ModelSpec.from_args(args) == spec
    # what import-hf writes into a checkpoint reads back as the same spec
    written = ModelSpec.from_args(spec.to_args())
    assert written == dataclasses.replace(spec, sequence_parallel=False, world_size=None)
    assert written.to_args().virtual_pipeline_model_parallel_size == 2
    hf = {
        "model_type": "gpt2",
        "n_layer": 4,
        "n_embd": 64,
        "n_head": 4,
        "n_inner": None,
        "n_positions": 32,
        "vocab_size": 512,
        "activation_function": "gelu",
        "tie_word_embeddings": False,
        "layer_norm_epsilon": 1e-5,
    }
    assert ModelSpec.from_hf_config(hf, tp=2, pp=2) == dataclasses.replace(
        spec, layers_per_virtual_stage=None, sequence_parallel=False, world_size=None
    )
    # and the model section it builds has this shape again
    parallel = ParallelConfig(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        sequence_parallel=True,
        num_layers_per_virtual_pipeline_stage=1,
    )
    assert ModelSpec.from_configs(spec.to_model_config(), parallel, 512, world_size=8) == spec
    with pytest.raises(UserError, match="checkpoint args lack hidden_size, num_layers"):
        ModelSpec.from_args(None)
    with pytest.raises(UserError, match="activation_function 'relu' has no Megatron GeLU equivalent"):
        ModelSpec.from_hf_config({**hf, "activation_function": "relu"})


def test_the_recipe_the_model_and_the_converter_refuse_a_layout_with_the_same_line(tmp_path):
    """One rule, three entry points: a recipe, a GPTModel built from that recipe's sections (a single
    process may build any pipeline stage), and import-hf of a model of that shape."""
    from megatron_core.convert import import_hf_model
    from megatron_core.models.gpt import GPTModel

    line = "model.num_layers 4 is not divisible by PP 3"
    with pytest.raises(UserError, match=line):
        _recipe(
            parallel={
                "world_size": 3,
                "tensor_model_parallel_size": 1,
                "pipeline_model_parallel_size": 3,
                "sequence_parallel": False,
            }
        )
    ok = _recipe(
        parallel={
            "world_size": 1,
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "sequence_parallel": False,
        }
    )
    with pytest.raises(UserError, match=line):
        GPTModel(ok.model, dataclasses.replace(ok.parallel, pipeline_model_parallel_size=3), 512)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(
        json.dumps(
            {"model_type": "gpt2", "n_layer": 4, "n_embd": 64, "n_head": 4, "n_positions": 32, "vocab_size": 512}
        )
    )
    with pytest.raises(UserError, match=line + ".*; choose a --tp/--pp that divides the model"):
        import_hf_model(tmp_path / "hf", tmp_path / "ckpt", pp=3)
    assert not (tmp_path / "ckpt").exists()
