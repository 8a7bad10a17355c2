"""`--set key=value` overrides: applied to a recipe's raw mapping before it is typed and validated, so an
override is checked exactly like a value written in the file."""

from __future__ import annotations

import dataclasses
import json

import yaml

from megatron_core.config.parsing import did_you_mean
from megatron_core.config.schema import SECTIONS, TOP_LEVEL
from megatron_core.errors import UserError


def _field_index() -> dict[str, list[str]]:
    """Bare field name -> the sections that hold it (names are unique today, but check)."""
    index: dict[str, list[str]] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            index.setdefault(f.name, []).append(section)
    return index


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `key=value` strings (`lr=1e-4` or `training.lr=1e-4`; YAML-typed values) to a raw
    recipe mapping. Types are checked afterwards by the schema like any other value."""
    raw = json.loads(json.dumps(raw))  # deep copy of plain data
    index = _field_index()
    for item in overrides:
        if "=" not in item:
            raise UserError(f"--set {item!r}: expected key=value, e.g. --set lr=1e-4")
        key, text = item.split("=", 1)
        key = key.strip()
        value = yaml.safe_load(text) if text.strip() else ""
        if key in TOP_LEVEL:
            raw[key] = value
            continue
        if "." in key:
            section, name = key.split(".", 1)
            if section not in SECTIONS:
                raise UserError(f"--set {key}: unknown section '{section}'{did_you_mean(section, SECTIONS)}")
        else:
            name = key
            if name not in index:
                raise UserError(f"--set {key}: unknown key{did_you_mean(name, index)}")
            if len(index[name]) > 1:
                raise UserError(f"--set {key}: ambiguous, say one of {[s + '.' + name for s in index[name]]}")
            section = index[name][0]
        raw.setdefault(section, {})
        if raw[section] is None:
            raw[section] = {}
        raw[section][name] = value
    return raw
