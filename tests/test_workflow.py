"""The recipe's steps behave like make: reused when up to date, rebuilt when an input changes,
never left half-written."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_core import workflow
from megatron_core.config import load_recipe
from megatron_core.data.indexed_dataset import IndexedDataset
from megatron_core.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("work")


def test_data_steps_build_once_and_are_reused(workdir, capsys):
    r = load_recipe("smoke")
    step = workflow.ensure_data(r, workdir)
    manifest = step.manifest()
    assert manifest["recipe_hash"] == r.hash and manifest["stage_hash"] == r.stage_hash("preprocess")
    prefix = step.directory / manifest["prefixes"][0]
    ds = IndexedDataset(str(prefix))
    assert len(ds) > 0 and len(ds.document_indices) == manifest["summary"]["documents"] + 1

    corpus_lines = (workflow.ensure_corpus(r, workdir).directory / "corpus.jsonl").read_text().splitlines()
    assert len(corpus_lines) == r.corpus.max_documents
    assert all("content" in json.loads(line) for line in corpus_lines)

    capsys.readouterr()
    again = workflow.ensure_data(load_recipe("smoke", ["lr=0.5"]), workdir)  # a training value: data unchanged
    assert again.directory == step.directory
    out = capsys.readouterr().out
    assert "preprocess: up to date" in out and "building" not in out


def test_changed_input_gets_a_new_directory(workdir):
    base = load_recipe("smoke")
    changed = load_recipe("smoke", ["tokenizer.vocab_size=400"])
    a = workflow.ensure_data(base, workdir)
    b = workflow.ensure_data(changed, workdir)
    assert a.directory != b.directory
    # The corpus did not change, so it is shared.
    assert workflow.ensure_corpus(base, workdir).directory == workflow.ensure_corpus(changed, workdir).directory
    assert workflow.ensure_tokenizer(changed, workdir).manifest()["vocab_size"] <= 400


def test_failed_step_leaves_nothing_that_looks_done(workdir):
    r = load_recipe("smoke", ["corpus.sources=[{type: jsonl, paths: [/nonexistent/*.jsonl]}]"])
    with pytest.raises(UserError):
        workflow.ensure_corpus(r, workdir)
    step = workflow.step_dir(r, workdir, "corpus")
    assert not step.directory.exists()
    assert not list(step.directory.parent.glob(step.directory.name + ".tmp-*"))


def test_invoke_task_reports_people_errors(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "invoke", "corpus", "--recipe", "smoke", "--set", "lrr=1", "--workdir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "error: --set lrr: unknown key; did you mean 'lr'?" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_invoke_recipes_lists_every_recipe():
    proc = subprocess.run([sys.executable, "-m", "invoke", "recipes"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:4] == ["name", "version", "family", "GPUs"]
    row = next(line for line in lines if line.startswith("codeparrot-small-8gpu"))
    assert row.split()[3] == "8" and "111M" in row and "29.5B" in row


def test_tokenizer_on_keys_the_corpus_lacks_says_which_keys_it_has(workdir):
    r = load_recipe("smoke", ["data.json_keys=[text]"])  # Megatron's default key; our corpus writes `content`
    with pytest.raises(UserError, match=r"no text under data.json_keys \['text'\].*content.*data.json_keys"):
        workflow.ensure_tokenizer(r, workdir)
    assert not list((workdir / "smoke").glob(f"tokenizer-{r.stage_hash('tokenizer')}*"))  # nothing half-made


def test_lookups_never_build_and_name_the_task_to_run(tmp_path):
    r = load_recipe("smoke")
    for lookup, task in ((workflow.tokenizer_files, "tokenizer"), (workflow.data_prefixes, "preprocess")):
        with pytest.raises(UserError, match=f"invoke {task} --recipe smoke"):
            lookup(r, tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing was built by asking
