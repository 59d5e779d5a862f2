"""A bad step entry is the same typed error on every path: every form, lane or step, compat.

A step entry reaches the core in many forms (``allocate_slots``'s arguments,
a ``SlotRequest``, a tuple of 4 to 8 fields, a plain 3-tuple with the batch's
``lookahead_tokens`` and ``block_hashes`` mapping, an entry of a mixed batch,
the compat manager's call), and a registered request whose step fills no
block is served by the fold's lane without the step.  Whatever the form and
whether or not the entry would be quiet, one bad field must give one answer:
the same error class and message, short, and the state as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from junk import HUGE, IntSubclass, ReprRaises, junk, short

import kvfunc as kf
import kvfunc.core._fold as fold_module
from kvfunc.compat import FullAttentionManager, KVCacheManager, SlidingWindowManager

FIELDS = ("request_id", "computed_tokens", "num_new_tokens", "lookahead_tokens",
          "reserved_tokens", "manager_keys", "block_hashes", "prefix_hit")
DEFAULTS = (0, 0, None, None, None)  # lookahead .. prefix_hit
QUIET = ("a", 6, 1)  # "a" holds 6 tokens: a 7th fills no block (the lane serves it)
GROW = ("a", 6, 4)   # a new block in every group: the step
NEW = ("n", 0, 4)    # a first allocation: the step
HASHES = kf.BlockHashes.of(range(7), 4)  # one full block: covers no block these entries fill


def groups() -> dict[str, kf.Policy]:
    """Full attention and a sliding window, block size 4 (one pool of 16 when shared)."""
    return {"full": kf.FullAttention(num_blocks=16, block_size=4),
            "swa": kf.SlidingWindow(num_blocks=16, block_size=4, sliding_window=8)}


def world(caching: bool, layout: str) -> tuple[kf.KVState, kf.KVState, kf.BlocksChanged]:
    """An empty state, the state holding "a" (6 tokens), and the delta between them."""
    s0 = kf.KVState.create(groups(), 64, enable_prefix_caching=caching, layout=layout)
    r = kf.allocate_slots(s0, "a", 0, 6, block_hashes=HASHES if caching else None)
    return s0, r.state, r.delta


def valid(field: str, value: Any) -> bool:
    """Whether ``value`` is an acceptable ``field`` of a step entry (its documented type)."""
    if field == "request_id":
        return type(value) in (str, int)
    if field in ("computed_tokens", "num_new_tokens", "reserved_tokens"):
        return type(value) is int and value >= 0
    if field == "lookahead_tokens":
        return type(value) is int
    if field == "manager_keys":
        return value is None or (isinstance(value, Collection)
                                 and not isinstance(value, str | bytes)
                                 and all(type(k) is str for k in value))
    if field == "block_hashes":
        return value is None or type(value) is kf.BlockHashes
    return value is None or type(value) is kf.PrefixHit


def entry_fields(base: tuple[Any, ...], caching: bool, field: str, value: Any) -> list[Any]:
    """The eight fields of ``base`` (with the hashes when caching), ``field`` set to ``value``."""
    fields = [*base, 0, 0, None, HASHES if caching else None, None]
    fields[FIELDS.index(field)] = value
    return fields


@contextlib.contextmanager
def lane(on: bool) -> Iterator[None]:
    """The fold with its lane on or off (the lane must not change any answer)."""
    saved = fold_module.LANE
    fold_module.LANE = on
    try:
        yield
    finally:
        fold_module.LANE = saved


def is_default(value: Any, default: Any) -> bool:
    """``value`` is the field's default itself (``False`` is not the default 0)."""
    return value is default or (type(value) is type(default) and value == default)


def hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def forms(s: kf.KVState, f: list[Any], caching: bool) -> dict[str, Callable[[], Any]]:
    """Every way to hand the core this entry (the forms that can carry its fields)."""
    rid, c, n, la, res, keys, h, hit = f
    out: dict[str, Callable[[], Any]] = {
        "allocate_slots": lambda: kf.allocate_slots(
            s, rid, c, n, la, reserved_tokens=res, manager_keys=keys, block_hashes=h,
            prefix_hit=hit),
        "SlotRequest": lambda: kf.allocate_batch(s, [kf.SlotRequest(*f)]),
        "8-tuple": lambda: kf.allocate_batch(s, [tuple(f)]),
        "after a good entry": lambda: kf.allocate_batch(s, [("b", 0, 1), kf.SlotRequest(*f)]),
        "before a good entry": lambda: kf.allocate_batch(s, [tuple(f), ("b", 0, 1)]),
    }
    given = [i for i in range(3, 8) if not is_default(f[i], DEFAULTS[i - 3])]
    out["short tuple"] = lambda: kf.allocate_batch(s, [tuple(f[:max([3, *given]) + 1])])
    if res == 0 and type(res) is int and keys is None and hit is None and hashable(rid):
        mapping = None if h is None else {rid: h}
        out["3-tuple, batch lookahead and mapping"] = lambda: kf.allocate_batch(
            s, [(rid, c, n)], lookahead_tokens=la, block_hashes=mapping)
    return out


def compat_manager() -> KVCacheManager:
    """The compat facade over the same groups, holding "a" (6 tokens)."""
    mgr = KVCacheManager(64, [FullAttentionManager("FullAttention", 16, 4, manager_key="full"),
                              SlidingWindowManager("SlidingWindow", 16, 4, manager_key="swa",
                                                   sliding_window=8)], None)
    assert mgr.allocate_slots("a", 0, 6)
    return mgr


def answers(caching: bool, layout: str, field: str, value: Any) -> set[tuple[type, str]]:
    """Every (error class, message) that the bad field gets, on every form and base entry."""
    s0, s, delta = world(caching, layout)
    twin = kf.replay(s0, [delta])
    seen = set()
    for base in (QUIET, GROW, NEW):
        f = entry_fields(base, caching, field, value)
        for on in (True, False):
            with lane(on):
                for call in forms(s, f, caching).values():
                    with pytest.raises(kf.KVFuncError) as info:
                        call()
                    seen.add((type(info.value), str(info.value)))
        if not caching and layout == "per-type" and field not in ("block_hashes", "prefix_hit"):
            mgr = compat_manager()
            before = mgr.state
            with pytest.raises(kf.KVFuncError) as info:
                mgr.allocate_slots(*f[:4], f[4], f[5])
            seen.add((type(info.value), str(info.value)))
            assert before == mgr.state
    assert s == twin and kf.check_invariants(s) is None
    nxt, twin_nxt = kf.allocate_slots(s, *GROW), kf.allocate_slots(twin, *GROW)
    assert (nxt.state, nxt.delta) == (twin_nxt.state, twin_nxt.delta)
    return seen


def assert_one_answer(caching: bool, layout: str, field: str, value: Any) -> None:
    """One error class and one short message for the bad field, whatever the path."""
    seen = answers(caching, layout, field, value)
    assert 1 == len(seen), seen
    (_, message), = seen
    assert short(message), message


LAYOUTS = ["per-type", "shared"]


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
@given(field=st.sampled_from(FIELDS), value=junk())
def test_a_bad_field_is_one_typed_error_on_every_path(caching: bool, layout: str, field: str,
                                                      value: Any) -> None:
    """Junk in any field: the same error and message on every form, lane or not, state kept."""
    assume(not valid(field, value))
    assert_one_answer(caching, layout, field, value)


