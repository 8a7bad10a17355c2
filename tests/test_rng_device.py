"""The dropout RNG tracker follows the TRAINING device, not "is CUDA visible" (issue 30, bugs 1-2).

A GPU host is emulated: `torch.cuda.is_available()` says True, and the CUDA generator is a stand-in
(a separate CPU generator) whose every use is recorded, like the CUDA context a real call would
open. A `device: cpu` run must draw its TP dropout from the CPU tracker and never touch the stand-in.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_core import checkpoint_format as cf
from megatron_core import parallel_state as ps
from megatron_core import pretrain_gpt as train_lib
from megatron_core import tensor_parallel
from megatron_core.errors import UserError
from megatron_core.tensor_parallel.random import MODEL_PARALLEL_RNG, get_rng_tracker, model_parallel_manual_seed
from megatron_core.training import checkpointing as ckpt
from megatron_core.training.logging import read_metrics
from training_fixtures import VOCAB_SIZE, fixture_corpus, fixture_one_thread, tiny_recipe, train_losses  # noqa: F401 - fixtures

SEED = 1234
CUDA_STATE_BYTES = 16  # a CUDA (Philox) generator's state: seed and offset
RESEED_NOTE = "dropout RNG tracker states are not restored"


@pytest.fixture
def gpu_host(monkeypatch):
    """CUDA "visible"; returns the list of torch.cuda calls the code made (each would be a real CUDA use)."""
    calls: list[str] = []
    fake = torch.Generator().manual_seed(99)

    def recorded(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return call

    def lazy_init():
        calls.append("_lazy_init")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "_lazy_init", lazy_init)  # what opens the CUDA context
    monkeypatch.setattr(
        torch.cuda, "get_rng_state", recorded("get_rng_state", lambda *_args, **_kwargs: fake.get_state())
    )
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", recorded("set_rng_state", lambda s, *_args, **_kwargs: fake.set_state(s))
    )
    monkeypatch.setattr(torch.cuda, "manual_seed", recorded("manual_seed", lambda s: fake.manual_seed(s)))
    monkeypatch.setattr(torch.cuda, "manual_seed_all", recorded("manual_seed_all", lambda s: fake.manual_seed(s)))
    yield calls
    monkeypatch.undo()
    model_parallel_manual_seed(SEED)  # leave the module-wide tracker on the CPU for the next test


def _tracker_mask(tp_rank: int, monkeypatch) -> torch.Tensor:
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: tp_rank)
    train_lib.seed_everything(SEED, "cpu")  # as train() does for a device=cpu recipe
    with get_rng_tracker().fork():
        return F.dropout(torch.ones(256), p=0.5)


def test_cpu_tracker_on_gpu_host_differs_across_tp_ranks(gpu_host, monkeypatch):
    masks = [_tracker_mask(rank, monkeypatch) for rank in (0, 1)]
    assert not torch.equal(masks[0], masks[1]), "dropout inside TP regions must differ across TP ranks"
    assert get_rng_tracker().device_type == "cpu"
    assert gpu_host == []


def test_the_tracker_names_an_unknown_device_type():
    with pytest.raises(UserError, match="pass the training device's type, one of cpu, cuda"):
        model_parallel_manual_seed(SEED, "mps")


def test_recompute_replays_the_tracker_stream_on_gpu_host(gpu_host):
    train_lib.seed_everything(SEED, "cpu")
    stream = get_rng_tracker().get_states()[MODEL_PARALLEL_RNG]
    with torch.random.fork_rng(devices=[]):  # the mask the tracker's CPU stream gives
        torch.set_rng_state(stream)
        want = F.dropout(torch.ones(256), p=0.5)
    with torch.random.fork_rng(devices=[]):  # what the default generator draws next, undisturbed
        torch.default_generator.manual_seed(SEED)
        outside = torch.rand(8)

    def block(x):
        with get_rng_tracker().fork():
            return F.dropout(x, p=0.5)

    x = torch.ones(256, requires_grad=True)
    out = tensor_parallel.checkpoint(block, x)
    out.sum().backward()  # recomputes `block`: the mask must be the forward's
    assert torch.equal(out.detach(), want), "the forward's dropout must draw from the tracker's stream"
    assert torch.equal(x.grad, want), "the recompute must replay the tracker's mask"
    assert torch.equal(torch.rand(8), outside), "the fork must leave the default generator alone"
    assert gpu_host == []


def test_get_rng_state_of_cpu_run_on_gpu_host_stores_no_cuda_state(gpu_host):
    train_lib.seed_everything(SEED, "cpu")
    state = ckpt.get_rng_state()
    assert state["cuda_rng_state"] is None and state["rng_tracker_device"] == "cpu"
    assert ckpt.set_rng_state(state) is None
    assert gpu_host == []


def test_cuda_run_forks_and_saves_the_cuda_generator(gpu_host):
    """The other side: device=cuda seeds and forks the (stand-in) CUDA generator and checkpoints it."""
    train_lib.seed_everything(SEED, "cuda")
    assert get_rng_tracker().device_type == "cuda" and "manual_seed" in gpu_host
    before = torch.get_rng_state()
    with get_rng_tracker().fork():
        assert gpu_host[-1] == "set_rng_state"  # the tracker's state went into the CUDA generator
    assert torch.equal(torch.get_rng_state(), before)
    state = ckpt.get_rng_state()
    assert state["cuda_rng_state"] is not None and state["rng_tracker_device"] == "cuda"
    assert ckpt.set_rng_state(state) is None


def test_cpu_train_on_gpu_host_never_touches_cuda(gpu_host, corpus, tmp_path):
    """The whole device=cpu run (seeding, dropout, save, resume) with CUDA visible."""
    recipe = tiny_recipe("train_iters=2", "lr_warmup_iters=1", "save_interval=1", "eval_interval=2", "eval_iters=1")
    train_lib.train(recipe, tmp_path, corpus, vocab_size=VOCAB_SIZE)
    assert get_rng_tracker().device_type == "cpu"
    (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("1\n")
    train_lib.train(recipe, tmp_path, corpus, vocab_size=VOCAB_SIZE)
    assert gpu_host == []


def test_tracker_states_of_another_generator_are_not_handed_over():
    """Unit: CUDA-marked states (or, in a checkpoint before the marker, states of a CUDA generator's
    size) leave the tracker as seeded and say why; the default generators are still restored."""
    train_lib.seed_everything(SEED, "cpu")
    seeded = get_rng_tracker().get_states()
    saved = ckpt.get_rng_state()
    foreign = {MODEL_PARALLEL_RNG: torch.zeros(CUDA_STATE_BYTES, dtype=torch.uint8)}
    for marker in ({"rng_tracker_device": "cuda"}, {}):
        state = {k: v for k, v in saved.items() if k != "rng_tracker_device"}
        state.update(marker, rng_tracker_states=foreign)
        torch.rand(3)
        note = ckpt.set_rng_state(state)
        assert note is not None and RESEED_NOTE in note
        assert "cuda generator" in note if marker else "do not fit the cpu generator" in note
        assert torch.equal(get_rng_tracker().get_states()[MODEL_PARALLEL_RNG], seeded[MODEL_PARALLEL_RNG])
        assert torch.equal(torch.get_rng_state(), saved["torch_rng_state"])


@pytest.mark.parametrize("legacy", [False, True], ids=["marked", "legacy-unmarked"])
def test_cpu_to_cpu_restore_keeps_the_exact_stream(legacy):
    train_lib.seed_everything(SEED, "cpu")
    with get_rng_tracker().fork():
        torch.rand(5)  # move the tracker off its seed
    saved = ckpt.get_rng_state()
    if legacy:  # a checkpoint written before rng_tracker_device existed
        saved.pop("rng_tracker_device", None)
    with get_rng_tracker().fork():
        want_inside = torch.rand(8)
    want_outside = torch.rand(8)
    train_lib.seed_everything(SEED + 1, "cpu")  # a fresh process seeds first, then resumes
    assert ckpt.set_rng_state(saved) is None
    with get_rng_tracker().fork():
        assert torch.equal(torch.rand(8), want_inside)
    assert torch.equal(torch.rand(8), want_outside)


# -- resume through Trainer.maybe_resume ---------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    """4 iterations with dropout, a checkpoint at 2."""
    run_dir = tmp_path_factory.mktemp("reference")
    train_lib.train(_recipe(), run_dir, corpus, vocab_size=VOCAB_SIZE)
    return run_dir


def _recipe():
    return tiny_recipe("train_iters=4", "save_interval=2", "eval_interval=4", "eval_iters=1")


def _resume_dir(reference, target, edit) -> None:
    """target/checkpoints: the reference's iteration-2 checkpoint with its rng_state edited by `edit`."""
    save = target / "checkpoints" / "iter_0000002" / "mp_rank_00"
    save.mkdir(parents=True)
    state = cf.load_checkpoint_file(reference / "checkpoints" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")
    edit(state["rng_state"][0])
    torch.save(state, save / "model_optim_rng.pt")
    (target / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2\n")


def _as_written_on_cuda(rng: dict) -> None:
    rng["rng_tracker_states"] = {MODEL_PARALLEL_RNG: torch.zeros(CUDA_STATE_BYTES, dtype=torch.uint8)}
    rng["cuda_rng_state"] = torch.zeros(CUDA_STATE_BYTES, dtype=torch.uint8)
    rng["rng_tracker_device"] = "cuda"


def test_resume_of_a_cuda_checkpoint_on_cpu_reseeds_with_a_log_line(reference, corpus, tmp_path, capsys):
    _resume_dir(reference, tmp_path, _as_written_on_cuda)
    train_lib.train(_recipe(), tmp_path, corpus, vocab_size=VOCAB_SIZE)  # used to fail at the first dropout
    assert RESEED_NOTE in capsys.readouterr().out
    losses = train_losses(read_metrics(tmp_path))
    assert sorted(losses) == [3, 4] and all(math.isfinite(v) for v in losses.values())


def test_resume_of_a_legacy_cpu_checkpoint_is_exact(reference, corpus, tmp_path, capsys):
    _resume_dir(reference, tmp_path, lambda rng: rng.pop("rng_tracker_device", None))
    train_lib.train(_recipe(), tmp_path, corpus, vocab_size=VOCAB_SIZE)
    assert RESEED_NOTE not in capsys.readouterr().out
    got, want = train_losses(read_metrics(tmp_path)), train_losses(read_metrics(reference))
    assert {k: v for k, v in got.items() if k > 2} == {k: v for k, v in want.items() if k > 2}
