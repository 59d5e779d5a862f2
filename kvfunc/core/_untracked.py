"""Persistent vectors the garbage collector does not walk.

Theory of operation
-------------------
The host tier's free stack is a persistent vector of up to millions of
block ids, and the garbage collector walks every entry of every vector it
tracks each time it collects the generation the vector is in.  Its entries
are ints, and a container of atoms can never be part of a reference cycle,
so the collector has nothing to find there; CPython itself stops tracking
such tuples and dicts.  :func:`atomic` does the same for the C extension's
vector (one ``PyObject_GC_UnTrack`` call, about 0.6 us), whose memory its
reference count still frees.  While the collector is off nothing is done.

Only ``PyObject_GC_UnTrack`` is called, on vectors that exist: the C
extension tracks a vector only when it makes it, and its deallocation
checks before untracking.  Another vector type (no C extension) is left as
it is.  (The device pool's arrays are plain lists in a store its lineage
shares, :mod:`kvfunc.core._lineage`: old and long-lived, they are walked
only by the rare full collections.)
"""

from __future__ import annotations

import ctypes
import gc
from typing import Any, TypeVar

from pyrsistent import pvector

__all__ = ["atomic"]

_V = TypeVar("_V")
_C_VECTOR: type = type(pvector())
_untrack: Any = None
if _C_VECTOR.__module__ == "pvectorc":  # the C extension's vector; nothing to do otherwise
    _untrack = ctypes.pythonapi.PyObject_GC_UnTrack
    _untrack.argtypes, _untrack.restype = (ctypes.py_object,), None
_enabled = gc.isenabled


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
