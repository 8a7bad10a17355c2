"""The recipe's steps as a small make: corpus -> tokenizer -> preprocess -> train -> convert -> evaluate.

Each step writes one directory under `{workdir}/{recipe name}/`, named by the hash of exactly
what its output depends on (`Recipe.stage_hash`), and a `manifest.json` written last. A step
whose manifest exists is reused; a step whose inputs changed gets a new directory, so nothing
stale is ever reused and nothing is redone twice. Steps are built in a temporary directory and
renamed when complete, so an interrupted step never looks done.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from megatron_core.config import Recipe
from megatron_core.data.hub import hub_commit
from megatron_core.errors import UserError
from megatron_core.files import publish_directory
from megatron_core.log import get_logger

_LOG = get_logger(__name__, tag="workflow")

MANIFEST = "manifest.json"
# Steps ask for their inputs again (data -> tokenizer -> corpus, and corpus once more): within one outer
# ensure_* call each step is reported once. None outside such a call.
_reported: Optional[set] = None


def log(message: str) -> None:
    _LOG.info(message)


@dataclass
class Step:
    name: str
    directory: Path

    @property
    def manifest_path(self) -> Path:
        return self.directory / MANIFEST

    @property
    def done(self) -> bool:
        return self.manifest_path.exists()

    def manifest(self) -> dict:
        return json.loads(self.manifest_path.read_text())


def recipe_root(recipe: Recipe, workdir: str | os.PathLike) -> Path:
    return Path(workdir) / recipe.name


def step_dir(recipe: Recipe, workdir, stage: str) -> Step:
    return Step(stage, recipe_root(recipe, workdir) / f"{stage}-{recipe.stage_hash(stage)}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_staging(directory: Path) -> list[Path]:
    """Remove `{directory}.tmp-<pid>` staging directories left by steps whose process is gone (a
    killed build); a live process's staging is left alone."""
    removed = []
    for stale in directory.parent.glob(f"{directory.name}.tmp-*"):
        pid = stale.name.rsplit("-", 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
            log(f"removed {stale}: staging of an interrupted build (process {pid} is gone)")
            removed.append(stale)
    return removed


def _build(step: Step, recipe: Recipe, build: Callable[[Path], dict], force: bool = False) -> Step:
    """Run `build(tmp_dir) -> manifest fields` unless the step is done; publish atomically."""
    remove_stale_staging(step.directory)
    if step.done and not force:
        if _reported is None or step.directory not in _reported:
            log(f"{step.name}: up to date in {step.directory}")
        _remember_reported(step)
        return step
    tmp = step.directory.with_name(step.directory.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    start = time.time()
    log(f"{step.name}: building in {step.directory}")
    try:
        fields = build(tmp)
        manifest = {
            "stage": step.name,
            "stage_hash": recipe.stage_hash(step.name),
            "recipe": recipe.name,
            "recipe_version": recipe.version,
            "recipe_hash": recipe.hash,
            "seconds": round(time.time() - start, 3),
            **fields,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str) + "\n")
        publish_directory(tmp, step.directory)  # a forced rebuild replaces the old output only now
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"{step.name}: done in {time.time() - start:.1f} s")
    _remember_reported(step)  # no "up to date" line after "done"
    return step


def _remember_reported(step: Step) -> None:
    if _reported is not None:
        _reported.add(step.directory)


def _reports_once(ensure: Callable) -> Callable:
    """An ensure_* step: the steps it (and what it calls) reaches are reported once, not once per caller."""
    import functools

    @functools.wraps(ensure)
    def wrapper(*args, **kwargs):
        global _reported
        outermost = _reported is None
        if outermost:
            _reported = set()
        try:
            return ensure(*args, **kwargs)
        finally:
            if outermost:
                _reported = None

    return wrapper


# ----------------------------------------------------------------------------------------------
# Steps
# ----------------------------------------------------------------------------------------------


@_reports_once
def ensure_corpus(recipe: Recipe, workdir, force: bool = False) -> Step:
    """Build the corpus step unless it is done."""
    from megatron_core.data.corpus import build_corpus

    def build(tmp: Path) -> dict:
        c = recipe.corpus
        summary = build_corpus(c.sources, tmp / "corpus.jsonl", max_documents=c.max_documents, max_bytes=c.max_bytes)
        return {"corpus": "corpus.jsonl", "summary": summary}

    return _build(step_dir(recipe, workdir, "corpus"), recipe, build, force)


def _done_step(recipe: Recipe, workdir, stage: str, task: str) -> Step:
    """A finished step's directory, or a clear error naming the task that builds it (never builds)."""
    step = step_dir(recipe, workdir, stage)
    if not step.done:
        raise UserError(
            f"the {stage} step of recipe {recipe.name} is not built under {workdir} "
            f"({step.directory} is missing): run `invoke {task} --recipe {recipe.name}` first"
        )
    return step


