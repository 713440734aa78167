"""Fixtures shared by the whole suite (helpers live in helpers.py)."""

import os

import pytest
from hypothesis import settings

from .helpers import BACKENDS

# `auto` reads qkv's default crossovers, not the calibration `qkv tune` left on this machine, so
# that what the tests expect of dispatch does not depend on who tuned the machine before.
os.environ["QKV_CROSSOVERS"] = "default"

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


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    """auto's remembered decisions do not outlive a test (tests patch what backends see)."""
    from qkv.dispatch import forget

    forget()
    yield
    forget()


@pytest.fixture(params=list(BACKENDS), ids=list(BACKENDS))
def backend(request):
    return BACKENDS[request.param]
