"""Bad input to the converters: each a clear UserError (or `error:` + exit 2 from the CLI)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from megatron_core.convert import convert_checkpoint, import_hf_model, read_checkpoint
from megatron_core.errors import UserError
from test_convert_fixtures import fixture_tokenizer_files, fixture_tp1_checkpoint, save_layout, tiny_recipe  # noqa: F401

torch.set_num_threads(1)


@pytest.fixture()
def tp2(tp1_checkpoint, tokenizer_files, tmp_path):
    return save_layout(tmp_path / "tp2", tiny_recipe(2, 1), tp1_checkpoint[2], *tokenizer_files, tp=2, pp=1)


def test_missing_shard(tp2):
    shutil.rmtree(tp2 / "iter_0000010" / "mp_rank_01")
    with pytest.raises(UserError, match=r"missing shard\(s\) \[\(1, 0\)\]"):
        read_checkpoint(tp2)


def test_extra_shard(tp2):
    shutil.copytree(tp2 / "iter_0000010" / "mp_rank_01", tp2 / "iter_0000010" / "mp_rank_02")
    with pytest.raises(UserError, match=r"extra shard\(s\) \[\(2, 0\)\]"):
        read_checkpoint(tp2)


def test_shards_from_different_iterations_and_runs(tp2, tp1_checkpoint, tokenizer_files, tmp_path):
    other = save_layout(
        tmp_path / "other", tiny_recipe(2, 1), tp1_checkpoint[2], *tokenizer_files, tp=2, pp=1, iteration=20
    )
    shard = tp2 / "iter_0000010" / "mp_rank_01"
    (tp2 / "iter_0000010" / "manifest.json").unlink(missing_ok=True)  # with one, its crc32 refuses the copy first
    shutil.rmtree(shard)
    shutil.copytree(other / "iter_0000020" / "mp_rank_01", shard)
    with pytest.raises(UserError, match="disagree on 'iteration'"):
        read_checkpoint(tp2)
    other_run = save_layout(
        tmp_path / "run2", tiny_recipe(2, 1, init_std=0.5), tp1_checkpoint[2], *tokenizer_files, tp=2, pp=1
    )
    shutil.rmtree(shard)
    shutil.copytree(other_run / "iter_0000010" / "mp_rank_01", shard)
    with pytest.raises(UserError, match="disagree on 'recipe_hash'.*different runs"):
        read_checkpoint(tp2)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(UserError, match="no latest_checkpointed_iteration.txt"):
        read_checkpoint(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    shard = tmp_path / "iter_0000005" / "mp_rank_00"
    shard.mkdir(parents=True)
    (shard / "model_optim_rng.pt").write_bytes(b"this is not a torch file")
    with pytest.raises(UserError, match="cannot read checkpoint"):
        read_checkpoint(tmp_path)
    torch.save({"weights": torch.zeros(2)}, shard / "model_optim_rng.pt")
    with pytest.raises(UserError, match="not a Megatron checkpoint"):
        read_checkpoint(tmp_path)
    with pytest.raises(UserError, match="no iteration 6"):
        read_checkpoint(tmp_path, 6)


def test_tp_that_does_not_divide(tp1_checkpoint, tmp_path):
    convert_checkpoint(tp1_checkpoint[0], tmp_path / "hf")
    with pytest.raises(UserError, match="model.num_attention_heads 4 is not divisible by TP 3"):
        import_hf_model(tmp_path / "hf", tmp_path / "back", tp=3)
    with pytest.raises(UserError, match="num_layers 4 is not divisible by PP 3"):
        import_hf_model(tmp_path / "hf", tmp_path / "back", pp=3)
    assert not (tmp_path / "back").exists()


def test_target_holding_a_model_is_refused_unless_overwrite(tp1_checkpoint, tmp_path):
    out = tmp_path / "hf"
    convert_checkpoint(tp1_checkpoint[0], out)
    before = (out / "model.safetensors").stat().st_mtime_ns
    with pytest.raises(UserError, match="already holds a model; pass --overwrite"):
        convert_checkpoint(tp1_checkpoint[0], out)
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    convert_checkpoint(tp1_checkpoint[0], out, overwrite=True, format="bin")
    assert (out / "pytorch_model.bin").exists() and not (out / "model.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp/old dirs left behind


def test_import_into_an_occupied_directory_is_refused_unless_overwrite_and_bf16_converts(tp1_checkpoint, tmp_path):
    hf = tmp_path / "hf"
    summary = convert_checkpoint(tp1_checkpoint[0], hf, dtype="bf16")
    from safetensors import safe_open

    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert summary["iteration"] == read_checkpoint(tp1_checkpoint[0]).iteration
    ckpt = tmp_path / "ckpt"
    import_hf_model(hf, ckpt, tp=2)
    tracker = (ckpt / "latest_checkpointed_iteration.txt").read_text()
    with pytest.raises(UserError, match="already holds a checkpoint; pass --overwrite"):
        import_hf_model(hf, ckpt, tp=1)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == tracker
    assert sorted(p.name for p in (ckpt / "release").iterdir()) == ["manifest.json", "mp_rank_00", "mp_rank_01"]
    import_hf_model(hf, ckpt, tp=1, overwrite=True)
    assert sorted(p.name for p in (ckpt / "release").iterdir()) == ["manifest.json", "mp_rank_00"]


def test_cli_prints_error_and_exits_2(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_core.convert",
            "--load",
            str(tmp_path / "nope"),
            "--save",
            str(tmp_path / "hf"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "does not exist" in proc.stderr
    assert not (tmp_path / "hf").exists()


def test_mixed_shards_of_a_legacy_checkpoint_without_recipe_hash(tp1_checkpoint, tokenizer_files, tmp_path):
    """No recipe_hash to compare (Megatron-LM's own checkpoints): the replicated norms still tell."""
    from megatron_core.checkpoint_format import load_checkpoint_file

    a = save_layout(tmp_path / "a", tiny_recipe(2, 1), tp1_checkpoint[2], *tokenizer_files, tp=2, pp=1)
    other_state = {k: v + 1.0 for k, v in tp1_checkpoint[2].items()}
    b = save_layout(tmp_path / "b", tiny_recipe(2, 1), other_state, *tokenizer_files, tp=2, pp=1)
    for ckpt in (a, b):
        for path in ckpt.glob("iter_*/*/model_optim_rng.pt"):
            obj = load_checkpoint_file(path)
            del obj["recipe_hash"], obj["recipe"]
            torch.save(obj, path)
        (ckpt / "iter_0000010" / "manifest.json").unlink()  # Megatron-LM writes none
    rel = "iter_0000010/mp_rank_01/model_optim_rng.pt"
    shutil.copyfile(b / rel, a / rel)
    with pytest.raises(UserError, match="different copies of the replicated .*different runs"):
        read_checkpoint(a)


def test_a_weight_the_gpt_does_not_have_is_refused(tp2):
    """A layer the model does not declare (here an extra MLP gate) is named, not merged as if replicated."""
    from megatron_core.checkpoint_format import load_checkpoint_file

    gate = torch.ones(4, 4)  # the same on both TP ranks: a name-blind merge would take it for a replicated weight
    for path in tp2.glob("iter_*/*/model_optim_rng.pt"):
        obj = load_checkpoint_file(path)
        obj["model"]["language_model"]["encoder"]["layers.0.mlp.gate.weight"] = gate
        torch.save(obj, path)
    (tp2 / "iter_0000010" / "manifest.json").unlink()  # its crc32 would refuse the edited files first
    with pytest.raises(UserError, match=r"weights this converter does not know: \['encoder.layers.0.mlp.gate.weight'"):
        read_checkpoint(tp2)


def test_args_that_do_not_shape_the_weights_do_not_refuse_them(tp2):
    """A run's sequence parallelism or world size says nothing about its files (Megatron-LM's args may say
    sequence_parallel at TP 1, or a world of any size): the checkpoint still reads."""
    from megatron_core.checkpoint_format import load_checkpoint_file

    for path in tp2.glob("iter_*/*/model_optim_rng.pt"):
        obj = load_checkpoint_file(path)
        obj["args"].sequence_parallel, obj["args"].world_size = True, 3
        obj["args"].tensor_model_parallel_size = 2
        torch.save(obj, path)
    (tp2 / "iter_0000010" / "manifest.json").unlink()  # its crc32 would refuse the edited files first
    ckpt = read_checkpoint(tp2)
    assert ckpt.spec.tp == 2 and set(ckpt.state) >= {"embedding.word_embeddings.weight"}
