"""What names run directories: the hash of a resolved recipe, and per pipeline stage the hash of exactly
what that stage's output depends on (the workflow's knowledge of which keys feed which stage).

Pure functions of the resolved dictionary (`Recipe.to_dict()`), so this module needs nothing else.
"""

from __future__ import annotations

import hashlib
import json
import platform
from typing import Any, Collection

# The data-section keys the preprocessing step reads (the rest of `data` is for training).
PREPROCESS_KEYS = ("json_keys", "append_eod", "split_sentences", "keep_newlines", "dataset_impl")


def canonical_hash(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def stage_hash(resolved: dict, stage: str, *, run_extending: Collection[str]) -> str:
    """Hash of what a pipeline stage's output depends on (so a change of lr does not redo the corpus,
    and a change of the corpus redoes everything downstream). A corpus read from the running Python's
    standard library is keyed by that Python's version too. `run_extending`: the keys the train stage's
    hash leaves out (config.resume.RUN_EXTENDING_KEYS: how long and how visibly a run trains)."""
    d = resolved
    parts = {"corpus": {"corpus": d["corpus"]}}
    if any(source.get("type") == "python-stdlib" for source in d["corpus"]["sources"]):
        parts["corpus"]["python"] = platform.python_version()
    # a trained tokenizer learns from the texts under data.json_keys
    parts["tokenizer"] = {**parts["corpus"], "tokenizer": d["tokenizer"], "json_keys": d["data"]["json_keys"]}
    parts["preprocess"] = {
        **parts["tokenizer"],
        "data": {k: d["data"][k] for k in PREPROCESS_KEYS},
    }
    # the run (training, its checkpoints, the converted model) is named by all but how long and how visibly
    # it trains: `--set train_iters=2000` continues the same run, as raising --train-iters does in Megatron,
    # and `convert`/`evaluate` (or `--set evaluate...`) find it without the same --set
    parts["train"] = without_keys(d, run_extending)
    if "python" in parts["corpus"]:
        parts["train"]["python"] = parts["corpus"]["python"]
    if stage not in parts:
        raise ValueError(f"unknown stage {stage!r}; one of {', '.join(parts)}")
    return canonical_hash(parts[stage])


def losses_hash(resolved: dict) -> str:
    """What a run's losses depend on: everything but how it is evaluated afterwards and the prose (the
    golden files' key; train_iters counts, through the learning-rate schedule, though it does not name the
    run directory)."""
    named = {k: v for k, v in resolved.items() if k not in ("evaluate", "description", "hardware")}
    if any(source.get("type") == "python-stdlib" for source in resolved["corpus"]["sources"]):
        named["python"] = platform.python_version()
    return canonical_hash(named)


def without_keys(resolved: dict, dotted_keys) -> dict:
    """`resolved` less the top-level ("parallel") and section ("training.train_iters") keys named."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in resolved.items() if k not in dotted_keys}
    for dotted in dotted_keys:
        section, _, key = dotted.partition(".")
        if key and isinstance(out.get(section), dict):
            out[section].pop(key, None)
    return out
