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

* :func:`atomic` notes a new vector (an append), and :func:`evolver` an
  evolver whose working copy (made on its first write, as large as the
  vector) lives until :func:`persist`;
* just before the collector runs, :func:`_settle` (in ``gc.callbacks``)
  untracks every noted vector, and the working copy of every open evolver
  (two young collections in three land inside a transition);
* the notes are kept short (:data:`_FRESH_MAX`): past it, those nobody else
  holds are dropped and the others untracked at once;
* while the collector is off, nothing is noted: nothing walks a vector
  then, and a state kept until it is on again has its vectors walked only
  in the (rare) full collections once they are old.

Only ``PyObject_GC_UnTrack`` is called on vectors that exist; the C
extension tracks a vector only when it makes it, and its deallocation
checks before untracking.  Another vector type (no C extension) is left as
it is.
"""

from __future__ import annotations

import ctypes
import gc
import sys
from typing import Any, TypeVar

from pyrsistent import pvector

__all__ = ["atomic", "evolver", "persist"]

_V = TypeVar("_V")
_C_VECTOR: type = type(pvector())
_C_EVOLVER: type = type(pvector().evolver())
_untrack: Any = None
if _C_VECTOR.__module__ == "pvectorc":  # the C extension's vector; nothing to do otherwise
    _untrack = ctypes.pythonapi.PyObject_GC_UnTrack
    _untrack.argtypes, _untrack.restype = (ctypes.py_object,), None
_fresh: list[Any] = []  # vectors made since the collector last ran
_open: dict[int, Any] = {}  # id -> evolver, from ``evolver`` until ``persist``
_FRESH_MAX = 32
_enabled = gc.isenabled


def atomic(vector: _V) -> _V:
    """``vector`` (a persistent vector of ints, None and bytes only), kept from the collector.

    The vector is noted and untracked just before the collector next runs
    (see the module docstring), so a transition pays an append; while the
    collector is off, nothing is done (nothing walks the vector then).

    >>> v = atomic(pvector([0, 1, None, b"k"]))
    >>> _ = gc.collect()
    >>> gc.is_tracked(v) == (_untrack is None), list(v)
    (True, [0, 1, None, b'k'])
    """
    if _untrack is not None and type(vector) is _C_VECTOR and _enabled():
        _fresh.append(vector)
        if len(_fresh) > _FRESH_MAX:  # keep the list short: it holds old versions
            _settle("start", {})
    return vector


def evolver(vector: Any) -> Any:
    """``vector.evolver()`` for a vector of atoms, its working copy kept from the collector.

    The working copy an evolver makes on its first write is a new vector as
    large as the original, alive for the rest of the transition, where most
    young collections land (a transition allocates); while the evolver is
    open (until :func:`persist`), a collection untracks it first.  While the
    collector is off, this is ``vector.evolver()``.

    >>> ev = evolver(pvector([0, 0, 0]))
    >>> ev[1] = 5
    >>> list(persist(ev))
    [0, 5, 0]
    """
    ev = vector.evolver()
    if _untrack is not None and type(vector) is _C_VECTOR and _enabled():
        _open[id(ev)] = ev
        if len(_open) > _FRESH_MAX:  # evolvers given up on (refusals) are dropped
            _settle("start", {})
    return ev


def persist(ev: Any) -> Any:
    """``ev.persistent()`` for an evolver from :func:`evolver`, as an :func:`atomic` vector.

    >>> list(persist(evolver(pvector([1, 2]))))
    [1, 2]
    """
    if _open:
        _open.pop(id(ev), None)
    vector = ev.persistent()
    if _untrack is not None and _enabled():  # ``atomic``, inlined: two calls a transition
        _fresh.append(vector)
        if len(_fresh) > _FRESH_MAX:
            _settle("start", {})
    return vector


def _settle(phase: str, info: dict[str, Any]) -> None:
    """A collector callback: untrack what was noted since the last collection (see ``atomic``).

    Called by ``atomic`` (``info`` empty) when its list is long: the notes
    nobody else holds any more are dropped, the others untracked now.
    """
    if phase != "start" or _untrack is None:
        return
    batch = _fresh[:]
    del _fresh[:len(batch)]  # another thread may have appended meanwhile: keep those
    for key in list(_open):  # an evolver its transition dropped (a refusal) goes
        ev = _open.get(key)
        if ev is not None and sys.getrefcount(ev) <= 3:  # ``_open``, ``ev``, the argument
            _open.pop(key, None)
    batch.extend(list(_open.values()))
    for item in batch:
        if not info and sys.getrefcount(item) <= 3:  # ``batch``, ``item``, the argument
            continue
        for part in gc.get_referents(item) if type(item) is _C_EVOLVER else (item,):
            if type(part) is _C_VECTOR and gc.is_tracked(part):
                _untrack(part)


gc.callbacks.append(_settle)
