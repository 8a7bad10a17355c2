"""Recipes that start from another (`base:`), and the shipped recipes rewritten that way resolving exactly as
the whole copies did (tests/fixtures/recipes_resolved.json was recorded from those copies)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import invoke
import pytest
import yaml

from megatron_core import cli, config
from megatron_core.config import load_recipe, recipe_from_dict
from megatron_core.errors import UserError

RECORDED = json.loads((Path(__file__).parent / "fixtures" / "recipes_resolved.json").read_text())
SMOKE = config.resolve_recipe_path("smoke")


def _write(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_shipped_recipes_resolve_to_the_recorded_dict_and_hash():
    shipped = {path.stem: path for path in config.list_recipe_files()}
    assert set(RECORDED["recipes"]) <= set(shipped)
    for name, recorded in RECORDED["recipes"].items():
        recipe = load_recipe(name)
        assert recipe.to_dict() == recorded["resolved"], name
        assert recipe.hash == recorded["hash"], name  # the hash names run directories
    # the near-copies are written as base + delta
    for child, base in (("codeparrot-small-1gpu", "codeparrot-small-8gpu"), ("smoke-tp2pp2", "smoke")):
        raw = yaml.safe_load(shipped[child].read_text())
        assert raw["base"] == base and "model" not in raw and "training" not in raw, child


def test_recipes_listing_and_families_are_unchanged(capsys):
    cli.recipes(invoke.Context())
    table = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("unpinned:")]
    assert [re.split(r"\s{2,}", line.strip()) for line in table] == RECORDED["listing"]
    # the 1-GPU variant inherits its family from the 8-GPU recipe and is still picked by GPU count
    assert config.resolve_recipe_path("codeparrot-small", gpus=1).stem == "codeparrot-small-1gpu"
    assert config.resolve_recipe_path("codeparrot-small", gpus=8).stem == "codeparrot-small-8gpu"


def test_chained_bases_merge_sections_and_replace_lists(tmp_path):
    smoke = yaml.safe_load(SMOKE.read_text())
    _write(tmp_path / "root.yaml", smoke)
    (tmp_path / "sub").mkdir()
    _write(
        tmp_path / "sub" / "middle.yaml",
        {"base": "../root.yaml", "name": "middle", "model": {"hidden_size": 128}, "data": {"json_keys": ["text"]}},
    )
    leaf = _write(
        tmp_path / "sub" / "leaf.yaml",
        {
            "base": "middle.yaml",
            "name": "leaf",
            "evaluate": None,
            "training": {"lr": 2.0e-3},
            "data": {"split": "98,1,1"},
        },
    )
    resolved = load_recipe(str(leaf))
    expected = {**smoke, "name": "leaf"}
    expected["model"] = {**smoke["model"], "hidden_size": 128}
    expected["data"] = {**smoke["data"], "json_keys": ["text"], "split": "98,1,1"}  # the list replaced whole
    expected["training"] = {**smoke["training"], "lr": 2.0e-3}
    assert resolved.to_dict() == recipe_from_dict(expected).to_dict()
    assert resolved.hash == recipe_from_dict(expected).hash  # `base` is not a recipe value
    assert "base" not in resolved.to_dict() and "base:" not in resolved.to_yaml()
    assert resolved.evaluate.humaneval_problems == 2  # an empty `evaluate:` keeps the base's section


def test_a_base_named_by_recipe_name_changes_nothing_but_the_delta(tmp_path):
    same = _write(tmp_path / "same.yaml", {"base": "smoke", "name": "smoke"})
    assert load_recipe(str(same)).hash == load_recipe("smoke").hash
    seeded = _write(tmp_path / "seeded.yaml", {"base": "smoke", "name": "smoke", "training": {"seed": 7}})
    assert load_recipe(str(seeded)).diff(load_recipe("smoke").to_dict()) == ["training.seed"]
    # --set applies over the merged recipe
    assert load_recipe(str(same), ["seed=7"]).hash == load_recipe(str(seeded)).hash


def test_a_cycle_of_bases_is_one_line_naming_the_file(tmp_path):
    a = _write(tmp_path / "a.yaml", {"base": "b.yaml", "name": "a"})
    _write(tmp_path / "b.yaml", {"base": "a.yaml", "name": "b"})
    with pytest.raises(UserError, match=r"cycle \(a.yaml -> b.yaml -> a.yaml\)") as caught:
        load_recipe(str(a))
    assert str(a.parent / "b.yaml") in str(caught.value) and "\n" not in str(caught.value)
    itself = _write(tmp_path / "self.yaml", {"base": "self.yaml", "name": "self"})
    with pytest.raises(UserError, match=r"self.yaml: recipe bases form a cycle \(self.yaml -> self.yaml\)"):
        load_recipe(str(itself))


def test_an_unknown_or_malformed_base_is_one_line_naming_the_file(tmp_path):
    typo = _write(tmp_path / "typo.yaml", {"base": "smok", "name": "typo"})
    with pytest.raises(UserError, match=rf"^{re.escape(str(typo))}: unknown base 'smok'; did you mean 'smoke'\?"):
        load_recipe(str(typo))
    missing = _write(tmp_path / "missing.yaml", {"base": "../nowhere.yaml", "name": "missing"})
    with pytest.raises(UserError, match=rf"^{re.escape(str(missing))}: base ../nowhere.yaml does not exist"):
        load_recipe(str(missing))
    listed = _write(tmp_path / "listed.yaml", {"base": ["smoke"], "name": "listed"})
    with pytest.raises(UserError, match="base must be a recipe name or a path relative to this file"):
        load_recipe(str(listed))
    nameless = _write(tmp_path / "nameless.yaml", {"base": "smoke"})
    with pytest.raises(UserError, match=rf"^{re.escape(str(nameless))}: missing 'name'"):
        load_recipe(str(nameless))


def test_finding_and_loading_recipes_never_imports_torch():
    # a family with variants for several GPU counts is resolved here with the count given
    code = (
        "import sys; from megatron_core import config; config.load_recipe('smoke-tp2pp2'); "
        "config.resolve_recipe_path('codeparrot-small', gpus=1); print('torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "False"


def test_a_copy_of_a_variant_does_not_join_its_family(tmp_path, monkeypatch):
    """A sweep made from codeparrot-small-8gpu must not become the family's 8-GPU variant without saying so."""
    import shutil

    recipes = tmp_path / "recipes"
    shutil.copytree(config.recipes_dir(), recipes)
    sweep = "base: codeparrot-small-8gpu\nname: my-lr-sweep\ntraining:\n  lr: 1.0e-4\n"
    (recipes / "my-lr-sweep.yaml").write_text(sweep)
    monkeypatch.setenv("MEGATRON_RECIPES_DIR", str(recipes))
    for gpus in (0, 1, 8):
        assert config.resolve_recipe_path("codeparrot-small", gpus).stem != "my-lr-sweep"
    assert load_recipe("my-lr-sweep").family is None
    # a copy that claims the family for the same GPU count is refused, naming both files
    (recipes / "my-lr-sweep.yaml").write_text(
        "base: codeparrot-small-8gpu\nname: my-lr-sweep\nfamily: codeparrot-small\n"
    )
    with pytest.raises(UserError, match="two recipes for 8 GPU.*codeparrot-small-8gpu.yaml and my-lr-sweep.yaml"):
        config.resolve_recipe_path("codeparrot-small", 8)
