"""`load_recipe`: a recipe name, family or file, read with its bases, `--set` overrides applied, typed
and validated."""

from __future__ import annotations

from typing import Optional

from megatron_core.config.discovery import read_recipe_file, resolve_recipe_path
from megatron_core.config.overrides import apply_overrides
from megatron_core.config.parsing import recipe_from_dict
from megatron_core.config.schema import Recipe


def load_recipe(spec: str, overrides: Optional[list[str]] = None, gpus: Optional[int] = None) -> Recipe:
    path = resolve_recipe_path(spec, gpus)
    raw = apply_overrides(read_recipe_file(path), list(overrides or []))
    return recipe_from_dict(raw, source=str(path), overrides=overrides)
