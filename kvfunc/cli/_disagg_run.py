"""The disaggregated run: prefill and decode instances, the hand-overs between them, in time order.

Theory of operation
-------------------
Every instance keeps its own clock and steps like the colocated scheduler,
one step of ``--step-ms``; an instance with nothing to do waits for the
next event that gives it work.  The run repeatedly takes the earliest of:

1. a transfer event (:mod:`kvfunc.cli._disagg_link`): a prefill *ready*
   (the first token sampled: the KV is offered under its key, and waits for
   decode room), a transfer *start* (both caches pinned), a transfer *end*
   (the pull succeeds: the prefill instance frees the blocks, the decode
   instance runs the request from its next step);
2. an arrival: the request goes to the prefill instance whose cache holds
   the longest prefix of its prompt, the least loaded among equals, and
   among those the next in turn (a request that could not run on an empty
   decode instance, or prefill on an empty prefill instance, is rejected
   there);
3. the step of the instance whose clock is earliest (prefill instances first
   on a tie).

Transfers find decode room in the order their prefills finished: the first
waiting one goes to the least loaded decode instance (the next in turn
among equals) that has a seat
(``--concurrency`` requests running, recomputing or arriving) and blocks for
its prompt, and takes none while it has preempted requests of its own to
recompute.  If no decode instance has room, it and every transfer behind it
wait, and the prefill instances keep its blocks meanwhile.

A request's time to first token ends when its KV (and with it the first
token, sampled by the prefill's last step) reaches the decode instance; its
later tokens come out at the end of the decode steps that make them.
"""

from __future__ import annotations

import heapq
import math
import time
from array import array
from collections import deque
from collections.abc import Callable

import attrs

from kvfunc.cli._disagg import DisaggConfig, DisaggResult
from kvfunc.cli._disagg_instances import DecodeInstance, PrefillInstance
from kvfunc.cli._disagg_link import TransferLedger
from kvfunc.cli._disagg_report import build_result
from kvfunc.cli._errors import CLIError
from kvfunc.cli._inputs import MAX_STATE_BLOCKS, check_state_size
from kvfunc.cli._plan import PlanConfig, plan_model, size_shared_blocks
from kvfunc.cli._prefix import PrefixCacher, hash_block_size
from kvfunc.cli._scheduler import SchedulerConfig, fits_alone
from kvfunc.cli._simulate import PREFIX_HASH_FN, build_state
from kvfunc.cli._simulate import _cycle_collector_paused as cycle_collector_paused
from kvfunc.core import NULL_BLOCK, KVState, allocate_slots, get_block_ids, shared_page_layout

__all__ = ["MAX_RUN_BLOCKS", "SERIES", "run_disaggregated"]

Progress = Callable[[int, int], None]
#: The most blocks of all instances' states together (each costs host memory).
MAX_RUN_BLOCKS = 2 * MAX_STATE_BLOCKS
#: The run's series, sampled at every step of every instance (see :class:`DisaggResult`).
SERIES = ("prefill_waiting", "prefill_running", "wait_room", "on_link",
          "decode_running", "decode_waiting", "bytes_moved", "prefill_preemptions",
          "decode_preemptions", "prompt_tokens", "hit_tokens")
_READY, _START, _END = 0, 1, 2


def _size(config: DisaggConfig) -> tuple[dict[str, int], KVState, KVState]:
    """Bytes per block of each group, and an empty prefill and decode state (checked bounds).

    A group's block moves its own bytes in either layout (a shared pool's page
    padding is not sent).
    """
    base = config.base
    plan = PlanConfig(base.budget, concurrency=base.concurrency,
                      max_prefill_tokens=base.max_batched_tokens, max_len=base.model_len)
    if base.layout == "shared":
        pool = {"shared": size_shared_blocks(base.model, plan)}
        page = shared_page_layout(base.model.cache_info)
        block_bytes = {g.manager_key: g.block_bytes for g in page.groups}
    else:
        report = plan_model(base.model, plan)
        pool = {g.manager_key: g.num_blocks for g in report.groups}
        block_bytes = {g.manager_key: g.block_bytes for g in report.groups}
    check_state_size(pool, fix="lower --memory or --concurrency, or raise --block-size")
    blocks = sum(pool.values())
    total = blocks * (config.num_prefill + config.num_decode)
    if total > MAX_RUN_BLOCKS:
        raise CLIError(f"{config.ratio} instances of {blocks:,} blocks each would hold "
                       f"{total:,}; kvfunc simulates at most {MAX_RUN_BLOCKS:,} in all (each "
                       "costs host memory): lower --memory or the instances")
    p_state = build_state(base)
    d_state = build_state(attrs.evolve(base, prefix_caching=False))
    return block_bytes, p_state, d_state


