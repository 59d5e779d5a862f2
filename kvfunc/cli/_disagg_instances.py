"""The two kinds of instance of a disaggregated run: each a :class:`Scheduler` on its own state.

Theory of operation
-------------------
Both are the colocated scheduler (FIFO admission, chunked prefill, preemption
by recompute, one :func:`kvfunc.allocate_batch` per step), driven from
outside: the run (:mod:`kvfunc.cli._disagg`) queues requests on them and
calls :meth:`Scheduler.run_step` at the time it picks.

* A :class:`PrefillInstance` only prefills.  When a prompt's last chunk is
  computed, the step samples the first output token and the request leaves
  the running set: it is *handed off* (:attr:`PrefillInstance.handed_off`).
  Its blocks stay allocated, cached prefix and all, until the decode side has
  pulled them; then :meth:`PrefillInstance.release` frees them (with prefix
  caching they stay in the cache as evictable blocks).
* A :class:`DecodeInstance` takes a request in two moves: :meth:`reserve`
  allocates the prompt's blocks before the pull (the transfer writes into
  them), and :meth:`receive` makes it a running request once the KV has
  arrived, with one token generated already (the prefill's).  From there
  it decodes like the colocated scheduler; a preempted request is recomputed
  here, from its prompt and the tokens generated so far.  Every token's
  emission time is kept, for the time between tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvfunc.cli._prefix import PrefixCacher
from kvfunc.cli._scheduler import Scheduler, SchedulerConfig
from kvfunc.cli._trace import TraceRequest
from kvfunc.core import KVState, allocate_slots

__all__ = ["DecodeInstance", "PrefillInstance"]


class PrefillInstance(Scheduler):
    """A prefill instance: prefills, hands each finished prompt off, holds its blocks until pulled.

    >>> from kvfunc.core import FullAttention
    >>> state = KVState.create({"full": FullAttention(num_blocks=64, block_size=16)}, 4096)
    >>> p = PrefillInstance(0, state, [TraceRequest(0.0, 100, 3)], SchedulerConfig())
    >>> p.queue(0); p.run_step(), p.handed_off, p.state.pools[0].num_free
    (1, [0], 56)
    >>> p.release(0); p.state.pools[0].num_free
    63
    """

    def __init__(self, index: int, state: KVState, requests: Sequence[TraceRequest],
                 config: SchedulerConfig, *, prefix: PrefixCacher | None = None) -> None:
        super().__init__(state, requests, config, prefix=prefix)
        self.index = index
        #: Requests whose prefill the last step finished (the run takes them).
        self.handed_off: list[int] = []
        #: Requests handed off whose blocks are still held (not yet pulled).
        self.held = 0
        #: Set by the run when a step scheduled nothing: wait for an event.
        self.blocked = False

    @property
    def load(self) -> int:
        """Requests waiting or prefilling here (held ones do not count)."""
        return len(self.waiting) + len(self.running)

    @property
    def has_work(self) -> bool:
        """Whether a step could schedule anything."""
        return bool(self.running or self.waiting) and not self.blocked

    def queue(self, rid: int) -> None:
        """Queue an arriving request (FIFO)."""
        self.waiting.append(rid)

    def release(self, rid: int) -> None:
        """Free a handed-off request's blocks (its KV has been pulled)."""
        self.state = self._free(self.state, rid)
        self.held -= 1

    def _advance(self, batch: list[tuple[Any, ...]]) -> None:
        computed, target = self.computed, self.target
        done = []
        for entry in batch:  # every entry is a prefill chunk here
            rid, c, new = entry[0], entry[1], entry[2]
            computed[rid] = c + new
            if self.preempted[rid]:
                self.recomputed_tokens += new
            else:
                self.prefill_tokens += new
            if c + new >= target[rid]:
                done.append(rid)
        if not done:
            return
        for rid in done:  # the prefill's last position samples the first token
            self.generated[rid] = 1
            if self.prefix is not None:
                self.prefix.release(rid)  # nothing is allocated for it here again
        self.generated_tokens += len(done)
        self.held += len(done)
        self.handed_off.extend(done)
        gone = set(done)
        self.running = [rid for rid in self.running if rid not in gone]


class DecodeInstance(Scheduler):
    """A decode instance: takes pulled requests, decodes them, records when each token comes.

    >>> from kvfunc.core import FullAttention
    >>> state = KVState.create({"full": FullAttention(num_blocks=64, block_size=16)}, 4096)
    >>> d = DecodeInstance(0, state, [TraceRequest(0.0, 100, 3)], SchedulerConfig())
    >>> d.reserve(0, 100), d.state.pools[0].num_free
    (True, 56)
    >>> d.receive(0, 0.0); d.run_step(), d.run_step(), d.finished_ids, d.gaps
    (1, 1, [0], Counter({0.02: 2}))
    """

    def __init__(self, index: int, state: KVState, requests: Sequence[TraceRequest],
                 config: SchedulerConfig) -> None:
        super().__init__(state, requests, config)
        self.index = index
        #: Requests whose blocks are reserved and whose KV is on its way.
        self.receiving = 0
        #: Requests that finished in the last step (the run takes them).
        self.finished_ids: list[int] = []
        #: Seconds between consecutive tokens of a request -> tokens so spaced.
        self.gaps: Counter[float] = Counter()
        self._last_token_s: dict[int, float] = {}
        #: Set by the run when a step scheduled nothing: wait for an event.
        self.blocked = False

    @property
    def load(self) -> int:
        """Requests here: running, waiting to be recomputed, or on their way."""
        return len(self.running) + len(self.waiting) + self.receiving

    @property
    def has_work(self) -> bool:
        """Whether a step could schedule anything."""
        return bool(self.running or self.waiting) and not self.blocked

    @property
    def can_take(self) -> bool:
        """A free seat, and none of its own requests waiting to be recomputed."""
        return not self.waiting and self.load < self.config.max_num_seqs

    def reserve(self, rid: int, tokens: int) -> bool:
        """Allocate ``tokens`` slots for an incoming request; False (nothing done) if no room."""
        res = allocate_slots(self.state, rid, 0, tokens)
        if not res.ok:
            return False
        self.state = res.state
        self._emit(res.delta)
        self.receiving += 1
        return True

    def receive(self, rid: int, now: float) -> None:
        """The KV of a reserved request has arrived at ``now``: it runs from the next step."""
        self.receiving -= 1
        self.computed[rid] = self.target[rid] = self.prompt[rid]
        self.generated[rid] = 1  # the prefill's token, delivered with the hand-over
        self.running.append(rid)
        self._last_token_s[rid] = now

    def _advance(self, batch: list[tuple[Any, ...]]) -> None:
        generated = self.generated
        before = [(entry[0], generated[entry[0]]) for entry in batch]
        super()._advance(batch)
        end = self.clock + self.config.step_s  # the step ends when its tokens come out
        last, output = self._last_token_s, self.output
        for rid, had in before:
            k = generated[rid] - had
            if not k:
                continue
            self.gaps[round((end - last[rid]) / k, 6)] += k
            if generated[rid] >= output[rid]:
                del last[rid]
                self.finished_ids.append(rid)
            else:
                last[rid] = end
