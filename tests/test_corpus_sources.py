"""Typed corpus sources (checked when the recipe loads, resolved with their defaults) and recipe discovery that
counts GPUs without importing torch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_core import config
from megatron_core.config import (
    SOURCE_TYPES,
    HfDatasetSource,
    JsonlSource,
    PythonStdlibSource,
    UserError,
    load_recipe,
    recipe_from_dict,
)
from megatron_core.config import discovery
from megatron_core.config.hashing import stage_hash
from megatron_core.config.resume import RUN_EXTENDING_KEYS
from megatron_core.data import corpus

RECORDED = json.loads((Path(__file__).parent / "fixtures" / "recipes_resolved.json").read_text())["recipes"]
STAGES = ("corpus", "tokenizer", "preprocess", "train")


def _recipe(*sources):
    return recipe_from_dict({"name": "t", "version": 1, "corpus": {"sources": list(sources)}})


def test_shipped_recipes_have_typed_sources_and_keep_every_stage_hash():
    assert set(RECORDED) == {path.stem for path in config.list_recipe_files()}
    for name, recorded in RECORDED.items():
        recipe = load_recipe(name)
        assert all(type(source) in SOURCE_TYPES.values() for source in recipe.corpus.sources), name
        assert recipe.to_dict() == recorded["resolved"] and recipe.hash == recorded["hash"], name
        for stage in STAGES:  # the run directories' names, from the dict recorded before sources were typed
            assert recipe.stage_hash(stage) == stage_hash(
                recorded["resolved"], stage, run_extending=RUN_EXTENDING_KEYS
            ), (name, stage)
    small = load_recipe("codeparrot-small-8gpu").corpus.sources
    assert small == (HfDatasetSource(name="codeparrot/codeparrot-clean-train", revision="main"),)
    assert load_recipe("codeparrot-tiny").corpus.sources == (PythonStdlibSource(shuffle_seed=1234),)


def test_a_source_resolves_with_its_defaults_and_round_trips_through_yaml(tmp_path):
    """A default left out and one spelled out are the same source, the same resolved recipe and hash (as every
    other section's keys); a resolved recipe written out loads back to the same hash."""
    short = {"type": "jsonl", "paths": ["a/*.jsonl"]}
    spelled = {**short, "key": "content"}
    a, b = _recipe(short), _recipe(spelled)
    assert a.corpus.sources == b.corpus.sources == (JsonlSource(paths=("a/*.jsonl",)),)
    assert a.to_dict()["corpus"]["sources"] == b.to_dict()["corpus"]["sources"] == [spelled]
    assert a.hash == b.hash
    assert _recipe({**short, "key": "text"}).hash != a.hash
    path = tmp_path / "r.yaml"
    path.write_text(b.to_yaml())
    assert load_recipe(str(path)).hash == b.hash and load_recipe(str(path)).corpus == b.corpus
    assert HfDatasetSource(name="org/d", split="valid").to_dict() == {
        "type": "hf-dataset",
        "name": "org/d",
        "revision": None,
        "split": "valid",
        "key": "content",
    }
    assert _recipe({"type": "jsonl", "paths": "one.jsonl"}).corpus.sources[0].paths == ("one.jsonl",)


@pytest.mark.parametrize(
    "sources, message",
    [
        (
            [{"type": "jsonll", "paths": ["a"]}],
            r"^corpus\.sources\[0\]\.type: unknown source type 'jsonll'; did you mean 'jsonl'\?; "
            r"use one of python-stdlib",
        ),
        (
            [{"type": "python-stdlib"}, {"type": "jsonl", "pahts": ["a"]}],
            r"^corpus\.sources\[1\]\.pahts: unknown key for a jsonl source; did you mean 'paths'\? "
            r"\(its keys: paths, key\)",
        ),
        ([{"type": "hf-dataset", "revision": "main"}], r"^corpus\.sources\[0\]\.name: missing; a hf-dataset source"),
        ([{"type": "hf-dataset", "name": ""}], r"^corpus\.sources\[0\]\.name: empty"),
        ([{"type": "jsonl", "paths": []}], r"^corpus\.sources\[0\]\.paths: got \[\], expected a non-empty list"),
        ([{"type": "jsonl", "paths": ["a", 3]}], r"^corpus\.sources\[0\]\.paths\[1\]: got 3 \(int\), expected str"),
        ([{"type": "python-stdlib", "shuffle_seed": "x"}], r"^corpus\.sources\[0\]\.shuffle_seed: got 'x'"),
        ([{"paths": ["a"]}], r"^corpus\.sources\[0\]\.type: missing; use one of python-stdlib, jsonl, hf-dataset$"),
        (["jsonl"], r"^corpus\.sources\[0\]: got 'jsonl' \(str\), expected a mapping with a type"),
        ([], r"^corpus\.sources: got \[\], expected a non-empty list"),
    ],
)
def test_a_bad_source_is_refused_when_the_recipe_loads(sources, message):
    with pytest.raises(UserError, match=message) as caught:
        _recipe(*sources) if sources else recipe_from_dict({"name": "t", "version": 1, "corpus": {"sources": []}})
    assert "\n" not in str(caught.value)


def test_a_bad_source_from_set_is_refused_before_any_work():
    with pytest.raises(UserError, match=r"corpus\.sources\[0\]\.path: unknown key .*did you mean 'paths'"):
        load_recipe("smoke", ["corpus.sources=[{type: jsonl, path: [x.jsonl]}]"])


def test_every_source_type_has_its_reader():
    assert all(name == cls.TYPE for name, cls in SOURCE_TYPES.items())
    assert set(corpus._READERS) == set(SOURCE_TYPES.values())


def test_finding_a_family_by_the_gpu_count_and_listing_recipes_leave_torch_out():
    code = (
        "import sys; from megatron_core import config; [config.load_recipe(str(p)) for p in "
        "config.list_recipe_files()]; config.load_recipe('codeparrot-small'); print('torch' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}  # UUIDs there would ask torch
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert proc.stdout.strip() == "False"


@pytest.mark.parametrize(
    "visible, physical, expected",
    [
        (None, 8, 8),
        ("0,1", 8, 2),
        ("", 8, 0),
        ("-1", 8, 0),
        ("0,0", 8, 0),
        ("2,-1,3", 8, 1),
        ("1gpu,2", 8, 2),
        ("0,3,1", 2, 1),
        ("5", 4, 0),
        ("0,1", None, 0),
        (None, None, 0),
        ("GPU-5d3e,GPU-77aa", 8, "torch"),
    ],
)
def test_visible_gpu_count_reads_cuda_visible_devices_as_cuda_does(monkeypatch, tmp_path, visible, physical, expected):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(discovery, "_nvml_device_count", lambda: physical)
    monkeypatch.setattr(discovery, "_torch_gpu_count", lambda: "torch")  # asked only where NVML cannot say
    monkeypatch.setattr(discovery, "_ROCM_DEVICE", tmp_path / "no-kfd")
    assert config.visible_gpu_count() == expected
