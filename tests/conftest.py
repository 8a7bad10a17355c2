"""Suite-wide test settings: the tokenizer's verdict cache lives in a temporary directory, so the
tests neither read verdicts a user's runs left in ~/.cache nor leave any there; and torch's generator is
seeded per test and per module, from their names."""

import os
import zlib

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _private_tokenizer_cache(tmp_path_factory):
    previous = os.environ.get("MEGATRON_CORE_TOKENIZER_CACHE")
    os.environ["MEGATRON_CORE_TOKENIZER_CACHE"] = str(tmp_path_factory.mktemp("tokenizer-cache"))
    yield
    if previous is None:
        os.environ.pop("MEGATRON_CORE_TOKENIZER_CACHE", None)
    else:
        os.environ["MEGATRON_CORE_TOKENIZER_CACHE"] = previous


def _seed_torch(nodeid: str) -> None:
    torch.manual_seed(zlib.crc32(nodeid.encode()))


@pytest.fixture(autouse=True)
def _seed_torch_per_test(request):
    """Each test draws from torch's global generator seeded by its own name, so a test's random inputs do
    not depend on which tests its xdist worker ran before it: a failure reproduces on every run, alone or
    in the suite, instead of showing once in a few hundred CI runs."""
    _seed_torch(request.node.nodeid)


@pytest.fixture(autouse=True, scope="module")
def _seed_torch_per_module(request):
    """The same for module-scoped fixtures, which are built before any test's own seed: autouse fixtures
    run first within their scope, so this one precedes them."""
    _seed_torch(request.node.nodeid)
