"""Build a recipe's corpus: loose JSON lines, key `content` plus where each document came from.

Source kinds (a list of dicts, as in recipe.corpus.sources):
- {"type": "python-stdlib", "shuffle_seed": N (optional)}: the running interpreter's standard-library
  `.py` files, sorted by relative path, or in a fixed pseudo-random order of those paths with
  `shuffle_seed` (so that Megatron's contiguous valid/test split samples the whole library rather
  than its last packages); site-packages/dist-packages, and files that are not valid UTF-8 (a few
  test fixtures on purpose), are left out.
- {"type": "jsonl", "paths": [globs], "key": "content"}: `.jsonl` / `.jsonl.gz` files.
- {"type": "hf-dataset", "name": ..., "revision": ..., "split": "train", "key": "content"}: through
  the `datasets` library; `name` may also be a local directory (save_to_disk, or parquet/json files).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import platform
import random
import sysconfig
from pathlib import Path
from typing import Iterator, Optional

from megatron_core.data.hub import hub_commit
from megatron_core.errors import UserError
from megatron_core.files import replace_atomically
from megatron_core.log import get_logger

_LOG = get_logger(__name__, tag="corpus", stderr=True)

SOURCE_TYPES = ("python-stdlib", "jsonl", "hf-dataset")
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def _stdlib_documents(source: dict) -> Iterator[dict]:
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        paths.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    paths.sort(key=lambda p: p.relative_to(root).as_posix())
    if source.get("shuffle_seed") is not None:
        random.Random(int(source["shuffle_seed"])).shuffle(paths)
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # deliberately broken encodings in the test suite's data
        yield {"content": text, "path": path.relative_to(root).as_posix(), "source": "python-stdlib"}


def _jsonl_documents(source: dict) -> Iterator[dict]:
    key = source.get("key", "content")
    patterns = source.get("paths") or []
    if isinstance(patterns, str):
        patterns = [patterns]
    if not patterns:
        raise UserError("corpus source jsonl needs 'paths' (files or globs of .jsonl / .jsonl.gz)")
    for pattern in patterns:
        files = sorted(glob.glob(os.path.expanduser(pattern)))
        if not files:
            raise UserError(f"corpus source jsonl: {pattern} matches no file; check the path")
        for path in files:
            yield from _read_jsonl_file(path, key)


def _read_jsonl_file(path: str, key: str) -> Iterator[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise UserError(f"{path} line {number}: not UTF-8 ({exc.reason} at column {exc.start + 1}); "
                                    "re-encode the file as UTF-8") from None
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                except ValueError as exc:
                    raise UserError(f"{path} line {number}: malformed JSON ({exc}); fix the line") from None
                if not isinstance(doc, dict) or not isinstance(doc.get(key), str):
                    raise UserError(f"{path} line {number}: no string under key {key!r}; set the source's 'key'")
                yield {"content": doc[key], "path": path, "line": number, "source": "jsonl"}
    except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
        raise UserError(f"cannot read {path}: {type(exc).__name__}: {exc}; check the file "
                        "(a truncated or mislabelled .gz?)") from None


def _hf_documents(source: dict) -> Iterator[dict]:
    import datasets

    name = source.get("name")
    if not name:
        raise UserError("corpus source hf-dataset needs 'name' (a Hub dataset id or a local directory)")
    key, split, revision = source.get("key", "content"), source.get("split", "train"), source.get("revision")
    local = Path(name)
    try:
        if any((local / marker).exists() for marker in ("dataset_dict.json", "dataset_info.json", "state.json")):
            ds = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[split]
        elif local.is_dir():
            files = sorted(p for p in local.rglob("*")
                           if p.suffix in (".parquet", ".json", ".jsonl") or p.name.endswith(".jsonl.gz"))
            if not files:
                raise UserError(f"corpus source hf-dataset: {name} holds no parquet/json files")
            builder = "parquet" if files[0].suffix == ".parquet" else "json"
            ds = datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train")
        else:
            if not revision:
                raise UserError(f"corpus source hf-dataset {name}: pin a 'revision' (commit sha or tag) "
                                "for a reproducible corpus")
            revision = hub_commit(name, revision, "dataset")  # what a branch or tag points at now, recorded
            _LOG.info(f"hf-dataset {name}@{source.get('revision')} resolved to commit {revision}")
            ds = datasets.load_dataset(name, revision=revision, split=split, streaming=True)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - the datasets library raises many kinds for "cannot get it"
        raise UserError(
            f"cannot load dataset {name} (split {split}, revision {revision}): {type(exc).__name__}: {exc}; "
            "without internet use a local directory or a jsonl source"
        ) from None
    for index, row in enumerate(ds):
        value = row.get(key)
        if not isinstance(value, str):
            raise UserError(f"dataset {name} row {index}: no string under key {key!r}; set the source's 'key'")
        yield {"content": value, "dataset": name, "revision": revision, "row": index, "source": "hf-dataset"}


_READERS = {"python-stdlib": _stdlib_documents, "jsonl": _jsonl_documents, "hf-dataset": _hf_documents}


def iter_documents(sources: list) -> Iterator[dict]:
    for source in sources:
        kind = source.get("type") if isinstance(source, dict) else None
        if kind not in _READERS:
            raise UserError(f"corpus source {source!r} has unknown type {kind!r}; use one of {', '.join(SOURCE_TYPES)}")
        yield from _READERS[kind](source)


def build_corpus(sources: list, out_path, max_documents: Optional[int] = None, max_bytes: Optional[int] = None) -> dict:
    """Write every source's documents (in order) as JSON lines to out_path, atomically.
    Stops before the document that would exceed max_documents or max_bytes (of content, UTF-8)."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    documents = content_bytes = 0
    per_source: dict[str, int] = {}
    resolved: dict[str, str] = {}  # hf-dataset name -> the commit its revision resolved to

    def write(tmp: Path) -> None:
        nonlocal documents, content_bytes
        with open(tmp, "w", encoding="utf-8") as f:
            for doc in iter_documents(sources):
                size = len(doc["content"].encode("utf-8"))
                if max_documents is not None and documents >= max_documents:
                    break
                if max_bytes is not None and content_bytes + size > max_bytes:
                    break
                f.write(json.dumps(doc, ensure_ascii=False) + "\n")
                documents += 1
                content_bytes += size
                per_source[doc["source"]] = per_source.get(doc["source"], 0) + 1
                if doc["source"] == "hf-dataset":
                    resolved[doc["dataset"]] = doc["revision"]
        if documents == 0:
            raise UserError(f"the corpus sources {sources!r} gave no documents; "
                            "check them (and max_documents/max_bytes)")

    replace_atomically(out_path, write)
    summary = {"documents": documents, "content_bytes": content_bytes, "per_source": per_source, "path": str(out_path),
               "resolved_revisions": resolved}
    if any(source.get("type") == "python-stdlib" for source in sources):
        summary["python"] = platform.python_version()  # the standard library it read is this Python's
    _LOG.info(f"{documents} documents, {content_bytes / 1e6:.1f} MB of content -> {out_path}")
    return summary
