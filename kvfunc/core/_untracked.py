"""Per-block vectors the garbage collector does not walk.

Theory of operation
-------------------
A pool's per-block vectors (reference counts, cached keys, the free
queue's links) hold tens of thousands of entries, and the garbage collector
walks every entry of every vector it tracks each time it collects the
generation the vector is in: each new version, made by almost every
transition, cost a young collection about 1.4 ms.  Their entries are all
atoms (ints, None, bytes), and a container of atoms can never be part of a
reference cycle, so the collector has nothing to find there; CPython itself
stops tracking such tuples and dicts.  This module does the same for the C
extension's vector, whose memory its reference count still frees:

* :func:`atomic` and :func:`untrack` untrack vectors (one
  ``PyObject_GC_UnTrack`` call each, about 0.6 us);
* an evolver's working copy (made on its first write, as large as the
  vector) lives until ``persistent()``, and two young collections in three
  land inside a transition: :func:`watch` keeps the open evolvers (and
  :func:`forget` lets them go), and just before the collector runs,
  :func:`_settle` (in ``gc.callbacks``) untracks their working copies;
  evolvers a transition gave up on (a refusal) are dropped from that list
  past :data:`_OPEN_MAX` of them;
* while the collector is off, nothing is done: nothing walks a vector then,
  and a state kept until it is on again has its vectors walked only in the
  (rare) full collections once they are old.

The pool and the queue call these only when :data:`watching` says the
collector is on (a C call), and :func:`forget` only when
:data:`open_evolvers` holds any, so that with the collector off a
transition makes no call of this module at all.

Only ``PyObject_GC_UnTrack`` is called, on vectors that exist: the C
extension tracks a vector only when it makes it, and its deallocation
checks before untracking.  Another vector type (no C extension) is left as
it is.  The open-evolver list relies on the GIL (a free-threaded build
would need a lock).
"""

from __future__ import annotations

import ctypes
import gc
import sys
from typing import Any, TypeVar

from pyrsistent import pvector

__all__ = ["atomic", "forget", "open_evolvers", "untrack", "watch", "watching"]

_V = TypeVar("_V")
_C_VECTOR: type = type(pvector())
_untrack: Any = None
if _C_VECTOR.__module__ == "pvectorc":  # the C extension's vector; nothing to do otherwise
    _untrack = ctypes.pythonapi.PyObject_GC_UnTrack
    _untrack.argtypes, _untrack.restype = (ctypes.py_object,), None
open_evolvers: dict[int, Any] = {}  # id -> evolver, from ``watch`` until ``forget``
_OPEN_MAX = 32
_enabled = gc.isenabled
#: Whether new vectors and evolvers need this module (the collector is on, with pvectorc).
watching: Any = _enabled if _untrack is not None else bool


def atomic(vector: _V) -> _V:
    """``vector`` (a persistent vector of ints, None and bytes only), untracked by the collector.

    While the collector is off, nothing is done (nothing walks the vector then).

    >>> v = atomic(pvector([0, 1, None, b"k"]))
    >>> gc.is_tracked(v) == (_untrack is None or not gc.isenabled()), list(v)
    (True, [0, 1, None, b'k'])
    """
    if _untrack is not None and type(vector) is _C_VECTOR and _enabled():
        _untrack(vector)
    return vector


def watch(*evolvers: Any) -> None:
    """Keep ``evolvers`` (None skipped) open: a collection untracks their working copies first.

    Nothing is kept unless :data:`watching` (hot paths ask first, saving the call); a
    transition's evolvers are :func:`forget`-ten before ``persistent()``.

    >>> ev = pvector([0, 0, 0]).evolver()
    >>> watch(ev, None)
    >>> ev[1] = 5
    >>> forget(ev, None)
    >>> list(untrack(ev.persistent())[0]), id(ev) in open_evolvers
    ([0, 5, 0], False)
    """
    if not watching():
        if open_evolvers:  # the collector went off: hold nothing for it
            _prune()
        return
    for ev in evolvers:
        if ev is not None:
            open_evolvers[id(ev)] = ev
    if len(open_evolvers) > _OPEN_MAX:
        _prune()


def forget(*evolvers: Any) -> None:
    """Let ``evolvers`` go (before their ``persistent()``: :func:`_settle` never reads one
    halfway through it)."""
    for ev in evolvers:
        open_evolvers.pop(id(ev), None)


def untrack(*vectors: Any) -> tuple[Any, ...]:
    """``vectors`` (None skipped), untracked like :func:`atomic`'s; returned as given."""
    if _untrack is not None:
        for vector in vectors:
            if type(vector) is _C_VECTOR:
                _untrack(vector)
    return vectors


def _holders(table: dict[int, Any], key: int) -> int:
    """The reference count of ``table[key]``, read the same way for every entry (-1: gone)."""
    item = table.get(key)
    return -1 if item is None else sys.getrefcount(item)


#: What :func:`_holders` reads for an entry nobody else holds (the table, the local, the
#: argument on CPython 3.11; measured, so that an interpreter counting otherwise agrees).
_ALONE = _holders({0: object()}, 0)


def _prune() -> None:
    """Forget the open evolvers nobody else holds (their transitions gave up on them)."""
    for key in list(open_evolvers):
        if _holders(open_evolvers, key) <= _ALONE:
            open_evolvers.pop(key, None)


def _settle(phase: str, info: dict[str, Any]) -> None:
    """A collector callback: untrack the working copies of the open evolvers (see ``watch``)."""
    if phase != "start" or not open_evolvers:
        return
    _prune()
    for ev in list(open_evolvers.values()):
        for part in gc.get_referents(ev):
            if type(part) is _C_VECTOR:
                _untrack(part)


gc.callbacks.append(_settle)
