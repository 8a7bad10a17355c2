"""Host syncs per training iteration (issue 31): every read of a tensor's value on the host (`.item()`,
`float()`, `int()`, `bool()`, `.tolist()`) and every `torch.cuda.synchronize()` stalls the Python thread
until the device has caught up, so the loop may make at most two per iteration: the gradient norm (the
clip and the NaN guard need it) and, under fp16, the overflow flag. Losses stay on the device until a
log line; the stop flag and the TP batch status travel without reading a device tensor.

On a CPU nothing stalls, so the reads are counted instead, by call site, over the real Trainer: on the CPU
every tensor counts, so a site the count reports would sync a GPU. Host-memory buffers read as numpy
arrays (the TP batch status, over gloo) are not tensors and are not counted: they never touch a device."""

from __future__ import annotations

import collections
import os
import sys
import traceback

import pytest
import torch

from megatron_core.pretrain_gpt import train
from megatron_core.training import trainer as trainer_lib
from training_fixtures import VOCAB_SIZE, fixture_corpus, fixture_one_thread, tiny_recipe  # noqa: F401 - fixtures

MAX_SYNCS_PER_ITERATION = 2
LOG_INTERVAL, ITERATIONS = 4, 8
_READS = ("item", "__float__", "__int__", "__bool__", "tolist")
_TORCH_DIR = os.path.dirname(torch.__file__)


def _call_site() -> str:
    """The innermost frame outside torch (and this file), as path:line, plus the innermost frame in
    megatron_core when that is not already it: what a failure message needs to find the sync."""
    frames = [
        f for f in traceback.extract_stack()[:-3] if not f.filename.startswith(_TORCH_DIR) and f.filename != __file__
    ]
    if not frames:
        return "?"
    inner = frames[-1]
    site = f"{os.path.relpath(inner.filename)}:{inner.lineno} ({inner.name})"
    ours = [f for f in frames if "megatron_core" in f.filename]
    if ours and ours[-1] is not inner:
        site += f" via {os.path.relpath(ours[-1].filename)}:{ours[-1].lineno}"
    return site


class SyncCounter:
    """Counts host reads of tensors by iteration (the one the loop is in: from a train_step's start to the
    next one's, so the loop's own work after a step counts for that step) and by call site."""

    def __init__(self) -> None:
        self.iteration = 0  # 0: before the first train_step (setup, resume)
        self.sites: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self._inside = False

    def record(self, what: str) -> None:
        if self._inside:  # a read made by another patched read (float() -> item()) counts once
            return
        self._inside = True
        try:
            self.sites[self.iteration][f"{what} at {_call_site()}"] += 1
        finally:
            self._inside = False

    def install(self, monkeypatch) -> None:
        for name in _READS:
            original = getattr(torch.Tensor, name)

            def patched(tensor, *args, _original=original, _name=name, **kwargs):
                self.record(f".{_name}()")
                self._inside, outer = True, self._inside
                try:
                    return _original(tensor, *args, **kwargs)
                finally:
                    self._inside = outer

            monkeypatch.setattr(torch.Tensor, name, patched)
        monkeypatch.setattr(
            torch.cuda, "synchronize", lambda *_args, **_kwargs: self.record("torch.cuda.synchronize()")
        )
        step = trainer_lib.Trainer.train_step

        def counted_step(trainer, data_iterator):
            self.iteration = trainer.state.iteration + 1
            return step(trainer, data_iterator)

        monkeypatch.setattr(trainer_lib.Trainer, "train_step", counted_step)

    def report(self, iterations) -> str:
        return "\n".join(
            f"iteration {i}: {sum(self.sites[i].values())} host syncs\n"
            + "".join(f"    {n} x {site}\n" for site, n in self.sites[i].most_common())
            for i in iterations
        )


def _quiet_iterations() -> list[int]:
    """Iterations with no log line, evaluation or checkpoint, before the last (whose end saves)."""
    return [i for i in range(1, ITERATIONS) if i % LOG_INTERVAL]


def _recipe(*extra: str):
    return tiny_recipe(
        f"train_iters={ITERATIONS}",
        f"training.log_interval={LOG_INTERVAL}",
        "save_interval=null",
        "eval_iters=0",
        *extra,
    )


def _assert_few(counter: SyncCounter, where: str) -> None:
    quiet = _quiet_iterations()
    over = [i for i in quiet if sum(counter.sites[i].values()) > MAX_SYNCS_PER_ITERATION]
    assert not over, (
        f"{where}: more than {MAX_SYNCS_PER_ITERATION} host syncs in iteration(s) {over}:\n" + counter.report(over)
    )
    # the count is not blind: the grad norm is read every iteration
    assert all(any("clip_grads" in site for site in counter.sites[i]) for i in quiet), counter.report(quiet)


