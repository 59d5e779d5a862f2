"""kvfunc: a KV-cache manager whose allocator is a pure function.

``(immutable state, request) -> (new state, delta)``; see ``kvfunc.core`` for
the pure API, ``kvfunc.compat`` for the seed module's API, and ``kvfunc.shell``
for cache tensors, block tables and slot mappings.  This namespace is the
public contract and its documented additions: exactly the names of
``kvfunc.core`` (its ``__all__``, re-exported here).
"""

from kvfunc.core import *  # noqa: F403
from kvfunc.core import __all__ as _core_all

__all__ = list(_core_all)
del _core_all
__version__ = "0.1.0"
