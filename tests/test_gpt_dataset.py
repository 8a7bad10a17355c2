"""GPT dataset: same samples, same order as megatron-core's GPTDataset; cache reuse; index algorithms."""

import os
import sys
import types

import numpy as np
import pytest
import torch

from megatron_core.data import blending, gpt_dataset
from megatron_core.data.indexed_dataset import IndexedDatasetBuilder
from megatron_core.errors import UserError


def _megatron_datasets_modules():
    """megatron-core's real dataset code, imported without `megatron/core/__init__.py`.

    That package init imports the whole model stack (about a minute of CPU here); the dataset
    modules need only parallel_state and utils, so the two packages are registered bare.
    """
    import megatron

    root = list(megatron.__path__)[0]
    if "megatron.core.datasets.gpt_dataset" not in sys.modules and "megatron.core" not in sys.modules:
        core = types.ModuleType("megatron.core")
        core.__path__ = [os.path.join(root, "core")]
        sys.modules["megatron.core"] = core
        import megatron.core.parallel_state  # noqa: F401  (breaks utils <-> parallel_state cycle)
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets import helpers

    return BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig, helpers


class _StubTokenizer:
    """The attributes megatron-core's GPTDatasetConfig reads (used only on its side)."""

    vocab_size = 1000
    eod = 0
    unique_identifiers = {"class": "StubTokenizer"}


def _write_dataset(prefix, num_docs, rng, max_len=300):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(num_docs):
        builder.add_item(rng.integers(1, 1000, int(rng.integers(1, max_len))).astype(np.uint16))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptdata")
    rng = np.random.default_rng(0)
    return {"a": _write_dataset(str(root / "a"), 200, rng), "b": _write_dataset(str(root / "b"), 60, rng), "root": root}


def _megatron(data_prefix, split, seq_length, sizes, seed, cache):
    Builder, GPTDataset, GPTDatasetConfig, _ = _megatron_datasets_modules()
    prefixes, weights = blending.parse_data_prefix(data_prefix)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(prefixes, weights),
        split=split,
        path_to_cache=None if cache is None else str(cache),
        tokenizer=_StubTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    assert not config.mock
    return Builder(GPTDataset, list(sizes), lambda: True, config).build()


def _assert_same(reference, ours):
    assert (reference is None) == (ours is None)
    if reference is None:
        return
    assert len(reference) == len(ours)
    for i in range(len(reference)):
        expected, got = reference[i], ours[i]
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(expected[key].long(), got[key]), (i, key)
            assert got[key].dtype == torch.int64


