"""What names run directories: the hash of a resolved recipe, and per pipeline stage the hash of exactly
what that stage's output depends on (the workflow's knowledge of which keys feed which stage).

Pure functions of the resolved dictionary (`Recipe.to_dict()`), so this module needs nothing else.
"""

from __future__ import annotations

import hashlib
import json
import platform
from typing import Any

# The data-section keys the preprocessing step reads (the rest of `data` is for training).
PREPROCESS_KEYS = ("json_keys", "append_eod", "split_sentences", "keep_newlines", "dataset_impl")


def canonical_hash(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def stage_hash(resolved: dict, stage: str) -> str:
    """Hash of what a pipeline stage's output depends on (so a change of lr does not redo the corpus,
    and a change of the corpus redoes everything downstream). A corpus read from the running Python's
    standard library is keyed by that Python's version too."""
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
    # the run (training, its checkpoints, the converted model) depends on everything but how it is
    # evaluated afterwards and the prose: `--set evaluate...` finds the same run
    parts["train"] = {k: v for k, v in d.items() if k not in ("evaluate", "description", "hardware")}
    if "python" in parts["corpus"]:
        parts["train"]["python"] = parts["corpus"]["python"]
    if stage not in parts:
        raise ValueError(f"unknown stage {stage!r}; one of {', '.join(parts)}")
    return canonical_hash(parts[stage])