BAD = [("computed_tokens", True), ("num_new_tokens", False), ("lookahead_tokens", True),
       ("reserved_tokens", False), ("reserved_tokens", 0.0), ("computed_tokens", -1),
       ("num_new_tokens", IntSubclass(2)), ("request_id", True), ("request_id", 1.0),
       ("request_id", ReprRaises()), ("manager_keys", "full"), ("manager_keys", [1]),
       ("manager_keys", 5), ("block_hashes", "junk"), ("block_hashes", HASHES.hashes),
       ("prefix_hit", "junk"), ("prefix_hit", {"full": (1,)}),
       *[(f, v) for f in ("computed_tokens", "request_id", "manager_keys", "block_hashes")
         for v in HUGE if not valid(f, v)]]


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}-{type(v).__name__}" for f, v in BAD])
def test_the_issues_cases_are_one_typed_error_on_every_path(caching: bool, layout: str,
                                                           field: str, value: Any) -> None:
    """Bools as counts, junk hashes on a quiet entry, huge values: one answer everywhere."""
    assert_one_answer(caching, layout, field, value)


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_quiet_entry_takes_the_lane_and_the_others_the_step(
        caching: bool, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The entries the attacks use: QUIET never reaches the step (so the lane is attacked);
    GROW reaches the step or the lane's lean step once, NEW the step."""
    _, s, _ = world(caching, layout)
    steps: list[Any] = []
    real, real_lean = fold_module.step, fold_module.lean_step

    def counting(*args: Any) -> bool:
        steps.append(args[1])
        return real(*args)

    def counting_lean(*args: Any) -> bool:
        steps.append(args[1])
        return real_lean(*args)

    monkeypatch.setattr(fold_module, "step", counting)
    monkeypatch.setattr(fold_module, "lean_step", counting_lean)
    served = ("allocate_slots", "SlotRequest", "8-tuple", "3-tuple, batch lookahead and mapping")
    for base, stepped in ((QUIET, []), (GROW, ["a"]), (NEW, ["n"])):
        calls = forms(s, entry_fields(base, caching, "request_id", base[0]), caching)
        for name in served:
            steps.clear()
            calls[name]()
            assert stepped == steps, name


def test_junk_hashes_on_a_registered_quiet_request_are_refused() -> None:
    """The issue's example: allocate_slots(s, "a", 5, 1, block_hashes="junk") raises."""
    s = kf.KVState.create({"full": kf.FullAttention(num_blocks=8, block_size=4)}, 64,
                          enable_prefix_caching=True)
    s = kf.allocate_slots(s, "a", 0, 5).state
    for call in (lambda: kf.allocate_slots(s, "a", 5, 1, block_hashes="junk"),
                 lambda: kf.allocate_batch(s, [("a", 5, 1)], block_hashes={"a": "junk"}),
                 lambda: kf.allocate_batch(s, [kf.SlotRequest("a", 5, 1, block_hashes="junk")])):
        with pytest.raises(kf.InvalidTypeError, match="block_hashes must be a BlockHashes"):
            call()


def test_a_hashes_mapping_on_a_state_without_caching_is_refused_like_slot_hashes() -> None:
    """A mapping with hashes on a non-caching state is the SlotRequest's NotSupportedError."""
    _, s, _ = world(False, "per-type")
    with pytest.raises(kf.NotSupportedError):
        kf.allocate_batch(s, [("a", 6, 1)], block_hashes={"a": "junk"})


@pytest.mark.parametrize("case", ["negative lookahead", "hit count"])
def test_a_count_of_thousands_of_digits_is_a_typed_error(case: str) -> None:
    """-10**5000 as a lookahead, 10**5000 computed with a hit: typed errors, short messages."""
    s = kf.KVState.create({"full": kf.FullAttention(num_blocks=8, block_size=4)}, 64,
                          enable_prefix_caching=True)
    h = kf.BlockHashes.of(range(8), 4)
    with pytest.raises(kf.InvalidArgumentError):
        if case == "negative lookahead":
            kf.allocate_slots(s, "a", 0, 1, -(10 ** 5000))
        else:
            kf.allocate_slots(s, "a", 10 ** 5000, 1, block_hashes=h,
                              prefix_hit=kf.lookup_prefix(s, h))


# -- the compat facade: every method, junk in one argument ------------------------------------

RID, COUNT, OPTIONAL, INT, KEYS, ANY = "rid", "count", "optional", "int", "keys", "any"


def compat_calls(mgr: KVCacheManager) -> dict[str, tuple[Callable[..., Any], list[Any],
                                                          tuple[str, ...]]]:
    """Each public method of the facade and its views: a callable, valid arguments, their kinds."""
    fa, sw = mgr.single_type_managers
    pool = fa.block_pool
    return {
        "allocate_slots": (mgr.allocate_slots, ["a", 6, 1, 0, 0, None],
                           (RID, COUNT, COUNT, INT, COUNT, KEYS)),
        "free": (mgr.free, ["a"], (RID,)),
        "get_block_ids": (mgr.get_block_ids, ["a"], (RID,)),
        "get_block_table_max_lens": (mgr.get_block_table_max_lens, [64], (COUNT,)),
        "restore": (mgr.restore, [mgr.state], (ANY,)),
        "remove_skipped_blocks": (sw.remove_skipped_blocks, ["a", 6], (RID, COUNT)),
        "get_num_skipped_tokens": (sw.get_num_skipped_tokens, [6], (COUNT,)),
        "pre_allocate_blocks": (fa.pre_allocate_blocks, ["a", 8, 0], (RID, COUNT, COUNT)),
        "allocate_new_blocks": (fa.allocate_new_blocks, ["a", 1, 10], (RID, COUNT, OPTIONAL)),
        "get_blocks": (fa.get_blocks, ["a"], (RID,)),
        "free_blocks": (pool.free_blocks, [[]], (ANY,)),
        "get_new_blocks": (pool.get_new_blocks, [1], (COUNT,)),
        "get_block": (pool.get_block, [1], (COUNT,)),
    }


def well_typed(kind: str, value: Any) -> bool:
    """Whether ``value`` has the type (and sign) an argument of this kind needs."""
    if kind == RID:
        return type(value) in (str, int)
    if kind == COUNT:
        return type(value) is int and value >= 0
    if kind == OPTIONAL:
        return value is None or well_typed(COUNT, value)
    if kind == INT:
        return type(value) is int
    if kind == KEYS:
        return valid("manager_keys", value)
    return True  # a state, or block ids: their values decide


@given(name=st.sampled_from(sorted(compat_calls(compat_manager()))), at=st.integers(0, 5),
       value=junk())
def test_compat_methods_refuse_junk_typed_and_change_nothing(name: str, at: int,
                                                             value: Any) -> None:
    """Junk in any argument of any compat method: a KVFuncError, and the manager unchanged."""
    mgr = compat_manager()
    call, args, kinds = compat_calls(mgr)[name]
    at %= len(args)
    args[at] = value
    before = mgr.state
    try:
        call(*args)
    except kf.KVFuncError as exc:
        assert short(str(exc)), str(exc)
        assert before == mgr.state
        assert mgr.allocate_slots(*GROW) and mgr.state == kf.allocate_slots(before, *GROW).state
        return
    assert well_typed(kinds[at], value), f"{name} took {value!r} as argument {at}"


@pytest.mark.parametrize("call", [
    lambda: KVCacheManager(64, None, None), lambda: KVCacheManager(64, 5, None),
    lambda: compat_manager().get_block_ids([1]),
    lambda: compat_manager().single_type_managers[1].remove_skipped_blocks("a", "20"),
    lambda: compat_manager().single_type_managers[0].block_pool.free_blocks(None),
    lambda: compat_manager().single_type_managers[1].get_num_skipped_tokens("20"),
    lambda: compat_manager().get_block_table_max_lens(-5),
], ids=["managers None", "managers int", "get_block_ids list", "remove_skipped str",
        "free_blocks None", "skipped tokens str", "negative max_model_len"])
def test_the_issues_compat_cases_are_typed_errors(call: Callable[[], Any]) -> None:
    """The compat calls the issue lists raise kvfunc's typed errors with short messages."""
    with pytest.raises(kf.KVFuncError) as info:
        call()
    assert short(str(info.value))


def test_hashing_many_token_counts_keeps_a_bounded_cache_of_packers() -> None:
    """Validating token lists of thousands of distinct lengths does not grow memory without end."""
    from kvfunc.core import _digests

    for n in range(1, 2100):  # n blocks of one token: the tokens are packed n at a time
        kf.BlockHashes.of_digests([b"d"] * n, list(range(n)), 1)
    assert 1000 <= len(_digests._PACKERS) <= 1024
    with pytest.raises(kf.InvalidTypeError):  # a bool past the cache's bound is still refused
        kf.BlockHashes.of_digests([b"d"] * 5000, [True, *range(4999)], 1)