class _Run:
    """The mutable state of one run (see the module docstring)."""

    def __init__(self, config: DisaggConfig) -> None:
        base = config.base
        self.config = config
        self.block_bytes, p_state, d_state = _size(config)
        self.requests = requests = base.trace.requests
        sched = SchedulerConfig(max_num_seqs=base.concurrency,
                                max_batched_tokens=base.max_batched_tokens,
                                next_n=base.model.next_n, step_s=base.step_ms / 1000,
                                speedup=base.speedup)
        self.prefix = (PrefixCacher(requests, hash_block_size(p_state), hash_fn=PREFIX_HASH_FN)
                       if base.caches_prefixes else None)
        self.prefill = [PrefillInstance(i, p_state, requests, sched, prefix=self.prefix)
                        for i in range(config.num_prefill)]
        self.decode = [DecodeInstance(i, d_state, requests, sched)
                       for i in range(config.num_decode)]
        self.fresh = (p_state, d_state)
        self.ledger = TransferLedger(config.num_prefill, config.num_decode, config.link_bandwidth)
        n = len(requests)
        self.arrival = [r.arrival_s / base.speedup for r in requests]
        self.origin = [-1] * n
        self.turn = [0, 0]  # among equals, prefill and decode instances take turns
        self.next = 0
        self.events: list[tuple[float, int, int, int]] = []  # (time, seq, kind, rid)
        self.seq = 0
        self.pending: deque[int] = deque()  # ready transfers waiting for decode room
        self.room_changed = False
        self.in_flight: set[int] = set()  # transfers that found room, pull not done
        self.handing: set[int] = set()  # prefills done, their ready event not yet handled
        self.rejected_ids: list[int] = []
        self.served = self.finished_on_prefill = 0
        self.ttft: list[float] = []
        #: Per served request, the parts of its time to first token; per transfer, its waits.
        self.parts: dict[str, list[float]] = {k: [] for k in ("prefill", "room", "link",
                                                              "transfer")}
        self.waits: dict[str, list[float]] = {k: [] for k in ("room", "link", "transfer")}
        self.clock = 0.0
        self.times = array("d")
        self.series = {name: array("q") for name in SERIES}

    # -- arrivals ------------------------------------------------------------------------
    def servable(self, rid: int) -> bool:
        """Whether ``rid`` fits an empty decode instance, and its prompt an empty prefill one.

        The decode side takes the whole prompt at once (the pull writes into
        it); the prefill side prefills it chunk by chunk.
        """
        r = self.requests[rid]
        p_state, d_state = self.fresh
        total = r.prompt_tokens + r.output_tokens
        limit = d_state.max_model_len
        if total > limit:
            return False
        need = min(total + 2 * self.config.base.model.next_n, limit)
        return (allocate_slots(d_state, -1, 0, need).ok
                and fits_alone(p_state, r.prompt_tokens, self.config.base.max_batched_tokens))

    def _route(self, rid: int) -> PrefillInstance:
        prefix, prompt, n = self.prefix, self.requests[rid].prompt_tokens, len(self.prefill)
        hits = ({p.index: prefix.lookup(p.state, rid, prompt).num_tokens for p in self.prefill}
                if prefix is not None and n > 1 else {})
        turn = self.turn[0]
        inst = min(self.prefill, key=lambda p: (-hits.get(p.index, 0), p.load,
                                                (p.index - turn) % n))
        self.turn[0] = inst.index + 1
        return inst

    def _arrive(self, rid: int) -> None:
        now = self.arrival[rid]
        if not self.servable(rid):
            self.rejected_ids.append(rid)
            return
        inst = self._route(rid)
        self.origin[rid] = inst.index
        inst.queue(rid)
        _wake(inst, now)

    # -- hand-overs ----------------------------------------------------------------------
    def _push(self, when: float, kind: int, rid: int) -> None:
        heapq.heappush(self.events, (when, self.seq, kind, rid))
        self.seq += 1

    def _kv_bytes(self, state: KVState, rid: int) -> int:
        block_bytes = self.block_bytes
        return sum(block_bytes[key] * sum(1 for b in ids if b != NULL_BLOCK)
                   for key, ids in get_block_ids(state, rid).items())

    def _event(self, now: float, kind: int, rid: int) -> None:
        if kind == _READY:
            self._ready(now, rid)
        elif kind == _START:
            self.ledger.start(rid)
        else:
            self._end(now, rid)

    def _ready(self, now: float, rid: int) -> None:
        """A prefill is done: offer its KV for a pull, or finish a one-token request."""
        self.handing.discard(rid)
        inst = self.prefill[self.origin[rid]]
        self.parts["prefill"].append(now - self.arrival[rid])
        if self.requests[rid].output_tokens > 1:
            self.ledger.offer(rid, inst.index, self._kv_bytes(inst.state, rid), now)
            self.pending.append(rid)
            self.room_changed = True
            return
        inst.release(rid)  # done: nothing to hand over
        _wake(inst, now)
        self.served += 1
        self.finished_on_prefill += 1
        self.ttft.append(now - self.arrival[rid])
        for part in ("room", "link", "transfer"):
            self.parts[part].append(0.0)

    def _end(self, now: float, rid: int) -> None:
        """A pull succeeded: the prefill side frees the blocks, the decode side runs it."""
        flight = self.ledger.flights[rid]
        released = self.ledger.finish(rid)
        assert released, "the pull released the prefill side's cache"
        self.in_flight.discard(rid)
        source, target = self.prefill[flight.prefill], self.decode[flight.decode]
        source.release(rid)
        _wake(source, now)
        target.receive(rid, now)
        _wake(target, now)
        self.ttft.append(now - self.arrival[rid])
        for part, took in (("room", flight.accept_s - flight.ready_s),
                           ("link", flight.start_s - flight.accept_s),
                           ("transfer", flight.end_s - flight.start_s)):
            self.parts[part].append(took)
            self.waits[part].append(took)

    def _match(self, now: float) -> None:
        """Give waiting transfers decode room, in order, until the first that finds none."""
        self.room_changed = False
        prompt = self.requests
        while self.pending:
            rid = self.pending[0]
            turn, n = self.turn[1], len(self.decode)
            takers = sorted((d for d in self.decode if d.can_take),
                            key=lambda d: (d.load, (d.index - turn) % n))
            target = next((d for d in takers if d.reserve(rid, prompt[rid].prompt_tokens)),
                          None)
            if target is None:
                return
            self.pending.popleft()
            self.turn[1] = target.index + 1
            # a decode instance takes a pull when its scheduler runs, between steps: its state
            # is as of the end of its last step, and the room is there from then
            made = target.times[-1] if target.times else now
            flight = self.ledger.accept(rid, target.index, max(now, made))
            self.in_flight.add(rid)
            self._push(flight.start_s, _START, rid)
            self._push(flight.end_s, _END, rid)

    # -- steps ---------------------------------------------------------------------------
    def _next_instance(self) -> PrefillInstance | DecodeInstance | None:
        best: PrefillInstance | DecodeInstance | None = None
        instances: list[PrefillInstance | DecodeInstance] = [*self.prefill, *self.decode]
        for inst in instances:
            if inst.has_work and (best is None or inst.clock < best.clock):
                best = inst
        return best

    def _step(self, inst: PrefillInstance | DecodeInstance) -> None:
        scheduled = inst.run_step()
        inst.blocked = scheduled == 0
        if isinstance(inst, PrefillInstance):
            for rid in inst.handed_off:
                self._push(inst.clock, _READY, rid)  # at the end of the step
                self.handing.add(rid)
            inst.handed_off.clear()
            return
        for rid in inst.finished_ids:
            self.ledger.leave_decode(rid)
        self.served += len(inst.finished_ids)
        inst.finished_ids.clear()
        self.room_changed = True

    def _record(self, now: float) -> None:
        self.times.append(now)
        p, d, s = self.prefill, self.decode, self.series
        prefix = self.prefix
        for name, value in (
                ("prefill_waiting", sum(len(i.waiting) for i in p)),
                ("prefill_running", sum(len(i.running) for i in p)),
                ("wait_room", len(self.pending)),
                ("on_link", len(self.in_flight)),
                ("decode_running", sum(len(i.running) for i in d)),
                ("decode_waiting", sum(len(i.waiting) for i in d)),
                ("bytes_moved", self.ledger.bytes_moved),
                ("prefill_preemptions", sum(i.preemptions for i in p)),
                ("decode_preemptions", sum(i.preemptions for i in d)),
                ("prompt_tokens", sum(i.prompt_tokens for i in p)),
                ("hit_tokens", 0 if prefix is None else prefix.hit_tokens)):
            s[name].append(value)

    def advance(self) -> bool:
        """Handle the earliest event, arrival or step; False once there is none left."""
        inf = math.inf
        t_arrival = self.arrival[self.next] if self.next < len(self.arrival) else inf
        t_event = self.events[0][0] if self.events else inf
        inst = self._next_instance()
        t_step = inst.clock if inst is not None else inf
        if t_event <= t_arrival and t_event <= t_step:
            if t_event == inf:
                return False
            now, _, kind, rid = heapq.heappop(self.events)
            self._event(now, kind, rid)
        elif t_arrival <= t_step:
            now = t_arrival
            self._arrive(self.next)
            self.next += 1
        else:
            assert inst is not None
            now = t_step
            self._step(inst)
            self._record(now)
        self.clock = max(self.clock, now)
        if self.room_changed and self.pending:
            self._match(now)
        return True

    def loop(self, on_progress: Progress | None) -> None:
        """Run every request to its end; the registries are empty then."""
        n, rounds = len(self.arrival), 0
        while self.advance():
            rounds += 1
            if on_progress is not None and rounds % 1024 == 0:
                on_progress(self.served + len(self.rejected_ids), n)
        left = n - self.served - len(self.rejected_ids)
        if left:
            raise AssertionError(f"the run stopped with {left} requests unfinished")
        self.ledger.check(set(), set())

    def check(self) -> None:
        """Assert that the registries and the instances agree (tests call it after each event).

        Every request handed off and not yet pulled is held by its key on its
        prefill instance and still holds its blocks there; every request a
        decode instance reserved, receives or serves has its cache there.
        """
        awaiting = set(self.pending) | self.in_flight
        self.ledger.check(awaiting, set(self.ledger.flights))
        held = awaiting | self.handing
        for inst in self.prefill:
            mine = [rid for rid in held if self.origin[rid] == inst.index]
            assert inst.held == len(mine), (inst.index, inst.held, len(mine))
            assert all(get_block_ids(inst.state, rid) for rid in mine)
        for dec in self.decode:
            mine = [rid for rid, f in self.ledger.flights.items() if f.decode == dec.index]
            assert len(mine) == dec.load, (dec.index, len(mine), dec.load)


