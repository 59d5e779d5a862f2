"""What shadow mode keeps to report a divergence: recent calls and kvfunc's delta log.

The mirror's every transition is journaled (``ManagerBase._journal``) with
the scheduler call that caused it.  To stay bounded over a long run the
record is kept in windows: at a call boundary, once a window holds
``window`` transitions, the state then becomes the next window's checkpoint
and the window before the last is dropped.  A :class:`Divergence` therefore
replays from a checkpoint at most two windows back, through every
transition since, to the mirror's state at the diverging call.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs

import kvfunc as kf

__all__ = ["Divergence", "DivergenceError", "Recorder"]


class DivergenceError(kf.KVFuncError, AssertionError):
    """kvfunc's mirrored manager answered differently from vLLM's (shadow mode, strict)."""


@attrs.frozen(slots=True)
class Divergence:
    """The first difference between vLLM's manager and kvfunc's mirror.

    Attributes:
        call: the call at which they differed, as text.
        what: what differed (both answers).
        calls: the calls that led to it, oldest first, as text (a transition
            kvfunc made for a call follows it, indented).
        initial: kvfunc's state at the log's checkpoint.
        deltas: kvfunc's transitions since the checkpoint, in order.
        state: kvfunc's state when the difference was found.

    >>> s = kf.KVState.create({"f": kf.FullAttention(num_blocks=4, block_size=4)}, 64)
    >>> r = kf.allocate_slots(s, "a", 0, 5)
    >>> d = Divergence("free(a)", "free blocks: vLLM 3, kvfunc 1", ("allocate_slots(a)",),
    ...                s, (r.delta,), r.state)
    >>> d.replay() == d.state
    True
    """

    call: str
    what: str
    calls: tuple[str, ...]
    initial: kf.KVState
    deltas: tuple[kf.BlocksChanged, ...]
    state: kf.KVState

    def replay(self) -> kf.KVState:
        """kvfunc's state rebuilt from the checkpoint and the deltas (equals :attr:`state`)."""
        return kf.replay(self.initial, list(self.deltas))

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the delta log (``kvfunc replay PATH`` checks it); the calls are in its header."""
        from kvfunc.cli._log import DeltaLogWriter  # the one writer of that format

        out = Path(path)
        with out.open("w", encoding="utf-8") as f:
            log = DeltaLogWriter(f, self.initial, meta={
                "source": "kvfunc.vllm shadow mode", "call": self.call, "what": self.what,
                "calls": list(self.calls)})
            for step, delta in enumerate(self.deltas):
                log.write(step, delta)
            log.close(self.state)
        return out

    def __str__(self) -> str:
        recent = "\n  ".join(self.calls[-12:])
        return (f"kvfunc diverged from vLLM at {self.call}: {self.what}\n"
                f"the last of {len(self.calls)} calls:\n  {recent}")


@attrs.define
class _Window:
    start: kf.KVState
    deltas: list[kf.BlocksChanged] = attrs.Factory(list)
    calls: list[str] = attrs.Factory(list)


class Recorder:
    """The mirror's recent calls and transitions, in two windows (see the module docstring).

    >>> s = kf.KVState.create({"f": kf.FullAttention(num_blocks=4, block_size=4)}, 64)
    >>> rec = Recorder(s, window=1)
    >>> rec.call("allocate_slots(a)")
    >>> r = kf.allocate_slots(s, "a", 0, 5)
    >>> rec.transition("allocate_slots", "a", (0, 5), r.delta)
    >>> rec.boundary(r.state)
    >>> d = rec.divergence("free(a)", "why", r.state)
    >>> d.initial is s, len(d.deltas), d.calls[0]
    (True, 1, 'allocate_slots(a)')
    """

    def __init__(self, state: kf.KVState, *, window: int = 1024) -> None:
        self._window = window
        self._previous: _Window | None = None
        self._current = _Window(state)

    def call(self, text: str) -> None:
        """A scheduler call that is about to be mirrored."""
        self._current.calls.append(text)

    def transition(self, name: str, request_id: Any, args: tuple[Any, ...],
                   delta: kf.BlocksChanged) -> None:
        """One transition of the mirror (the manager's journal)."""
        self._current.deltas.append(delta)
        self._current.calls.append(f"    kvfunc {name}({request_id!r}, {args!r})")

    def boundary(self, state: kf.KVState) -> None:
        """A call finished with the mirror in ``state``: start a new window when due."""
        if len(self._current.deltas) >= self._window:
            self._previous, self._current = self._current, _Window(state)

    def divergence(self, call: str, what: str, state: kf.KVState) -> Divergence:
        """The report of a difference found at ``call``."""
        windows = [w for w in (self._previous, self._current) if w is not None]
        return Divergence(call, what, tuple(c for w in windows for c in w.calls),
                          windows[0].start, tuple(d for w in windows for d in w.deltas), state)
