"""The transformers tests run their tiny models on one thread.

Each op of a tiny model is a small parallel region; on a few shared cores a region waits until
every thread of torch's pool is scheduled, which under load costs milliseconds per op and made
these tests several times slower than their work. One thread does the same work without the
waiting. The previous thread count is restored after the package.
"""

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
