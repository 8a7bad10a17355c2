"""Session-wide test settings: the tokenizer's verdict cache lives in a temporary directory, so the
tests neither read verdicts a user's runs left in ~/.cache nor leave any there."""

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _private_tokenizer_cache(tmp_path_factory):
    previous = os.environ.get("MEGATRON_CORE_TOKENIZER_CACHE")
    os.environ["MEGATRON_CORE_TOKENIZER_CACHE"] = str(tmp_path_factory.mktemp("tokenizer-cache"))
    yield
    if previous is None:
        os.environ.pop("MEGATRON_CORE_TOKENIZER_CACHE", None)
    else:
        os.environ["MEGATRON_CORE_TOKENIZER_CACHE"] = previous
