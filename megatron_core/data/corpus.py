"""Build a recipe's corpus: loose JSON lines, key `content` plus where each document came from.

The sources are typed (megatron_core.config.schema: PythonStdlibSource, JsonlSource, HfDatasetSource,
each documented there) and checked when the recipe loads; this module reads each kind. A new kind is its
dataclass in schema.py (with its entry in SOURCE_TYPES) and its reader in _READERS here.
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
from typing import Callable, Iterator, Optional, Sequence

from megatron_core.config import CorpusSource, HfDatasetSource, JsonlSource, PythonStdlibSource
from megatron_core.data.hub import hub_commit
from megatron_core.errors import UserError, require_package
from megatron_core.files import replace_atomically
from megatron_core.log import get_logger

_LOG = get_logger(__name__, tag="corpus", stderr=True)

_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def _stdlib_documents(source: PythonStdlibSource) -> Iterator[dict]:
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        paths.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    paths.sort(key=lambda p: p.relative_to(root).as_posix())
    if source.shuffle_seed is not None:
        random.Random(source.shuffle_seed).shuffle(paths)
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # deliberately broken encodings in the test suite's data
        yield {"content": text, "path": path.relative_to(root).as_posix(), "source": "python-stdlib"}


def _jsonl_documents(source: JsonlSource) -> Iterator[dict]:
    for pattern in source.paths:
        files = sorted(glob.glob(os.path.expanduser(pattern)))
        if not files:
            raise UserError(f"corpus source jsonl: {pattern} matches no file; check the path")
        for path in files:
            yield from _read_jsonl_file(path, source.key)


def _read_jsonl_file(path: str, key: str) -> Iterator[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise UserError(
                        f"{path} line {number}: not UTF-8 ({exc.reason} at column {exc.start + 1}); "
                        "re-encode the file as UTF-8"
                    ) from None
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
        raise UserError(
            f"cannot read {path}: {type(exc).__name__}: {exc}; check the file (a truncated or mislabelled .gz?)"
        ) from None


def _hf_documents(source: HfDatasetSource) -> Iterator[dict]:
    require_package("datasets", "hub", "a corpus source of type hf-dataset")
    import datasets

    name, key, split, revision = source.name, source.key, source.split, source.revision
    local = Path(name)
    try:
        if any((local / marker).exists() for marker in ("dataset_dict.json", "dataset_info.json", "state.json")):
            ds = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[split]
        elif local.is_dir():
            files = sorted(
                p
                for p in local.rglob("*")
                if p.suffix in (".parquet", ".json", ".jsonl") or p.name.endswith(".jsonl.gz")
            )
            if not files:
                raise UserError(f"corpus source hf-dataset: {name} holds no parquet/json files")
            builder = "parquet" if files[0].suffix == ".parquet" else "json"
            ds = datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train")
        else:
            if not revision:
                raise UserError(
                    f"corpus source hf-dataset {name}: pin a 'revision' (commit sha or tag) for a reproducible corpus"
                )
            revision = hub_commit(name, revision, "dataset")  # what a branch or tag points at now, recorded
            _LOG.info(f"hf-dataset {name}@{source.revision} resolved to commit {revision}")
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


# Each source type's reader (a type without one is refused by tests/test_corpus_sources.py).
_READERS: dict[type[CorpusSource], Callable[..., Iterator[dict]]] = {
    PythonStdlibSource: _stdlib_documents,
    JsonlSource: _jsonl_documents,
    HfDatasetSource: _hf_documents,
}


def iter_documents(sources: Sequence[CorpusSource]) -> Iterator[dict]:
    for source in sources:
        yield from _READERS[type(source)](source)


def build_corpus(
    sources: Sequence[CorpusSource], out_path, max_documents: Optional[int] = None, max_bytes: Optional[int] = None
) -> dict:
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
            raise UserError(
                f"the corpus sources {[source.to_dict() for source in sources]} gave no documents; "
                "check them (and max_documents/max_bytes)"
            )

    replace_atomically(out_path, write)
    summary = {
        "documents": documents,
        "content_bytes": content_bytes,
        "per_source": per_source,
        "path": str(out_path),
        "resolved_revisions": resolved,
    }
    if any(isinstance(source, PythonStdlibSource) for source in sources):
        summary["python"] = platform.python_version()  # the standard library it read is this Python's
    _LOG.info(f"{documents} documents, {content_bytes / 1e6:.1f} MB of content -> {out_path}")
    return summary
