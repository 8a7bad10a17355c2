"""Shared builders for the convert / evaluate tests: a tiny tokenizer, a tiny GPT, its checkpoints.

Checkpoints are written the way training writes them (training.checkpointing.save_checkpoint for
TP 1 x PP 1, its nest_model_state per shard for other layouts).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from megatron_core.config import ModelSpec, ParallelConfig, recipe_from_dict
from megatron_core.checkpoint_format import write_checkpoint
from megatron_core.convert.shards import read_checkpoint, split_state
from megatron_core.training.checkpointing import megatron_args, save_checkpoint

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n"
    "    def push(self, x):\n        self.items.append(x)\n",
    "import os\nprint(os.path.join('a', 'b'))\nfor i in range(10):\n    print(i * i)\n",
] * 20


def write_tokenizer(out: Path, vocab_size: int = 300) -> tuple[Path, Path]:
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(CORPUS, vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"])
    out.mkdir(parents=True, exist_ok=True)
    tok.save_model(str(out))
    return out / "vocab.json", out / "merges.txt"


def tiny_recipe(
    tp: int = 1, pp: int = 1, untie: bool = False, gelu_tanh: bool = True, init_std: float = 0.02, **sections
):
    return recipe_from_dict(
        {
            "name": "convert-test",
            "version": 3,
            "model": {
                "num_layers": 4,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "seq_length": 32,
                "max_position_embeddings": 32,
                "hidden_dropout": 0.0,
                "attention_dropout": 0.0,
                "untie_embeddings_and_output_weights": untie,
                "bias_gelu_fusion": gelu_tanh,
                "init_method_std": init_std,
            },
            "parallel": {"world_size": tp * pp, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
            "tokenizer": {"vocab_size": 300},
            **sections,
        }
    )


PADDED_VOCAB = 512  # 300 padded to a multiple of 128 x TP 2 (also valid for TP 1)


def random_full_state(recipe, seed: int = 0) -> dict:
    """A TP 1 GPTModel's state, every tensor perturbed so biases and norms are not trivial."""
    from megatron_core.config import ParallelConfig
    from megatron_core.models.gpt import GPTModel

    model = GPTModel(
        recipe.model,
        ParallelConfig(),
        PADDED_VOCAB,
        pre_process=True,
        post_process=True,
        layer_offset=0,
        init_seed=seed,
    )
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


class MegatronCausalLM(nn.Module):
    """GPTModel with position ids filled in: forward(input_ids [b, s]) -> logits [b, s, V] (fp32). Its `gpt`
    and `spec` are what evaluate.runner.load_for_evaluation takes from a loaded model of ours."""

    def __init__(self, gpt: nn.Module, spec: ModelSpec) -> None:
        super().__init__()
        self.gpt, self.spec = gpt, spec

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        return self.gpt(input_ids, positions).float()


def load_megatron_model(load_dir) -> MegatronCausalLM:
    """Every shard of a checkpoint of any layout, merged into one single-process fp32 GPTModel (eval mode):
    the reference the converted and evaluated models are compared with."""
    from megatron_core.models.gpt import GPTModel

    ckpt = read_checkpoint(load_dir)
    gpt = GPTModel(
        ckpt.spec.to_model_config(),
        ParallelConfig(),
        ckpt.spec.padded_vocab_size,
        pre_process=True,
        post_process=True,
        layer_offset=0,
        init_seed=0,
    )
    gpt.load_state_dict({k: v.float() for k, v in ckpt.state.items()}, strict=True)
    return MegatronCausalLM(gpt.float().eval(), ckpt.spec)


def save_tp1(
    save: Path, recipe, state: dict, vocab: Path, merges: Path, iteration: int = 10, dtype: torch.dtype = torch.float32
) -> Path:
    args = megatron_args(
        recipe,
        PADDED_VOCAB,
        iteration=iteration,
        consumed_train_samples=0,
        params_dtype=str(dtype).replace("torch.", ""),
    )
    args.vocab_file, args.merge_file = str(vocab), str(merges)
    save_checkpoint(
        save,
        iteration,
        model_state={k: v.to(dtype) for k, v in state.items()},
        args=args,
        recipe=recipe,
        consumed_train_samples=0,
    )
    return save


def save_layout(
    save: Path, recipe, state: dict, vocab: Path, merges: Path, tp: int, pp: int, iteration: int = 10
) -> Path:
    args = megatron_args(recipe, PADDED_VOCAB, iteration=iteration, consumed_train_samples=0, params_dtype="float32")
    args.vocab_file, args.merge_file = str(vocab), str(merges)
    spec = dataclasses.replace(ModelSpec.from_recipe(recipe, PADDED_VOCAB), tp=tp, pp=pp, world_size=None)
    models = split_state(state, spec)
    write_checkpoint(save, models, args, iteration, {"recipe": recipe.to_dict(), "recipe_hash": recipe.hash})
    return save


# Imported by the conversion tests as fixture_*: the fixture names differ from the function names so that a
# test's `tokenizer_files` argument does not shadow an imported name.
@pytest.fixture(scope="session", name="tokenizer_files")
def fixture_tokenizer_files(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session", name="tp1_checkpoint")
def fixture_tp1_checkpoint(tmp_path_factory, tokenizer_files):
    recipe = tiny_recipe()
    state = random_full_state(recipe)
    save = save_tp1(tmp_path_factory.mktemp("ckpt") / "tp1", recipe, state, *tokenizer_files)
    return save, recipe, state


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
