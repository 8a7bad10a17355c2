"""Typed construction of a `Recipe` from a raw mapping (a parsed YAML file with its `--set` overrides
applied), with messages for people: unknown keys get a "did you mean", values a type check."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Optional, Union

from megatron_core.config.schema import SECTIONS, SOURCE_TYPES, TOP_LEVEL, CorpusSource, Recipe
from megatron_core.config.validation import validate
from megatron_core.errors import UserError


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except UserError as exc:
                errors.append(exc)
        raise UserError(f"{where}: got {value!r} ({type(value).__name__}), expected {_type_name(tp)}")
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise UserError(f"{where}: got {value!r}, expected one of {_type_name(tp)}")
    if origin is tuple:  # one or more items; a single string may stand for a list of one (a path)
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not items:
            raise UserError(f"{where}: got {value!r}, expected a non-empty list")
        return tuple(_coerce(item, typing.get_args(tp)[0], f"{where}[{i}]") for i, item in enumerate(items))
    if tp is CorpusSource:
        return _build_source(value, where)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads `5e-4` as a string; accept a number spelled that way
            return float(value)
        except ValueError:
            pass
    if tp is int and isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    expected = {list: list, dict: dict}.get(origin or tp, tp)
    if expected in (int, float, str, bool, list, dict):
        if isinstance(value, expected) and not (expected is int and isinstance(value, bool)):
            return value
        raise UserError(f"{where}: got {value!r} ({type(value).__name__}), expected {_type_name(tp)}")
    return value


def did_you_mean(key: str, valid: typing.Iterable[str]) -> str:
    match = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else ""


def _build_source(raw: Any, where: str) -> CorpusSource:
    """A corpus source mapping typed by its `type` into that source's dataclass."""
    kinds = ", ".join(SOURCE_TYPES)
    if not isinstance(raw, dict):
        raise UserError(f"{where}: got {raw!r} ({type(raw).__name__}), expected a mapping with a type ({kinds})")
    kind = raw.get("type")
    if not isinstance(kind, str) or kind not in SOURCE_TYPES:
        problem = "missing" if kind is None else f"unknown source type {kind!r}{did_you_mean(str(kind), SOURCE_TYPES)}"
        raise UserError(f"{where}.type: {problem}; use one of {kinds}")
    cls = SOURCE_TYPES[kind]
    hints = typing.get_type_hints(cls)
    keys = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in raw.items():
        if key == "type":
            continue
        if key not in keys:
            raise UserError(
                f"{where}.{key}: unknown key for a {kind} source{did_you_mean(str(key), keys)} "
                f"(its keys: {', '.join(keys) or 'none'})"
            )
        values[key] = _coerce(value, hints[key], f"{where}.{key}")
    for key, spec in keys.items():
        required = spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING
        if required and values.get(key, "") == "":
            problem = "missing" if key not in values else "empty"
            raise UserError(f"{where}.{key}: {problem}; a {kind} source needs it (its keys: {', '.join(keys)})")
    return cls(**values)


def _build_section(cls: type, values: Any, section: str):
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise UserError(f"recipe section '{section}' must be a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            elsewhere = [
                f"{name}.{key}"
                for name, other in SECTIONS.items()
                if name != section and key in typing.get_type_hints(other)
            ]
            hint = f"; it belongs in another section: '{elsewhere[0]}'" if elsewhere else did_you_mean(key, hints)
            raise UserError(f"unknown key '{section}.{key}'{hint}")
        kwargs[key] = _coerce(value, hints[key], f"{section}.{key}")
    return cls(**kwargs)


def recipe_from_dict(raw: dict, source: str = "<dict>", overrides: Optional[list] = None) -> Recipe:
    if not isinstance(raw, dict):
        raise UserError(f"{source}: a recipe must be a YAML mapping")
    valid_top = set(TOP_LEVEL) | set(SECTIONS)
    for key in raw:
        if key not in valid_top:
            raise UserError(f"{source}: unknown key '{key}'{did_you_mean(key, valid_top)}")
    for key in ("name", "version"):
        if key not in raw:
            raise UserError(f"{source}: missing '{key}' (every recipe names itself and pins a version)")
    top_hints = typing.get_type_hints(Recipe)
    top = {k: _coerce(raw[k], top_hints[k], k) for k in TOP_LEVEL if k in raw}
    sections = {name: _build_section(cls, raw.get(name), name) for name, cls in SECTIONS.items()}
    recipe = Recipe(**top, **sections, source=source, overrides=list(overrides or []))
    validate(recipe)
    return recipe
