"""Fixtures shared by the whole suite (helpers live in helpers.py)."""

import pytest

from .helpers import BACKENDS


@pytest.fixture(params=list(BACKENDS), ids=list(BACKENDS))
def backend(request):
    return BACKENDS[request.param]
