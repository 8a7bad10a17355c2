"""Shared by the training and checkpointing tests: a tiny learnable .bin/.idx corpus and a tiny recipe."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_core.checkpoint_format import MODEL_FILENAME, iteration_dir, rank_dirname
from megatron_core.config import load_recipe
from megatron_core.data.indexed_dataset import IndexedDatasetBuilder

VOCAB_SIZE = 100

# Megatron-LM's own preprocessing output (the golden fixture; its README says how it was made).
MEGATRON_PREPROCESS_FIXTURE = Path(__file__).resolve().parent / "fixtures" / "megatron-preprocess"

TINY_OVERRIDES = [
    "num_layers=2",
    "hidden_size=32",
    "num_attention_heads=2",
    "seq_length=32",
    "max_position_embeddings=32",
    "micro_batch_size=2",
    "global_batch_size=4",
    "train_iters=16",
    "lr=3e-3",
    "lr_warmup_iters=2",
    "lr_decay_style=cosine",
    "min_lr=3e-4",
    "training.log_interval=1",
    "eval_interval=8",
    "eval_iters=2",
    "save_interval=8",
    "hidden_dropout=0.1",
    "attention_dropout=0.1",
    "fusions=torch",
    "device=cpu",
]


def write_corpus(prefix: Path, documents: int = 120, seed: int = 0) -> str:
    """Arithmetic sequences mod 97: easy to learn, so a few iterations lower the loss."""
    rng = np.random.RandomState(seed)
    prefix = str(prefix)
    with IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16) as builder:
        for _ in range(documents):
            start, stride = rng.randint(0, 97), rng.randint(1, 4)
            builder.add_item(np.array([(start + stride * i) % 97 for i in range(rng.randint(20, 100))]))
            builder.end_document()
        builder.finalize(prefix + ".idx")
    return prefix


def tiny_recipe(*overrides: str):
    return load_recipe("smoke", [*TINY_OVERRIDES, *overrides])


def train_losses(metrics: list[dict], kind: str = "train") -> dict[int, float]:
    return {m["iteration"]: m["lm_loss"] for m in metrics if m["type"] == kind}


def train_below_checks(
    recipe, run_dir, data_prefix, *, load=None, save_optim: bool = True, vocab_size: int = VOCAB_SIZE
) -> None:
    """What train(recipe, run_dir, data_prefix, ...) runs, below its recipe checks: the real Trainer,
    model, optimizer and loss scaler (test_parallel_equivalence's fit/build, i.e. pretrain_gpt's
    build_model_and_optimizer), the corpus's datasets, checkpoints in run_dir/checkpoints loaded from
    there unless `load`. For fp16's machinery on the CPU, where train() refuses fp16."""
    import test_parallel_equivalence as proof
    from megatron_core.pretrain_gpt import build_datasets

    assert vocab_size == proof.VOCAB, "the harness pads the vocabulary of its own VOCAB"
    run_dir = Path(run_dir)
    datasets = build_datasets(recipe, data_prefix, run_dir / "index-cache")
    save = run_dir / "checkpoints"
    proof.fit(recipe, run_dir, save=save, load=load or save, datasets=datasets, save_optim=save_optim)


# Fixtures for the modules that train: `from training_fixtures import fixture_corpus, fixture_one_thread` makes
# `corpus` and `one_thread` fixtures of the importing module (the function and fixture names differ so that a
# test's `corpus` argument does not shadow an imported name).


@pytest.fixture(scope="module", autouse=True, name="one_thread")
def fixture_one_thread():
    """Losses are compared bit for bit: every run of a module (and its subprocesses) uses one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", name="corpus")
def fixture_corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("data") / "corpus")


def checkpoint_file(save, iteration, tp_rank: int = 0, pp_rank: int = 0, pp_size: int = 1):
    """Where a published iteration keeps one rank's model file (the tests open, corrupt or compare it)."""
    return iteration_dir(save, iteration) / rank_dirname(tp_rank, pp_rank, pp_size) / MODEL_FILENAME
