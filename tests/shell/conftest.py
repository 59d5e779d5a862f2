"""Shell tests run torch on one thread.

The tensors here are tiny: with more threads, the per-op hand-off between
threads costs more than the work, and on a small shared machine it makes the
end-to-end model test 10-20x slower.  The setting is restored after each
test, so other test folders keep torch's default.
"""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Run the test with ``torch.set_num_threads(1)``, then restore the previous count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