def _wake(inst: PrefillInstance | DecodeInstance, now: float) -> None:
    """Something happened to ``inst`` at ``now``: it steps again, not before then."""
    inst.blocked = False
    inst.clock = max(inst.clock, now)


def run_disaggregated(config: DisaggConfig, *, on_progress: Progress | None = None
                      ) -> DisaggResult:
    """Run ``config``: its trace through P prefill and D decode instances (module docstring).

    Args:
        config: the colocated settings (``budget`` is one instance's), P:D, the link.
        on_progress: called now and then with ``(requests done, requests in all)``.

    Raises:
        CLIError: the budget cannot hold the model's caches, or the instances
            together pass the block bound (:data:`MAX_RUN_BLOCKS`).

    >>> from kvfunc.cli._plan import Budget
    >>> from kvfunc.cli._presets import build_preset
    >>> from kvfunc.cli._simulate import SimulationConfig
    >>> from kvfunc.cli._trace import load_trace
    >>> base = SimulationConfig(build_preset("deepseek-v3"),
    ...                         load_trace("mooncake-conversation", limit=20), Budget(2**35))
    >>> result = run_disaggregated(DisaggConfig(base, 1, 2))
    >>> from kvfunc.cli._units import format_bytes
    >>> t = result.transfers
    >>> result.counters["served"], t.count, format_bytes(t.bytes_moved)
    (20, 20, '19.33 GiB')
    """
    run = _Run(config)
    start = time.perf_counter()
    with cycle_collector_paused():
        run.loop(on_progress)
    wall = time.perf_counter() - start
    if on_progress is not None:
        on_progress(run.served + len(run.rejected_ids), len(run.arrival))
    return build_result(run, wall)
