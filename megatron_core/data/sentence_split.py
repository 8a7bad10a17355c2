"""Sentence splitting that needs no download: NLTK punkt trained on the input itself.

Megatron-LM loads the pretrained `punkt` pickle, which machines without internet do not have
(and NLTK 3.9+ replaced with `punkt_tab`). The punkt algorithm is unsupervised, so we learn its
parameters (abbreviations, collocations, sentence starters) from a deterministic sample of the
corpus: the first `sample_bytes` of text, in input order.
"""

from __future__ import annotations

from typing import Iterable

from nltk.tokenize.punkt import PunktLanguageVars, PunktParameters, PunktSentenceTokenizer, PunktTrainer


class KeepNewlinesLanguageVars(PunktLanguageVars):
    """Megatron's --keep-newlines: a newline after a sentence end stays with the sentence
    (punkt's default period context would swallow it as inter-sentence whitespace)."""

    # Same as punkt's pattern except that the whitespace after the sentence end is part of the
    # match (so it ends the sentence) instead of part of the look-ahead.
    _period_context_fmt = (
        r"\S*%(SentEndChars)s\s*"
        r"(?=(?P<after_tok>%(NonWord)s|(?P<next_tok>\S+)))"
    )


def train_punkt(texts: Iterable[str], sample_bytes: int = 4 << 20) -> PunktParameters:
    """Learn punkt parameters from the first `sample_bytes` (UTF-8) of texts."""
    trainer = PunktTrainer()
    taken = 0
    for text in texts:
        trainer.train(text, finalize=False)
        taken += len(text.encode("utf-8"))
        if taken >= sample_bytes:
            break
    trainer.finalize_training()
    return trainer.get_params()


def make_splitter(params: PunktParameters, keep_newlines: bool) -> PunktSentenceTokenizer:
    lang_vars = KeepNewlinesLanguageVars() if keep_newlines else PunktLanguageVars()
    return PunktSentenceTokenizer(params, lang_vars=lang_vars)