def test_one_process_makes_at_most_two_host_syncs_per_iteration(monkeypatch, corpus, tmp_path):
    counter = SyncCounter()
    counter.install(monkeypatch)
    summary = train(_recipe(), tmp_path, corpus, vocab_size=VOCAB_SIZE)
    assert summary["iteration"] == ITERATIONS
    _assert_few(counter, "1 process")
    # the losses still reach the log: one mean per log line
    logged = [i for i in range(1, ITERATIONS + 1) if i % LOG_INTERVAL == 0]
    assert all(counter.sites[i] for i in logged)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_device_side_nonfinite_loss_flag_skips_the_step_within_the_norms_syncs(monkeypatch, precision):
    """The loop hands the NaN guard its loss's finiteness as a device tensor: a True one skips the update
    as the host bool does (NaN norm), a False one steps, and neither adds a read to the optimizer's own
    (the norm; under fp16 the overflow flag too)."""
    import math

    from megatron_core.optimizer.grad_scaler import DynamicGradScaler
    from test_training_optimizer import TwoLayer, _opt

    torch.manual_seed(0)
    model = TwoLayer() if precision == "fp32" else TwoLayer().half()
    opt = _opt(model, precision, DynamicGradScaler(initial_scale=1024.0, hysteresis=1) if precision == "fp16" else None)
    x = torch.randn(8, 4).to(next(model.parameters()).dtype)
    counter = SyncCounter()
    counter.install(monkeypatch)
    for nonfinite in (True, False):
        opt.zero_grad()
        opt.scale_loss(model(x).float()).backward()
        before = [p.detach().clone() for p in model.parameters()]
        counter.iteration += 1
        ok, norm, _ = opt.step(nonfinite_loss=torch.tensor(nonfinite))
        assert ok is not nonfinite and math.isnan(norm) is nonfinite
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) is nonfinite
        reads = sum(counter.sites[counter.iteration].values())
        assert reads <= (2 if precision == "fp16" else 1), counter.report([counter.iteration])


def _tp2_counts(run_dir: str, corpus_prefix: str) -> str:
    """TP 2 over gloo: the batch broadcast and the stop-flag agreement run; '' when within the limit."""
    import torch.distributed as dist

    from megatron_core import parallel_state as ps

    class Patch:  # monkeypatch is not picklable into the ranks; undo by hand
        def __init__(self):
            self.undo = []

        def setattr(self, target, name, value):
            self.undo.append((target, name, getattr(target, name)))
            setattr(target, name, value)

    patch, counter = Patch(), SyncCounter()
    counter.install(patch)
    try:
        recipe = _recipe("world_size=2", "parallel.tensor_model_parallel_size=2")
        train(recipe, run_dir, corpus_prefix, vocab_size=VOCAB_SIZE)
    finally:
        for target, name, value in reversed(patch.undo):
            setattr(target, name, value)
        ps.destroy_model_parallel()
    try:
        _assert_few(counter, f"TP 2, rank {dist.get_rank()}")
    except AssertionError as exc:
        return str(exc)
    return ""


@pytest.mark.slow
def test_tensor_parallel_ranks_make_at_most_two_host_syncs_per_iteration(corpus, tmp_path):
    from distributed_utils import run_distributed

    failures = run_distributed(_tp2_counts, 2, str(tmp_path), corpus)
    assert failures == ["", ""], "\n".join(failures)


def _tp2_batches_with_a_separate_status_group() -> tuple:
    """test_data_iterators' TP 2 runs (batches, then a reader failure on TP rank 0) as under NCCL, where the
    TP group carries device tensors only and the status needs the TP group's gloo twin."""
    import test_data_iterators as plain
    from megatron_core.training import data_iterators

    data_iterators._carries_host_tensors = lambda _group: False  # this forked rank only
    tp_rank, batches, _ = plain._tp2_batches()
    _, got, error = plain._tp2_reader_error()
    return tp_rank, batches, got, error, len(data_iterators._HOST_GROUPS)


@pytest.mark.slow
def test_tp_batch_status_travels_over_a_gloo_twin_where_the_tp_group_is_not_gloo():
    from distributed_utils import run_distributed

    (_, first, got0, error0, twins0), (_, second, got1, error1, twins1) = sorted(
        run_distributed(_tp2_batches_with_a_separate_status_group, 2)
    )
    assert first == second and len(first) == 6 and first[1]["tokens"][0] == [20, 21, 22, 23]
    assert got0 == got1 == 2 and error0 == "ValueError: corrupt sample 4"
    assert error1 is not None and "TP rank 0's batch reader failed" in error1
    assert twins0 == twins1 == 2  # one twin per TP group made, for each of the two runs


if __name__ == "__main__":  # pragma: no cover - pytest runs this file
    sys.exit(pytest.main([__file__, "-q"]))
