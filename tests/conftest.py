"""Suite-wide test settings: torch's generator is seeded per test and per module, from their names."""

import zlib

import pytest
import torch


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
