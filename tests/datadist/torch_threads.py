"""DataDist tests run two clusters side by side on a small machine: one torch thread each.

Both the test process and its peer processes compute; with torch's default
of one thread per core they oversubscribe the CPU and every step slows down
many times over.  Each test module imports :func:`one_torch_thread` (an
autouse fixture).  It is not a ``conftest.py``: with ``--doctest-modules`` a
second top-level ``conftest`` module (``tests/shell`` has one) cannot be
collected in the same session as the first.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Run each test with one intra-op thread, then restore the previous setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
