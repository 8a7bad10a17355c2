"""transformers' own convert_megatron_gpt2_checkpoint.py (4.46.3 wheel) accepts our TP1 checkpoint and
gives the same logits as our converter."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import zipfile

import pytest
import torch

from megatron_core.convert import convert_checkpoint
from megatron_core.checkpoint_format import load_checkpoint_file
from test_convert_fixtures import fixture_tokenizer_files, fixture_tp1_checkpoint  # noqa: F401

CONVERTER = "transformers/models/megatron_gpt2/convert_megatron_gpt2_checkpoint.py"


@pytest.fixture(scope="session")
def hf_converter_module(tmp_path_factory):
    """Downloaded once per test session (PyPI), the one file extracted from the wheel."""
    cache = tmp_path_factory.mktemp("transformers-4.46.3")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "transformers==4.46.3", "--no-deps", "-q", "-d", str(cache)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    wheels = list(cache.glob("transformers-4.46.3-*.whl"))
    if proc.returncode != 0 or not wheels:
        pytest.skip(f"pip download transformers==4.46.3 failed (no PyPI access?): {proc.stderr.strip()[-300:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(CONVERTER, cache)
    spec = importlib.util.spec_from_file_location("hf_megatron_gpt2_converter", cache / CONVERTER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@torch.no_grad()
def test_transformers_converter_agrees_with_ours(hf_converter_module, tp1_checkpoint, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    save, _, _ = tp1_checkpoint
    ours_dir = tmp_path / "ours"
    convert_checkpoint(save, ours_dir)
    # Their script asks the Hub for a tokenizer unless args name a local one: hand it ours.
    ckpt = load_checkpoint_file(save / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt")
    ckpt["args"].tokenizer_type = "PretrainedFromHF"
    ckpt["args"].tokenizer_name_or_path = str(ours_dir)
    theirs_dir = tmp_path / "theirs"
    theirs_dir.mkdir()
    torch.save(ckpt, theirs_dir / "model_optim_rng.pt")
    monkeypatch.setattr(sys, "argv", ["convert", str(theirs_dir / "model_optim_rng.pt")])
    # It calls torch.load without weights_only; newer torch then needs Namespace allow-listed.
    with torch.serialization.safe_globals([argparse.Namespace]):
        hf_converter_module.main()
    assert (theirs_dir / "pytorch_model.bin").exists() and (theirs_dir / "config.json").exists()

    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    load = dict(dtype=torch.float32, attn_implementation="eager")
    theirs = AutoModelForCausalLM.from_pretrained(str(theirs_dir), **load).eval()
    ours = AutoModelForCausalLM.from_pretrained(str(ours_dir), **load).eval()
    assert theirs.config.activation_function == "gelu_fast"  # their name for the same tanh GeLU
    a, b = theirs(ids).logits, ours(ids).logits
    assert a.std() > 0.1 and (a - b).abs().max() < 1e-4