CASES = {
    # one epoch for every split
    "single_epoch": ("a", "90,8,2", 64, (100, 20, 5), 1234),
    # many epochs: last epoch merged into the shuffle (train) or separate (valid/test)
    "multi_epoch": ("a", "90,8,2", 64, (2000, 200, 50), 1234),
    # an empty test part gives None; 3 epochs with a short last one shuffled apart
    "empty_test_split": ("a", "90,10,0", 32, (3000, 100, 0), 7),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_samples_as_megatron_core(case, data, tmp_path):
    name, split, seq_length, sizes, seed = CASES[case]
    reference = _megatron(data[name], split, seq_length, sizes, seed, tmp_path / "megatron")
    ours = gpt_dataset.build_gpt_datasets(
        data[name], split=split, seq_length=seq_length, num_samples=sizes, seed=seed, cache_dir=str(tmp_path / "ours")
    )
    for r, o in zip(reference, ours):
        _assert_same(r, o)
        if o is not None:
            r_idx = (r.document_index, r.sample_index, r.shuffle_index)
            o_idx = (o.document_index, o.sample_index, o.shuffle_index)
            for a, b in zip(r_idx, o_idx):
                assert a.dtype == b.dtype and np.array_equal(a, b)
    if case == "empty_test_split":
        assert ours[2] is None


def test_epoch_plans_cover_both_last_epoch_rules(data):
    from megatron_core.data.indexed_dataset import IndexedDataset

    lengths = IndexedDataset(data["a"]).sequence_lengths
    tokens = int(lengths[:180].sum())
    per_epoch = (tokens - 1) // 64
    merged = gpt_dataset.plan_epochs(tokens, 2 * per_epoch - 1, 64)
    separate = gpt_dataset.plan_epochs(tokens, per_epoch + 5, 64)
    assert merged.num_epochs == 2 and not merged.separate_last_epoch
    assert separate.num_epochs == 2 and separate.separate_last_epoch


def test_blend_of_two_prefixes_matches_megatron_core(data, tmp_path):
    blend = ["0.3", data["a"], "0.7", data["b"]]
    sizes = (800, 60, 10)
    # megatron-core's BlendedDataset saves its cache only under torch.distributed; without a
    # cache path it builds in memory (its GPTDatasets then cache beside the data files).
    reference = _megatron(blend, "90,8,2", 32, sizes, 3, None)
    ours = gpt_dataset.build_gpt_datasets(
        blend, split="90,8,2", seq_length=32, num_samples=sizes, seed=3, cache_dir=str(tmp_path / "ours")
    )
    for r, o in zip(reference, ours):
        assert np.array_equal(r.dataset_index, o.dataset_index)
        assert np.array_equal(r.dataset_sample_index, o.dataset_sample_index)
        _assert_same(r, o)


def test_sample_index_equals_megatron_helper_with_empty_documents():
    *_, helpers = _megatron_datasets_modules()
    rng = np.random.default_rng(1)
    for trial in range(100):
        lengths = rng.integers(0, 50, int(rng.integers(1, 40))).astype(np.int32)
        lengths[0] = 0  # an empty first document: Megatron's first row stays (0, 0)
        lengths[-1] += 2
        epochs, seq_length = int(rng.integers(1, 4)), int(rng.integers(2, 30))
        document_index = np.tile(np.arange(len(lengths), dtype=np.int32), epochs)
        np.random.RandomState(trial).shuffle(document_index)
        tokens = epochs * int(lengths.sum())
        expected = helpers.build_sample_idx(lengths, document_index, seq_length, epochs, int(lengths.sum()), True, True)
        got = gpt_dataset.build_sample_index(lengths, document_index, seq_length, tokens)
        assert got.dtype == expected.dtype and np.array_equal(got, expected), trial


def test_int64_sample_index_for_huge_datasets_has_the_same_values(monkeypatch):
    """The int64 path (more than 2**31 samples, documents or tokens in one document) computes what the
    int32 path does; forced here by lowering the limit."""
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 300, 50).astype(np.int32)
    document_index = np.tile(np.arange(50, dtype=np.int32), 3)
    np.random.RandomState(0).shuffle(document_index)
    tokens = 3 * int(lengths.sum())
    for seq_length in (16, 37):
        narrow = gpt_dataset.build_sample_index(lengths, document_index, seq_length, tokens)
        monkeypatch.setattr(gpt_dataset, "INT32_INDEX_LIMIT", 0)
        wide = gpt_dataset.build_sample_index(lengths, document_index, seq_length, tokens)
        monkeypatch.undo()
        assert narrow.dtype == np.int32 and wide.dtype == np.int64 and np.array_equal(narrow, wide)


def test_blending_indices_equal_megatron_helper():
    *_, helpers = _megatron_datasets_modules()
    rng = np.random.default_rng(2)
    for _ in range(20):
        weights = blending.normalize(list(rng.random(int(rng.integers(2, 5))) + 0.05))
        size = int(rng.integers(1, 2000))
        expected_ids = np.zeros(size, np.int16)
        expected_samples = np.zeros(size, np.int64)
        helpers.build_blending_indices(expected_ids, expected_samples, np.array(weights), len(weights), size, False)
        ids, samples = blending.build_blending_indices(weights, size)
        assert np.array_equal(ids, expected_ids) and np.array_equal(samples, expected_samples)


def count_index_builds(monkeypatch: pytest.MonkeyPatch) -> list:
    """One entry per index build from now on (a split whose cache is reused adds none)."""
    calls: list = []
    real = gpt_dataset.build_gpt_indices
    monkeypatch.setattr(gpt_dataset, "build_gpt_indices", lambda *args, **kw: calls.append(args) or real(*args, **kw))
    return calls


