"""A continuous-batching scheduler on the pure allocator.

Theory of operation
-------------------
One :meth:`Scheduler.step` is one engine step of ``step_s`` simulated seconds:

1. requests whose arrival time has come join the FIFO ``waiting`` queue (a
   request longer than ``max_model_len``, or that would not fit in an empty
   cache prefilled chunk by chunk, is rejected there and never runs);
2. every running request asks for its next slots, oldest first, within a
   token budget (``max_batched_tokens``): a chunk of its prefill, or one
   decode step (``1 + next_n`` tokens and ``next_n - 1`` lookahead with MTP);
3. waiting requests are admitted from the head while there is room in the
   batch and in the budget; admission is strictly FIFO;
4. the whole step is one :func:`kvfunc.allocate_batch`.  If a *running*
   request was refused, the step is thrown away (the input state is
   untouched, so that costs nothing), the youngest running request is
   preempted — freed, and put back at the head of the queue to be recomputed
   from scratch — and the step is retried without any admission.  If only
   admissions were refused, the step is retried with the admissions before
   the first refused one, which keeps the queue FIFO;
5. finished requests are freed.

Every decode step is taken to accept all ``next_n`` draft tokens.

With a :class:`~kvfunc.cli._prefix.PrefixCacher` (a trace that names its
prompt blocks, on a state with prefix caching), step 3 looks each admission
up first (:func:`kvfunc.lookup_prefix` on the state before the step) and
admits it with its hit: ``computed_tokens`` starts at the hit, and only the
rest is prefilled.  An admission carries its block hashes; a running
request's entry is a plain tuple, and the step reads its hashes from
``PrefixCacher.live`` (``block_hashes=``) only where it fills a block.  So the
blocks a request fills are cached as it goes, and a preempted request finds
its own blocks when it is admitted again.  Without one, every prompt is
prefilled in full.

:class:`~kvfunc.cli._tier_scheduler.TieredScheduler` adds tiers below the
device through ``_allocate``, ``_free``, ``_lookup`` and two hooks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvfunc.cli._prefix import PrefixCacher
from kvfunc.cli._trace import TraceRequest
from kvfunc.core import (
    BlocksChanged,
    KVState,
    PrefixCacheStats,
    allocate_batch,
    allocate_slots,
    free_request,
)

__all__ = ["Scheduler", "SchedulerConfig", "fits_alone"]

DeltaSink = Callable[[int, BlocksChanged], None]
#: The per-step series a scheduler records (see :attr:`Scheduler.series`).
SERIES = ("waiting", "running", "preemptions", "refused_allocations", "prompt_tokens",
          "hit_tokens")


def fits_alone(state: KVState, tokens: int, chunk: int) -> bool:
    """Whether one request of ``tokens`` slots fits ``state`` alone, ``chunk`` tokens a step.

    The check folds the request over ``state`` in chunks, as the steps
    prefill it: a window group holds its window and a chunk at a time, never
    the whole request, and every allocation checks the sum of every group's
    need against the free count of the pool the groups share.  A step's
    chunk may start anywhere in a block, so each chunk asks for up to a block
    more, within the request.  A longer request folds through the same
    chunks and more, so when ``tokens`` fit, any fewer do.

    >>> from kvfunc.core import FullAttention, SlidingWindow
    >>> s = KVState.create({"full": FullAttention(num_blocks=65, block_size=16),
    ...                     "swa": SlidingWindow(num_blocks=17, block_size=16,
    ...                                          sliding_window=32)}, 4096,
    ...                    enable_prefix_caching=True)
    >>> fits_alone(s, 600, 64), fits_alone(s, 600, 600), fits_alone(s, 1100, 64)
    (True, False, False)
    """
    margin = max((g.policy.block_size for g in state.groups), default=1)
    computed = 0
    while computed < tokens:
        new = min(chunk, tokens - computed)
        res = allocate_slots(state, -1, computed, new, min(margin, tokens - computed - new))
        if not res.ok:
            return False
        state, computed = res.state, computed + new
    return True


#: When a request's output blocks are cached (:attr:`SchedulerConfig.cache_outputs`).
CACHE_OUTPUTS = ("as-filled", "at-release")


@attrs.frozen
class SchedulerConfig:
    """Engine settings of the simulated scheduler.

    Attributes:
        max_num_seqs: the most requests running at once.
        max_batched_tokens: tokens one step may schedule (prefill chunks + decodes).
        next_n: MTP depth: a decode step writes ``1 + next_n`` tokens.
        step_s: simulated seconds one step takes.
        speedup: arrival times are divided by this (2.0 = twice the load).
        cache_outputs: with prefix caching, when a request's output blocks
            are cached: ``"as-filled"`` (each as a step fills it, as vLLM
            does) or ``"at-release"`` (no hashing while decoding; the
            request's hashes go to ``free_request`` when it finishes or is
            preempted, as SGLang's radix cache inserts at a request's end).
    """

    max_num_seqs: int = 64
    max_batched_tokens: int = 2048
    next_n: int = 0
    step_s: float = 0.02
    speedup: float = 1.0
    cache_outputs: str = attrs.field(default="as-filled",
                                     validator=attrs.validators.in_(CACHE_OUTPUTS))


class Scheduler:
    """Runs a trace through the allocator step by step (see the module docstring).

    >>> from kvfunc.core import FullAttention, KVState
    >>> state = KVState.create({"full": FullAttention(num_blocks=64, block_size=16)}, 4096)
    >>> s = Scheduler(state, [TraceRequest(0.0, 100, 3), TraceRequest(0.0, 200, 2)],
    ...               SchedulerConfig(max_batched_tokens=512))
    >>> while s.step():
    ...     pass
    >>> s.finished, s.generated_tokens, s.steps, s.state.pools[0].num_free
    (2, 5, 3, 63)
    """

    def __init__(self, state: KVState, requests: Sequence[TraceRequest], config: SchedulerConfig,
                 *, on_delta: DeltaSink | None = None, prefix: PrefixCacher | None = None
                 ) -> None:
        self.state = state
        self.config = config
        # The empty state, to check that a request fits at all (see fits_alone), and the
        # longest request known to fit and the shortest known not to.
        self._fresh = state
        self._fits = (0, state.max_model_len + 1)
        self._on_delta = on_delta
        #: Block hashes, lookups and hit counters; None without prefix caching.
        self.prefix = prefix
        self._as_filled = config.cache_outputs == "as-filled"
        #: What the deltas say the prefix cache did (stored and evicted blocks).
        self.prefix_stats = PrefixCacheStats()
        self.arrival = [r.arrival_s / config.speedup for r in requests]
        self.prompt = [r.prompt_tokens for r in requests]
        self.output = [r.output_tokens for r in requests]
        n = len(requests)
        self.computed = [0] * n
        self.target = list(self.prompt)  # tokens to prefill before decoding
        self.generated = [0] * n
        self.preempted = [False] * n
        #: Requests rejected on arrival (too long, or larger than the whole cache).
        self.rejected_ids: list[int] = []
        self.running: list[int] = []
        self.waiting: deque[int] = deque()
        self._next = 0
        self.clock = 0.0
        self.steps = 0
        self.finished = self.preemptions = self.refused_allocations = 0
        self.prefill_tokens = self.recomputed_tokens = self.generated_tokens = 0
        self.prompt_tokens = 0  # prompts of the requests admitted (first admissions)
        self._capacity = [p.num_blocks - 1 for p in state.pools]
        #: Per pool (``state.pools``), blocks held after each step (the null block
        #: excluded): with a shared pool one series covers every group, counted once.
        self.usage: list[list[int]] = [[] for _ in state.pools]
        #: After each step: requests waiting and running, and running totals of
        #: preemptions, refused allocations, admitted prompt tokens and their hits.
        self.series: dict[str, list[int]] = {name: [] for name in SERIES}
        #: Simulated time at the end of each step, and the allocator's seconds in it
        #: (allocations, frees and prefix lookups).
        self.times: list[float] = []
        self.alloc_s: list[float] = []
        self._spent = 0.0

    @property
    def rejected(self) -> int:
        """Requests rejected on arrival so far."""
        return len(self.rejected_ids)

    @property
    def done(self) -> int:
        """Requests finished or rejected so far."""
        return self.finished + self.rejected

    # -- transitions, timed and logged ----------------------------------------------------
    def _emit(self, delta: BlocksChanged) -> None:
        if self.prefix is not None:
            self.prefix_stats = self.prefix_stats.add(delta)
        if self._on_delta is not None and not delta.is_empty:
            self._on_delta(self.steps, delta)

    def _allocate(self, state: KVState, batch: list[tuple[Any, ...]]) -> Any:
        hashes = None if self.prefix is None else self.prefix.live
        t0 = time.perf_counter()
        res = allocate_batch(state, batch, block_hashes=hashes)
        self._spent += time.perf_counter() - t0
        return res

    def _free(self, state: KVState, rid: int) -> KVState:
        hashes = None  # at release: the blocks of its computed tokens are cached as it frees
        if self.prefix is not None and not self._as_filled:
            hashes = self.prefix.hashes(rid, self.computed[rid])
        t0 = time.perf_counter()
        state, delta = free_request(state, rid, block_hashes=hashes)
        self._spent += time.perf_counter() - t0
        self._emit(delta)
        return state

    def _lookup(self, state: KVState, rid: int, target: int) -> Any:
        return self.prefix.lookup(state, rid, target)  # type: ignore[union-attr]

    def _stepped(self) -> None:  # a hook: the step's allocation is now self.state
        pass

    def _admitted(self, entry: tuple[Any, ...], *, again: bool) -> None:  # a hook
        pass

    # -- the step ----------------------------------------------------------------------------
    def _servable(self, rid: int) -> bool:
        total = self.prompt[rid] + self.output[rid]
        limit = self._fresh.max_model_len
        if total > limit:
            return False
        need = min(total + 2 * self.config.next_n, limit)
        # Whether a request fits alone grows with its length only: decide each length once.
        low, high = self._fits
        if need <= low or need >= high:
            return need <= low
        ok = fits_alone(self._fresh, need, self.config.max_batched_tokens)
        self._fits = (need, high) if ok else (low, need)
        return ok

    def _arrivals(self) -> None:
        arrival, n = self.arrival, len(self.arrival)
        while self._next < n and arrival[self._next] <= self.clock:
            rid = self._next
            self._next += 1
            if self._servable(rid):
                self.waiting.append(rid)
            else:
                self.rejected_ids.append(rid)

    def _running_batch(self, budget: int) -> tuple[list[tuple[Any, ...]], int]:
        n = self.config.next_n
        width = 1 + n
        computed, target, prefix = self.computed, self.target, self.prefix
        batch: list[tuple[Any, ...]] = []
        for rid in self.running:
            c = computed[rid]
            left = target[rid] - c
            if left > 0:
                chunk = left if left < budget else budget
                if chunk <= 0:
                    continue
                new, lookahead = chunk, 0
            elif budget >= width:
                new, lookahead = width, n - 1 if n else 0
            else:
                continue
            budget -= new
            if prefix is not None and (left > 0 or self._as_filled):  # the blocks it fills
                prefix.hashes(rid, c + new)  # get cached: the step reads prefix.live
            batch.append((rid, c, new, lookahead) if lookahead else (rid, c, new))
        return batch, budget

    def _admissions(self, budget: int) -> list[tuple[Any, ...]]:
        room = self.config.max_num_seqs - len(self.running)
        prefix, state = self.prefix, self.state
        batch: list[tuple[Any, ...]] = []
        for rid in self.waiting:
            if room <= 0 or budget <= 0:
                break
            target = self.target[rid]
            if prefix is None:
                chunk = min(target, budget)
                batch.append((rid, 0, chunk))
            else:
                t0 = time.perf_counter()
                hit = self._lookup(state, rid, target)
                self._spent += time.perf_counter() - t0
                chunk = min(target - hit.num_tokens, budget)
                batch.append((rid, hit.num_tokens, chunk, 0, 0, None,
                              prefix.hashes(rid, target), hit))
            budget -= chunk
            room -= 1
        return batch

    def _preempt_youngest(self, state: KVState) -> tuple[KVState, int]:
        victim = self.running.pop()
        state = self._free(state, victim)
        self.preemptions += 1
        self.preempted[victim] = True
        # Recompute: everything known so far is prefilled again from scratch.
        self.target[victim] = self.prompt[victim] + self.generated[victim]
        self.computed[victim] = 0
        self.waiting.appendleft(victim)
        return state, victim

    def _plan_step(self) -> tuple[Any, list[tuple[Any, ...]], int]:
        """Allocate the step; returns the result, the scheduled entries and admissions."""
        batch, budget = self._running_batch(self.config.max_batched_tokens)
        num_running = len(batch)
        batch += self._admissions(budget)
        state = self.state
        res = self._allocate(state, batch)
        if not res.refused:
            return res, batch, len(batch) - num_running
        refused = set(res.refused)
        self.refused_allocations += len(refused)
        if any(entry[0] in refused for entry in batch[:num_running]):
            batch = batch[:num_running]
            while res.refused:
                if not self.running:
                    raise AssertionError("a lone request was refused after it was checked")
                state, victim = self._preempt_youngest(state)
                batch = [entry for entry in batch if entry[0] != victim]
                res = self._allocate(state, batch)
                self.refused_allocations += len(res.refused)
            return res, batch, 0
        first = next(i for i, entry in enumerate(batch) if entry[0] in refused)
        batch = batch[:first]
        res = self._allocate(state, batch)  # a prefix of a sequential batch: same outcome
        assert not res.refused, res.refused
        return res, batch, first - num_running

    def step(self) -> bool:
        """Run one step; False (and nothing done) once every request is finished or rejected."""
        self._arrivals()
        if not self.running and not self.waiting:
            if self._next >= len(self.arrival):
                return False
            self.clock = self.arrival[self._next]  # idle: jump to the next arrival
            self._arrivals()
            if not self.waiting:
                return True
        self.run_step()
        return True

    def run_step(self) -> int:
        """One step of the requests already waiting or running; returns the entries scheduled.

        :meth:`step` calls it after the arrivals; a driver that queues requests
        itself (the disaggregated run's instances) calls it directly.
        """
        self._spent = 0.0
        res, batch, num_admitted = self._plan_step()
        self.state = res.state
        self._stepped()
        self._emit(res.delta)
        for entry in batch[len(batch) - num_admitted:]:
            rid = self.waiting.popleft()
            self.running.append(rid)
            if not self.preempted[rid]:
                self.prompt_tokens += self.prompt[rid]
            if self.prefix is not None:
                self.prefix.admitted(rid, entry[7], again=self.preempted[rid])
            self._admitted(entry, again=self.preempted[rid])
        self._advance(batch)
        self.steps += 1
        self.clock += self.config.step_s
        self.times.append(self.clock)
        self.alloc_s.append(self._spent)
        for used, capacity, pool in zip(self.usage, self._capacity, self.state.pools,
                                        strict=True):
            used.append(capacity - pool.num_free)
        self._record()
        return len(batch)

    def _record(self) -> None:
        series, prefix = self.series, self.prefix
        for name, value in (("waiting", len(self.waiting)), ("running", len(self.running)),
                            ("preemptions", self.preemptions),
                            ("refused_allocations", self.refused_allocations),
                            ("prompt_tokens", self.prompt_tokens),
                            ("hit_tokens", 0 if prefix is None else prefix.hit_tokens)):
            series[name].append(value)

    def _advance(self, batch: list[tuple[Any, ...]]) -> None:
        computed, target, generated, output = self.computed, self.target, self.generated, \
            self.output
        width = 1 + self.config.next_n
        finished = []
        for entry in batch:
            rid, c, new = entry[0], entry[1], entry[2]
            if c < target[rid]:  # a prefill chunk
                computed[rid] = c + new
                if self.preempted[rid]:
                    self.recomputed_tokens += new
                else:
                    self.prefill_tokens += new
                if c + new < target[rid]:
                    continue
                k = 1  # the prefill's last position samples the next token
            else:
                k = min(width, output[rid] - generated[rid])
                computed[rid] = c + k
            generated[rid] += k
            self.generated_tokens += k
            if generated[rid] >= output[rid]:
                finished.append(rid)
        if finished:
            state = self.state
            for rid in finished:
                state = self._free(state, rid)
                if self.prefix is not None:
                    self.prefix.release(rid)
            self.state = state
            self.finished += len(finished)
            gone = set(finished)
            self.running = [rid for rid in self.running if rid not in gone]
