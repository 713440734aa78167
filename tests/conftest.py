"""Fixtures shared by the whole suite (helpers live in helpers.py)."""

import pytest
from hypothesis import settings

from .helpers import BACKENDS

# Hypothesis budgets: CI runs a fixed, repeatable set; --fuzz-long a large fresh one.
settings.register_profile("qkv-ci", max_examples=40, derandomize=True)


def pytest_addoption(parser):
    parser.addoption(
        "--fuzz-long",
        nargs="?",
        const=2000,
        type=int,
        default=None,
        metavar="N",
        help="run the hypothesis fuzz with N fresh examples (default 2000) instead of CI's 40",
    )


def pytest_configure(config):
    n = config.getoption("--fuzz-long")
    if n:
        settings.register_profile("qkv-fuzz-long", max_examples=n, derandomize=False)
        settings.load_profile("qkv-fuzz-long")
    else:
        settings.load_profile("qkv-ci")


@pytest.fixture(params=list(BACKENDS), ids=list(BACKENDS))
def backend(request):
    return BACKENDS[request.param]
