"""The package's one logger (megatron_core.log): the lines users saw before, a rank prefix off rank 0,
and a user can silence or redirect it through the standard `logging` module."""

from __future__ import annotations

import logging

import pytest

from megatron_core import workflow
from megatron_core.data import tokenizer  # noqa: F401 - registers the tokenizer's logger (stderr, tagged)
from megatron_core.training.logging import RunLogger

PACKAGE = logging.getLogger("megatron_core")


@pytest.fixture
def restore_logger():
    level, handlers = PACKAGE.level, list(PACKAGE.handlers)
    yield
    PACKAGE.setLevel(level)
    PACKAGE.handlers[:] = handlers


def test_lines_and_streams_as_before(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    workflow.log("corpus: up to date")
    logging.getLogger("megatron_core.data.tokenizer").info("vocab 10")
    captured = capsys.readouterr()
    assert captured.out == "[workflow] corpus: up to date\n"
    assert captured.err == "[tokenizer] vocab 10\n"


def test_rank_prefix_off_rank_zero_but_not_on_the_training_writer(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    workflow.log("corpus: building")
    RunLogger(tmp_path, writer=True, tensorboard=False).info("saved checkpoint")
    # The training lines come from the one writer rank (the last pipeline stage's under PP): bare, as Megatron's.
    assert capsys.readouterr().out == "[rank 3] [workflow] corpus: building\nsaved checkpoint\n"


@pytest.mark.usefixtures("restore_logger")
def test_a_user_can_silence_or_redirect_it(capsys):
    PACKAGE.setLevel(logging.WARNING)
    workflow.log("not shown")
    assert capsys.readouterr() == ("", "")

    PACKAGE.setLevel(logging.INFO)
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    PACKAGE.handlers[:] = [handler]
    workflow.log("to the user's handler")
    assert capsys.readouterr() == ("", "")
    assert [(r.name, r.getMessage()) for r in seen] == [("megatron_core.workflow", "to the user's handler")]