def test_cache_is_reused_and_seed_changes_its_name(data, tmp_path, monkeypatch):
    kwargs = dict(split="90,8,2", seq_length=64, num_samples=(300, 20, 5), cache_dir=str(tmp_path))
    builds = count_index_builds(monkeypatch)
    first = gpt_dataset.build_gpt_datasets(data["a"], seed=1, **kwargs)
    assert len(builds) == 3
    files = sorted(os.listdir(tmp_path))
    mtimes = {f: os.stat(tmp_path / f).st_mtime_ns for f in files}
    second = gpt_dataset.build_gpt_datasets(data["a"], seed=1, **kwargs)
    assert len(builds) == 3
    assert sorted(os.listdir(tmp_path)) == files
    assert {f: os.stat(tmp_path / f).st_mtime_ns for f in files} == mtimes
    assert isinstance(second[0].shuffle_index, np.memmap)
    assert torch.equal(first[0][7]["tokens"], second[0][7]["tokens"])
    assert not any(".tmp" in f for f in files)

    gpt_dataset.build_gpt_datasets(data["a"], seed=2, **kwargs)
    assert len(builds) == 6
    new_files = set(os.listdir(tmp_path)) - set(files)
    assert len(new_files) == 3 * 4  # three arrays + description per split, under new hashed names


def test_samples_per_split_and_split_string():
    assert gpt_dataset.samples_per_split(150000, 192, 200, 10) == (28_800_000, (750 + 1) * 10 * 192, 1920)
    assert gpt_dataset.split_sequence_ranges("969,30,1", 2000) == [(0, 1938), (1938, 1998), (1998, 2000)]
    assert gpt_dataset.split_sequence_ranges("1,0,0", 10)[1:] == [None, None]


def test_bad_input_messages(data, tmp_path):
    with pytest.raises(UserError, match="split"):
        gpt_dataset.build_gpt_datasets(
            data["a"], split="a,b", seq_length=8, num_samples=(1, 1, 1), seed=1, cache_dir=str(tmp_path)
        )
    with pytest.raises(UserError, match="not found"):
        gpt_dataset.build_gpt_datasets(
            str(tmp_path / "missing"), split="1", seq_length=8, num_samples=(1, 0, 0), seed=1, cache_dir=str(tmp_path)
        )
    with pytest.raises(UserError, match="0 of 200 documents"):
        gpt_dataset.build_gpt_datasets(
            data["a"], split="999,1,0", seq_length=8, num_samples=(1, 1, 0), seed=1, cache_dir=str(tmp_path)
        )
    with pytest.raises(UserError, match="weight"):
        gpt_dataset.build_gpt_datasets(
            ["x", data["a"], "0.5", data["b"]],
            split="1",
            seq_length=8,
            num_samples=(1, 0, 0),
            seed=1,
            cache_dir=str(tmp_path),
        )


def _build_on_rank(prefix, cache_dir):
    import torch.distributed as dist

    with pytest.MonkeyPatch.context() as monkeypatch:
        builds = count_index_builds(monkeypatch)
        train, valid, test = gpt_dataset.build_gpt_datasets(
            prefix, split="90,8,2", seq_length=32, num_samples=(200, 20, 5), seed=5, cache_dir=cache_dir
        )
    return {
        "rank": dist.get_rank(),
        "built": len(builds),
        "mmapped": isinstance(train.shuffle_index, np.memmap),
        "tokens": torch.stack([train[i]["tokens"] for i in range(10)]),
    }


def test_rank0_builds_other_ranks_memory_map(data, tmp_path):
    from distributed_utils import run_distributed

    results = sorted(run_distributed(_build_on_rank, 2, data["a"], str(tmp_path)), key=lambda r: r["rank"])
    assert [r["built"] for r in results] == [3, 0]
    assert all(r["mmapped"] for r in results)
    assert torch.equal(results[0]["tokens"], results[1]["tokens"])
