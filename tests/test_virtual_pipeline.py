"""Virtual pipeline stages in one process: the chunks a PP rank builds, and a checkpoint whose
chunk count does not fit the model is refused with the reason (the multi-rank proofs are in
test_pipeline_parallel.py and test_parallel_equivalence.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_core.checkpoint_format import CheckpointError, model_entries, nest_model_state
from megatron_core.config import recipe_from_dict
from megatron_core.models.gpt import GPTModel, GPTModelChunks, build_gpt_model
from megatron_core.training.checkpointing import load_model_weights


def recipe(vpp_layers=None):
    return recipe_from_dict(
        {
            "name": "vpp",
            "version": 1,
            "tokenizer": {"vocab_size": 100},
            "model": dict(
                num_layers=4,
                hidden_size=16,
                num_attention_heads=2,
                seq_length=8,
                max_position_embeddings=8,
                make_vocab_size_divisible_by=64,
            ),
            "parallel": dict(
                world_size=2, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=vpp_layers
            ),
            "training": dict(micro_batch_size=1, global_batch_size=2),
        }
    )


def test_a_rank_builds_megatrons_chunks_with_the_single_process_weights():
    r = recipe(vpp_layers=1)
    chunks = build_gpt_model(r.model, r.parallel, 128, init_seed=5)  # one process builds PP rank 0
    whole = GPTModel(r.model, r.parallel.__class__(), 128, init_seed=5)
    assert isinstance(chunks, GPTModelChunks) and chunks.layer_ranges == [range(0, 1), range(2, 3)]
    assert chunks.chunks[0].pre_process and not chunks.chunks[1].pre_process
    # A lone process answers as first and last stage, so its last chunk also holds the head here.
    assert [c.post_process for c in chunks.chunks] == [False, True]
    reference = dict(whole.named_parameters())
    for name, param in chunks.named_parameters():
        assert torch.equal(param, reference[chunks.global_parameter_name(name)]), name
    assert isinstance(build_gpt_model(recipe().model, recipe().parallel, 128), GPTModel)


def _load(model, state):
    reloaded = []
    optimizer = SimpleNamespace(reload_model_params=lambda: reloaded.append(True))
    load_model_weights(state, model.chunks, optimizer, "CKPT", padded_vocab_size=128, tensor_model_parallel_size=1)
    return reloaded


def test_resume_loads_chunks_and_refuses_a_chunk_count_that_does_not_fit():
    r = recipe(vpp_layers=1)
    chunks = build_gpt_model(r.model, r.parallel, 128, init_seed=5)
    saved = build_gpt_model(r.model, r.parallel, 128, init_seed=6)
    state = model_entries([nest_model_state(c.state_dict()) for c in saved.chunks])
    assert set(state) == {"model0", "model1"}
    assert _load(chunks, state) == [True]
    for mine, theirs in zip(chunks.parameters(), saved.parameters()):
        assert torch.equal(mine, theirs)
    plain = build_gpt_model(recipe().model, recipe().parallel, 128)
    with pytest.raises(CheckpointError, match="holds 2 model chunk\\(s\\) per rank but this run's model has 1"):
        _load(plain, state)
    with pytest.raises(CheckpointError, match="holds 1 model chunk\\(s\\) per rank but this run's model has 2"):
        _load(chunks, {"model": nest_model_state(plain.state_dict())})


def test_the_wrappers_run_the_models_own_chunks_and_forward_nothing_else():
    """The model protocol: `chunks` is the model's own (a GPTModel is its one chunk), the optimizer's
    names keep the `chunks.<c>.` prefix, and the data-parallel wrapper forwards no other attribute."""
    from distributed_utils import LocalModel

    from megatron_core.distributed import DistributedDataParallel

    r = recipe(vpp_layers=1)
    chunks = build_gpt_model(r.model, r.parallel, 128, init_seed=5)
    wrapped = DistributedDataParallel(chunks, r.parallel)
    assert list(wrapped.chunks) == list(chunks.chunks) and wrapped.module is chunks
    assert all(name.startswith(("chunks.0.", "chunks.1.")) for name, _ in wrapped.module.named_parameters())
    with pytest.raises(AttributeError):
        wrapped.describe_backends()  # the inner model's, reached as wrapped.module.describe_backends()
    plain = build_gpt_model(recipe().model, recipe().parallel, 128)
    assert LocalModel(plain).chunks == [plain] and DistributedDataParallel(plain, r.parallel).chunks == [plain]
