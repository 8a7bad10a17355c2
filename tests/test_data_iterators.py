"""Batches come prepared in the background, in Megatron's order, and under TP only rank 0 reads."""

from __future__ import annotations

import torch

from distributed_utils import run_distributed
from megatron_core import parallel_state as ps
from megatron_core.training.data_iterators import _read_batches, batch_iterator


class Numbers:
    """Sample i is a [4]-token sequence starting at 10 * i; counts who read what."""

    def __init__(self, size: int = 12, forbidden: bool = False):
        self.size, self.forbidden, self.reads = size, forbidden, 0

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        if self.forbidden:
            raise AssertionError("this rank must not read the dataset")
        self.reads += 1
        tokens = torch.arange(4) + 10 * i
        return {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(4), "position_ids": torch.arange(4)}


def _plain(dataset, **kwargs):
    return list(_read_batches(dataset, pin=False, **kwargs))


def test_prefetched_batches_are_the_plain_order_and_resume_from_a_sample_count():
    kwargs = dict(consumed_samples=4, micro_batch_size=2, dp_rank=1, dp_size=2, wrap=False)
    expected = _plain(Numbers(), **kwargs)
    iterator = batch_iterator(Numbers(), device=torch.device("cpu"), **kwargs)
    got = list(iterator)
    assert len(got) == len(expected) == 2
    for a, b in zip(got, expected):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(got[0]["tokens"][:, 0], torch.tensor([60, 70]))  # DP rank 1's half of samples 4..7
    assert iterator.wait_seconds >= 0.0


def test_an_endless_iterator_is_stopped_by_close():
    iterator = batch_iterator(
        Numbers(), consumed_samples=0, micro_batch_size=2, dp_rank=0, dp_size=1, device=torch.device("cpu"), wrap=True
    )
    for _ in range(20):
        next(iterator)
    iterator.close()
    assert not iterator._thread.is_alive()


def test_an_error_while_reading_reaches_the_training_thread():
    class Broken(Numbers):
        def __getitem__(self, i):
            raise ValueError("corrupt sample")

    iterator = batch_iterator(
        Broken(), consumed_samples=0, micro_batch_size=2, dp_rank=0, dp_size=1, device=torch.device("cpu")
    )
    try:
        next(iterator)
    except ValueError as exc:
        assert "corrupt sample" in str(exc)
    else:
        raise AssertionError("the reader's error was swallowed")


def _tp2_batches():
    ps.initialize_model_parallel(2, 1)
    try:
        tp_rank = ps.get_tensor_model_parallel_rank()
        dataset = Numbers(forbidden=tp_rank != 0)
        iterator = batch_iterator(
            dataset, consumed_samples=0, micro_batch_size=2, dp_rank=0, dp_size=1, device=torch.device("cpu")
        )
        batches = [{k: v.tolist() for k, v in b.items()} for b in iterator]
        return tp_rank, batches, dataset.reads
    finally:
        ps.destroy_model_parallel()


def test_tensor_parallel_rank_zero_reads_and_broadcasts():
    results = sorted(run_distributed(_tp2_batches, 2))
    (_, first, reads0), (_, second, reads1) = results
    assert first == second and len(first) == 6  # 12 samples, micro batch 2, then the end reaches both
    assert reads0 == 12 and reads1 == 0
    assert first[1]["tokens"][0] == [20, 21, 22, 23]


def _tp2_reader_error():
    ps.initialize_model_parallel(2, 1)
    try:
        tp_rank = ps.get_tensor_model_parallel_rank()

        class BrokenAtFour(Numbers):
            def __getitem__(self, i):
                if i == 4:
                    raise ValueError("corrupt sample 4")
                return super().__getitem__(i)

        iterator = batch_iterator(
            BrokenAtFour(forbidden=tp_rank != 0),
            consumed_samples=0,
            micro_batch_size=2,
            dp_rank=0,
            dp_size=1,
            device=torch.device("cpu"),
        )
        got = 0
        try:
            for _ in iterator:
                got += 1
        except Exception as exc:  # noqa: BLE001 - what each rank saw is the result
            return tp_rank, got, f"{type(exc).__name__}: {exc}"
        return tp_rank, got, None
    finally:
        ps.destroy_model_parallel()


def test_a_reader_error_on_tp_rank_zero_stops_every_rank_instead_of_hanging():
    (_, got0, error0), (_, got1, error1) = sorted(run_distributed(_tp2_reader_error, 2))
    assert got0 == got1 == 2  # samples 0-3 arrived before the broken one
    assert error0 == "ValueError: corrupt sample 4"
    assert error1 is not None and "TP rank 0's batch reader failed" in error1
