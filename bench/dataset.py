"""Benchmark: building the GPT dataset indices, ours vs megatron-core's BlendedMegatronDatasetBuilder.

Default input: a synthetic stdlib-sized dataset (about 10M tokens in about 2000 documents,
log-normal lengths like Python source files), or `data_prefix=` a real preprocessed one.
Default request: CodeParrot-small's 150000 iterations x global batch 192 at seq 1024, split
969,30,1, eval every 200 over 10 iterations. Both build into fresh cache directories.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import types

import numpy as np

from bench.cli import results_path, write_result
from megatron_core.data import gpt_dataset
from megatron_core.data.indexed_dataset import IndexedDatasetBuilder


def synthesize(prefix: str, num_docs: int = 2000, mean_tokens: int = 5000, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean=np.log(mean_tokens) - 0.5, sigma=1.0, size=num_docs).astype(np.int64) + 1
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for n in lengths:
        builder.add_item(rng.integers(0, 32768, int(n)).astype(np.uint16))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def _import_megatron_builder():
    """megatron-core's dataset code without its package init (which imports the model stack)."""
    import megatron

    if "megatron.core" not in sys.modules:
        core = types.ModuleType("megatron.core")
        core.__path__ = [os.path.join(list(megatron.__path__)[0], "core")]
        sys.modules["megatron.core"] = core
        import megatron.core.parallel_state  # noqa: F401
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    return BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig


class _StubTokenizer:
    vocab_size = 32768
    eod = 0
    unique_identifiers = {"class": "StubTokenizer"}


def run(
    data_prefix: str | None = None,
    train_iters: int = 150000,
    global_batch_size: int = 192,
    seq_length: int = 1024,
    eval_interval: int = 200,
    eval_iters: int = 10,
    split: str = "969,30,1",
    seed: int = 1234,
    repeats: int = 3,
    write: bool = True,
    recipe_hash: str | None = None,
) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-dataset-") as work:  # gigabytes of indices: never left behind
        return _run(
            work,
            data_prefix,
            train_iters,
            global_batch_size,
            seq_length,
            eval_interval,
            eval_iters,
            split,
            seed,
            repeats,
            write,
            recipe_hash,
        )


def _run(
    work,
    data_prefix,
    train_iters,
    global_batch_size,
    seq_length,
    eval_interval,
    eval_iters,
    split,
    seed,
    repeats,
    write,
    recipe_hash,
) -> dict:
    if data_prefix is None:
        data_prefix = synthesize(os.path.join(work, "synthetic"))
    sizes = gpt_dataset.samples_per_split(train_iters, global_batch_size, eval_interval, eval_iters)
    tokens = int(np.fromfile(data_prefix + ".bin", dtype=np.uint16).size) if data_prefix.startswith(work) else None

    Builder, GPTDataset, GPTDatasetConfig = _import_megatron_builder()

    def build_ours(cache):
        return gpt_dataset.build_gpt_datasets(
            data_prefix, split=split, seq_length=seq_length, num_samples=sizes, seed=seed, cache_dir=cache
        )

    def build_megatron(cache):
        config = GPTDatasetConfig(
            random_seed=seed,
            sequence_length=seq_length,
            blend=([data_prefix], None),
            split=split,
            path_to_cache=cache,
            tokenizer=_StubTokenizer(),
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
        )
        return Builder(GPTDataset, list(sizes), lambda: True, config).build()

    # The machine is shared: alternate the two, fresh cache directories each time, keep the best.
    ours_times, megatron_times = [], []
    sides = ((build_megatron, megatron_times, "megatron"), (build_ours, ours_times, "ours"))
    for attempt in range(repeats):
        for build, times, name in sides if attempt % 2 == 0 else sides[::-1]:  # neither always goes first
            start = time.perf_counter()
            datasets = build(os.path.join(work, f"{name}-{attempt}"))
            times.append(time.perf_counter() - start)
            if attempt < repeats - 1:  # keep only the last round's files (compared below)
                del datasets
                shutil.rmtree(os.path.join(work, f"{name}-{attempt}"))
                continue
            if name == "ours":
                ours = datasets
            else:
                reference = datasets
    ours_s, megatron_s = min(ours_times), min(megatron_times)

    same = all(
        np.array_equal(r.shuffle_index, o.shuffle_index) and np.array_equal(r.sample_index, o.sample_index)
        for r, o in zip(reference, ours)
        if r is not None
    )
    result = {
        "benchmark": "dataset",
        "recipe_hash": recipe_hash,
        "ours_s": round(ours_s, 3),
        "megatron_core_s": round(megatron_s, 3),
        "ratio": round(ours_s / megatron_s, 3),
        "samples": [len(d) if d is not None else 0 for d in ours],
        "requested_samples": list(sizes),
        "seq_length": seq_length,
        "dataset_tokens": tokens,
        "indices_identical": bool(same),
        "data_prefix": data_prefix,
        "ours_all_s": [round(t, 3) for t in ours_times],
        "megatron_core_all_s": [round(t, 3) for t in megatron_times],
    }
    if write:
        result["results_file"] = str(write_result(result, results_path("dataset")))
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-prefix", default=None)
    parser.add_argument("--train-iters", type=int, default=150000)
    parser.add_argument("--global-batch-size", type=int, default=192)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3, help="alternating builds of each (the best is kept)")
    parser.add_argument("--recipe-hash", default=None, help="hash of the recipe whose numbers these are")
    args = parser.parse_args(argv)
    result = run(
        data_prefix=args.data_prefix,
        train_iters=args.train_iters,
        global_batch_size=args.global_batch_size,
        seq_length=args.seq_length,
        recipe_hash=args.recipe_hash,
        repeats=args.repeats,
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
