"""The pure registry: pools carved by the range allocator, caches and their references."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch_threads import one_torch_thread  # noqa: F401  (autouse)

import kvfunc.datadist as dd
from kvfunc.core import LLMStatusCode
from kvfunc.datadist._ranges import RangeState, allocate_range, release_range

PAGE = 4096
DESC = dd.CacheDesc(2, (2, 256), dd.DataType.DT_FLOAT)  # 4 KiB: one page
BLOCKS = dd.CacheDesc(2, (8, 256), dd.DataType.DT_FLOAT16)  # 8 KiB: two pages


def prompt(pages: int = 8) -> dd.RegistryState:
    """A PROMPT registry of cluster 0 with a DEVICE pool of ``pages`` pages."""
    return dd.RegistryState.create(dd.LLMRole.PROMPT, 0, {dd.Placement.DEVICE: (pages * PAGE,
                                                                               PAGE)})


def test_registry_does_not_import_torch() -> None:
    """Importing kvfunc.datadist and running the registry never loads torch."""
    code = ("import sys, kvfunc.datadist as d; "
            "s = d.RegistryState.create(d.LLMRole.PROMPT, 0, {d.Placement.DEVICE: (65536, 4096)}); "
            "c = d.CacheDesc(1, (1, 4), d.DataType.DT_BF16); "
            "a = d.allocate_cache(s, c, [d.CacheKey(0, 1)]); "
            "print('torch' in sys.modules, a.ok)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert ["False", "True"] == out


def test_cache_is_held_by_id_and_every_key() -> None:
    """Memory goes back only when the id and both keys are gone, in any order."""
    s = dd.allocate_cache(prompt(), DESC, [dd.CacheKey(0, 1), dd.CacheKey(0, 2)]).state
    s, released = dd.deallocate_cache(s, 1)
    assert ((), PAGE) == (released, s.used_bytes())
    s, released = dd.remove_cache_key(s, dd.CacheKey(0, 1))
    assert ((), PAGE) == (released, s.used_bytes())
    s, released = dd.remove_cache_key(s, dd.CacheKey(0, 2))
    assert ((1,), 0, {}) == (released, s.used_bytes(), dict(s.bindings))
    dd.check_registry(s)


def test_keys_are_prompt_only_unique_and_for_this_cluster() -> None:
    """Keys on DECODER, bound twice, repeated or for another cluster are rejected."""
    decoder = dd.RegistryState.create(dd.LLMRole.DECODER, 1, {dd.Placement.DEVICE: (PAGE, PAGE)})
    s = dd.allocate_cache(prompt(), DESC, [dd.CacheKey(0, 1)]).state
    bad = [(decoder, [dd.CacheKey(1, 1)]), (s, [dd.CacheKey(0, 1)]),
           (prompt(), [dd.CacheKey(0, 3), dd.CacheKey(0, 3)]), (prompt(), [dd.CacheKey(5, 1)]),
           (prompt(), [dd.CacheKey(0, 1), dd.CacheKey(0, 2), dd.CacheKey(0, 3)])]
    for state, keys in bad:
        with pytest.raises(dd.InvalidParamError) as info:
            dd.allocate_cache(state, DESC, keys)
        assert LLMStatusCode.LLM_PARAM_INVALID == info.value.status_code
    with pytest.raises(dd.InvalidParamError):
        dd.remove_cache_key(decoder, dd.CacheKey(1, 1))


def test_unknown_or_freed_cache_and_unknown_key_are_no_ops() -> None:
    """Deallocating twice or an unknown id, and removing an unknown key, change nothing."""
    s, _ = dd.deallocate_cache(dd.allocate_cache(prompt(), DESC).state, 1)
    assert s is dd.deallocate_cache(s, 1)[0]
    assert s is dd.deallocate_cache(s, 99)[0]
    assert s is dd.remove_cache_key(s, dd.CacheKey(0, 42))[0]


def test_pool_exhaustion_is_a_refusal_with_nothing_allocated() -> None:
    """A cache larger than the largest free range is refused and the state kept."""
    s = dd.allocate_cache(prompt(pages=3), BLOCKS).state
    refused = dd.allocate_cache(s, BLOCKS)
    assert (False, True, None) == (refused.ok, refused.state is s, refused.record)
    assert "cannot hold 8192 bytes" in refused.reason


def test_blocks_cache_key_names_but_does_not_hold() -> None:
    """A blocks cache goes at deallocate_cache; its key is unbound at once."""
    a = dd.allocate_blocks_cache(prompt(), BLOCKS, dd.BlocksCacheKey(0, 3))
    assert ((1, 0), True) == (a.state.bindings[dd.BlocksCacheKey(0, 3)], a.record.is_blocks_cache)
    s, released = dd.deallocate_cache(a.state, 1)
    assert ((1,), 0, {}) == (released, s.used_bytes(), dict(s.bindings))


def test_pin_defers_release_to_the_end_of_a_transfer() -> None:
    """Dropping the last reference of a pinned cache frees it only at unpin."""
    s = dd.pin_cache(dd.allocate_cache(prompt(), DESC).state, 1)
    s, released = dd.deallocate_cache(s, 1)
    assert ((), PAGE) == (released, s.used_bytes())
    with pytest.raises(dd.CacheNotExistError):
        dd.find_cache(s, 1)
    s, released = dd.unpin_cache(s, 1)
    assert ((1,), 0) == (released, s.used_bytes())


def test_release_coalesces_neighbours() -> None:
    """Freeing the middle range between two free ones leaves a single free range."""
    s = RangeState.create(4 * PAGE, PAGE)
    offsets = []
    for _ in range(4):
        s, off = allocate_range(s, PAGE)
        offsets.append(off)
    for off in (offsets[0], offsets[2], offsets[1]):
        s = release_range(s, off, PAGE)
    assert ((0, 3 * PAGE),) == s.free
    with pytest.raises(dd.InvalidParamError, match="double release"):
        release_range(s, offsets[1], PAGE)


OPS = st.lists(st.tuples(st.sampled_from(["alloc", "blocks", "dealloc", "remove", "pin",
                                          "unpin"]), st.integers(0, 7), st.integers(1, 3)),
               max_size=60)


@given(OPS)
def test_random_programs_keep_invariants_and_count_references(ops: list[tuple[str, int, int]]
                                                              ) -> None:
    """After any program: invariants hold and used bytes = pages of caches still referenced."""
    s = prompt(pages=16)
    refs: dict[int, set[object]] = {}  # cache id -> its holders: "id", keys, pins
    pages: dict[int, int] = {}
    next_key = 0
    for op, which, size in ops:
        ids = sorted(refs)
        cid = ids[which % len(ids)] if ids else 0
        if op in ("alloc", "blocks"):
            desc = dd.CacheDesc(1, (size, 1024), dd.DataType.DT_FLOAT)
            key = dd.CacheKey(0, next_key)
            next_key += 1
            a = (dd.allocate_cache(s, desc, [key]) if op == "alloc"
                 else dd.allocate_blocks_cache(s, desc))
            if a.ok:
                s = a.state
                refs[a.record.cache_id] = {"id", key} if op == "alloc" else {"id"}
                pages[a.record.cache_id] = size
            continue
        if not ids:
            continue
        if op == "dealloc":
            s, _ = dd.deallocate_cache(s, cid)
            refs[cid].discard("id")
        elif op == "remove":
            keys = [k for k in refs[cid] if isinstance(k, dd.CacheKey)]
            if keys:
                s, _ = dd.remove_cache_key(s, keys[0])
                refs[cid].discard(keys[0])
        elif op == "pin":
            s = dd.pin_cache(s, cid)
            refs[cid].add(("pin", next_key))
            next_key += 1
        else:
            pins = [p for p in refs[cid] if isinstance(p, tuple)]
            if pins:
                s, _ = dd.unpin_cache(s, cid)
                refs[cid].discard(pins[0])
        if not refs[cid]:
            del refs[cid]
        dd.check_registry(s)
    assert sorted(refs) == sorted(s.caches)
    assert sum(pages[c] for c in refs) * PAGE == s.used_bytes()