@_reports_once
def ensure_tokenizer(recipe: Recipe, workdir, force: bool = False) -> Step:
    """Build the tokenizer step (and the corpus it is trained on) unless it is done."""
    from megatron_core.data import tokenizer as tok

    t = recipe.tokenizer
    needs_corpus = t.vocab_file is None and t.hf_tokenizer is None
    corpus_file = ensure_corpus(recipe, workdir).directory / "corpus.jsonl" if needs_corpus else None

    def build(tmp: Path) -> dict:
        vocab, merges = tmp / "vocab.json", tmp / "merges.txt"
        if t.vocab_file is not None:
            origin = "files"
            tok.check_tokenizer_files(t.vocab_file, t.merge_file)
            shutil.copyfile(t.vocab_file, vocab)
            shutil.copyfile(t.merge_file, merges)
        elif t.hf_tokenizer is not None:
            commit = _fetch_hub_tokenizer(t.hf_tokenizer, t.hf_tokenizer_revision, tmp)
            origin = f"hf:{t.hf_tokenizer}@{t.hf_tokenizer_revision} (commit {commit})"
        else:
            origin = "trained"
            tok.train_bpe_tokenizer(
                _iter_corpus_texts(corpus_file, recipe.data.json_keys),
                t.vocab_size,
                tmp,
                min_frequency=t.min_frequency,
            )
        tok.check_tokenizer_files(vocab, merges)
        loaded = tok.GPT2BPETokenizer(vocab, merges)
        fields = {
            "origin": origin,
            "vocab_file": "vocab.json",
            "merge_file": "merges.txt",
            "vocab_size": loaded.vocab_size,
            "eod": loaded.eod,
            "vocab_sha256": tok.file_sha256(vocab),
            "merges_sha256": tok.file_sha256(merges),
        }
        log(
            f"tokenizer ({origin}): vocab size {fields['vocab_size']}, vocab.json sha256 "
            f"{fields['vocab_sha256'][:16]}, merges.txt sha256 {fields['merges_sha256'][:16]}"
        )
        return fields

    return _build(step_dir(recipe, workdir, "tokenizer"), recipe, build, force)


def tokenizer_files(recipe: Recipe, workdir) -> tuple[Path, Path]:
    """The built vocab.json and merges.txt (a lookup: see ensure_tokenizer to build them)."""
    step = _done_step(recipe, workdir, "tokenizer", "tokenizer")
    return step.directory / "vocab.json", step.directory / "merges.txt"


def _fetch_hub_tokenizer(name: str, revision: str, out: Path) -> str:
    """Download vocab.json and merges.txt at the commit `revision` points at now; returns that commit
    (a branch moves; the manifest records what was taken)."""
    try:
        from huggingface_hub import hf_hub_download

        commit = hub_commit(name, revision, "model")
        for filename in ("vocab.json", "merges.txt"):
            shutil.copyfile(hf_hub_download(name, filename, revision=commit), out / filename)
        return commit
    except UserError:  # hub_commit's own message names the problem already
        raise
    except Exception as exc:  # noqa: BLE001 - any Hub failure means the same thing to the user
        raise UserError(
            f"cannot fetch tokenizer {name}@{revision} from the Hugging Face Hub ({type(exc).__name__}); "
            "on a machine without internet set tokenizer.vocab_file and tokenizer.merge_file "
            "(--set tokenizer.vocab_file=... --set tokenizer.merge_file=...)"
        ) from None


def _iter_corpus_texts(path: Path, keys: list):
    found, other_keys = 0, set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)
            for key in keys:
                if isinstance(doc.get(key), str):
                    found += 1
                    yield doc[key]
            if not found:
                other_keys.update(k for k, v in doc.items() if isinstance(v, str))
    if not found and other_keys:
        raise UserError(
            f"the corpus {path} has no text under data.json_keys {list(keys)}; its documents have "
            f"{', '.join(sorted(other_keys))}: set data.json_keys (e.g. --set data.json_keys=[content])"
        )


@_reports_once
def ensure_data(recipe: Recipe, workdir, force: bool = False) -> Step:
    """Build the .bin/.idx step (and the corpus and tokenizer it needs) unless it is done."""
    from megatron_core.data.preprocess import preprocess as run_preprocess
    from megatron_core.data.preprocess import preprocess_args

    vocab, merges = (ensure_tokenizer(recipe, workdir).directory / name for name in ("vocab.json", "merges.txt"))
    corpus_file = ensure_corpus(recipe, workdir).directory / "corpus.jsonl"
    d = recipe.data

    def build(tmp: Path) -> dict:
        args = preprocess_args(
            input=[str(corpus_file)],
            json_keys=list(d.json_keys),
            output_prefix=str(tmp / "data"),
            tokenizer_type=recipe.tokenizer.tokenizer_type,
            vocab_file=str(vocab),
            merge_file=str(merges),
            append_eod=d.append_eod,
            workers=d.workers,
            dataset_impl=d.dataset_impl,
            split_sentences=d.split_sentences,
            keep_newlines=d.keep_newlines,
            log_interval=d.log_interval,
        )
        summary = run_preprocess(args)
        level = "sentence" if d.split_sentences else "document"
        return {"prefixes": [f"data_{key}_{level}" for key in d.json_keys], "summary": summary}

    return _build(step_dir(recipe, workdir, "preprocess"), recipe, build, force)


def data_prefixes(recipe: Recipe, workdir) -> list:
    """What training reads: the recipe's explicit data_path (a prefix or a blend), else the
    recipe's own preprocessed output (its json keys blended with equal weight). A lookup: see
    ensure_data to build it."""
    if recipe.data.data_path:
        return list(recipe.data.data_path)
    step = _done_step(recipe, workdir, "preprocess", "preprocess")
    prefixes = [str(step.directory / p) for p in step.manifest()["prefixes"]]
    if len(prefixes) == 1:
        return prefixes
    return [x for p in prefixes for x in (1.0, p)]


@_reports_once
def ensure_training_inputs(recipe: Recipe, workdir) -> None:
    """Build what training reads unless it is done: the tokenizer, and the .bin/.idx unless the
    recipe names its own data_path."""
    ensure_tokenizer(recipe, workdir)
    if not recipe.data.data_path:
        ensure_data(recipe, workdir)


def run_dir(recipe: Recipe, workdir) -> Path:
    """Named by the train stage's hash, which leaves out how long and how visibly a run trains: a raised
    train_iters continues (and convert/evaluate find) the same run."""
    return recipe_root(recipe, workdir) / "runs" / recipe.stage_hash("train")
