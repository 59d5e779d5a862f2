"""CPU caches and host pools of 2 MiB or more are advised for transparent huge pages."""

from __future__ import annotations

import gc
import mmap
import re
import sys
from pathlib import Path

import pytest
import torch

from kvfunc import InvalidArgumentError
from kvfunc.shell import HostBlockPool, empty_aligned
from kvfunc.shell._tensors import HUGE_PAGE_BYTES, cpu_bytes

_ADVISES = (sys.platform == "linux" and hasattr(mmap, "MADV_HUGEPAGE")
            and Path("/sys/kernel/mm/transparent_hugepage").is_dir())


def advised(t: torch.Tensor) -> bool:
    """Whether the mapping holding ``t``'s first byte carries the huge-page advice
    (``hg`` in its ``VmFlags`` in ``/proc/self/smaps``)."""
    ptr = t.data_ptr()
    for vma in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        lo, hi = (int(x, 16) for x in vma.split(None, 1)[0].split("-"))
        if lo <= ptr < hi:
            flags = re.search(r"^VmFlags:(.*)$", vma, re.M)
            return flags is not None and "hg" in flags.group(1).split()
    raise AssertionError(f"no mapping holds {ptr:#x}")


needs_advice = pytest.mark.skipif(not _ADVISES, reason="needs Linux transparent huge pages")


def test_cpu_bytes_are_zeros_aligned_writable_and_outlive_their_mapping_object() -> None:
    t = cpu_bytes(HUGE_PAGE_BYTES + 5)
    gc.collect()  # only the tensor holds the mapping now
    assert (HUGE_PAGE_BYTES + 5, 0, 0) == (t.numel(), t.data_ptr() % HUGE_PAGE_BYTES,
                                           int(t.count_nonzero()))
    t[-1] = 7
    t[:4096].fill_(3)
    assert (7, 3 * 4096 + 7) == (int(t[-1]), int(t.sum()))


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, None, "8"])
def test_cpu_bytes_refuses_a_size_that_is_not_a_positive_int(bad: object) -> None:
    with pytest.raises(InvalidArgumentError):
        cpu_bytes(bad)  # type: ignore[arg-type]


@needs_advice
def test_large_cpu_caches_and_host_pools_are_advised_small_ones_are_not() -> None:
    big = empty_aligned((4, 1 << 19), torch.float16, torch.device("cpu"))  # 4 MiB
    small = empty_aligned((4, 1024), torch.float16, torch.device("cpu"))
    odd = empty_aligned((4, 1 << 19), torch.float16, torch.device("cpu"), 3 << 20)
    assert (True, False) == (advised(big), advised(small))
    assert 0 == odd.data_ptr() % (3 << 20)  # an alignment 2 MiB does not serve: plain memory
    assert not advised(odd)
    pool = HostBlockPool.like({"k": big.view(64, 32768)}, 128)
    assert advised(pool.buffers[0]) and not pool.pinned
    assert not advised(HostBlockPool.like({"k": small.view(4, 1024)}, 4).buffers[0])


@needs_advice
def test_cpu_bytes_asks_for_huge_pages_for_its_whole_2_mib_pages_only() -> None:
    """A tail shorter than 2 MiB keeps ordinary pages: a huge one would take up to
    2 MiB more than was asked for."""
    assert advised(cpu_bytes(HUGE_PAGE_BYTES))
    t = cpu_bytes(2 * HUGE_PAGE_BYTES + 4096)
    assert (True, True, False) == (advised(t), advised(t[HUGE_PAGE_BYTES:]),
                                   advised(t[2 * HUGE_PAGE_BYTES:]))
    assert not advised(cpu_bytes(HUGE_PAGE_BYTES - 4096))
