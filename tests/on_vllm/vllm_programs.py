"""Random programs of KV cache manager calls, made the way vLLM's scheduler makes them.

A program is a list of operations drawn by Hypothesis (:data:`programs`);
:class:`Player` plays it on a manager: admissions after a prefix lookup
(with a connector's external tokens, caching delayed, the full-sequence
gate), chunked prefills and decode steps (tokens in flight as under async
scheduling until their output arrives, lookahead slots) that preempt what
no longer fits, late caching, windows trimmed on their own, frees, deferred
frees and their drain, evictions, cache resets, and the stats, events and
estimates a scheduler reads.  Played on a strict :class:`~kvfunc.vllm.ShadowKVCacheManager`, every
answer of kvfunc's manager is compared with vLLM's own.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from kvfunc.vllm.harness import make_request

BLOCK = 4
PREFIXES = [[p] * (3 * BLOCK) for p in range(3)]


@st.composite
def operation(draw: Any) -> tuple[Any, ...]:
    """One operation of a program."""
    kind = draw(st.sampled_from(["admit"] * 3 + ["step"] * 4 + ["output"] * 2 + [
        "free", "pop", "drain", "evict", "reset", "report", "skip", "cache"]))
    if kind == "admit":
        return (kind, draw(st.integers(0, len(PREFIXES) - 1)), draw(st.integers(0, 3 * BLOCK)),
                draw(st.integers(0, 5)), draw(st.booleans()), draw(st.sampled_from([0, 3, 8])),
                draw(st.sampled_from([0, 0, 0, BLOCK, 2 * BLOCK])))
    if kind == "step":
        return (kind, draw(st.sampled_from([0, 0, 1, 3])), draw(st.booleans()))
    if kind in ("free", "pop", "skip", "cache"):
        return (kind, draw(st.integers(0, 50)))
    if kind == "evict":
        return (kind, draw(st.lists(st.integers(1, 40), max_size=4)))
    return (kind,)


programs = st.lists(operation(), min_size=1, max_size=40)


class Player:
    """Plays programs on one manager, keeping the requests as a scheduler would."""

    def __init__(self, manager: Any, windows: tuple[int | None, ...] = ()) -> None:
        from vllm.v1.request import RequestStatus

        self.manager = manager
        self.windows = [w for w in windows if w is not None]
        self.running: list[Any] = []
        self.pending: list[list[Any]] = []
        self.count = 0
        self.chunk: dict[str, int] = {}
        self.status = RequestStatus

    def run(self, program: list[tuple[Any, ...]]) -> None:
        """Every operation in order, then everything freed."""
        for op in program:
            getattr(self, f"_{op[0]}")(*op[1:])
        for req in self.running:
            self.manager.free(req)
        self._drain()
        self._report()

    def _admit(self, prefix: int, extra: int, salt: int, must_fit: bool, chunk: int,
               external: int) -> None:
        m = self.manager
        if self.windows and any(r.num_in_flight_tokens for r in self.running):
            return  # a hit on blocks still in flight, under a window: a documented difference
        self.count += 1
        prompt = PREFIXES[prefix] + [100 + salt] * extra
        req = make_request(f"r{self.count}", prompt, block_size=BLOCK, max_tokens=64)
        blocks, hit, _ = m.get_computed_blocks(req)
        external = min(external, len(prompt) - 1 - hit)
        external -= external % BLOCK
        while external and any((hit + external - w + 1) // BLOCK > hit // BLOCK
                               for w in self.windows):
            external -= BLOCK  # past the window: the documented difference
        new = len(prompt) - hit - external
        if chunk:
            new = min(new, chunk)
        out = m.allocate_slots(req, new, hit, blocks, num_external_computed_tokens=external,
                               delay_cache_blocks=external > 0, full_sequence_must_fit=must_fit)
        if out is None:
            return
        m.record_prefix_cache_stats(req, hit)
        req.status = self.status.RUNNING
        req.num_computed_tokens = hit + external + new
        self.chunk[req.request_id] = chunk
        self.running.append(req)

    def _step(self, lookahead: int, in_flight: bool) -> None:
        """One scheduling step; with ``in_flight`` its tokens stay in flight until an output."""
        m = self.manager
        for req in list(self.running):
            left = req.num_prompt_tokens - req.num_computed_tokens
            if left <= 0:
                req.append_output_token_ids(req.num_tokens % 5)
            new = max(1, min(left, self.chunk[req.request_id] or left))
            if m.allocate_slots(req, new, num_lookahead_tokens=lookahead) is None:
                m.free(req)
                self.running.remove(req)
                continue
            req.num_computed_tokens += new
            if in_flight:
                req.num_in_flight_tokens += new

    def _output(self) -> None:
        """The in-flight steps' outputs arrive: their tokens are processed and cached."""
        for req in self.running:
            if req.num_in_flight_tokens:
                req.num_in_flight_tokens = 0
                self.manager.cache_blocks(req, req.num_computed_tokens)

    def _free(self, index: int) -> None:
        if self.running:
            self.manager.free(self.running.pop(index % len(self.running)))

    def _pop(self, index: int) -> None:
        if self.running:
            req = self.running.pop(index % len(self.running))
            self.pending.append(self.manager.pop_blocks_for_free(req))

    def _skip(self, index: int) -> None:
        if self.running:
            req = self.running[index % len(self.running)]
            self.manager.remove_skipped_blocks(
                req.request_id, req.num_computed_tokens - req.num_in_flight_tokens,
                req.num_prompt_tokens)

    def _cache(self, index: int) -> None:
        if self.running:
            req = self.running[index % len(self.running)]
            self.manager.cache_blocks(req, req.num_computed_tokens - req.num_in_flight_tokens)

    def _drain(self) -> None:
        for blocks in self.pending:
            self.manager.block_pool.free_blocks(reversed(blocks))
        self.pending = []

    def _evict(self, ids: list[int]) -> None:
        """Evict cached blocks nobody holds (a held block is the documented difference)."""
        m = self.manager
        held = {b for req in self.running for g in m.get_block_ids(req.request_id) for b in g}
        held |= {b.block_id for blocks in self.pending for b in blocks}
        m.evict_blocks({b for b in ids if b < m.block_pool.num_gpu_blocks and b not in held})

    def _reset(self) -> None:
        self.manager.reset_prefix_cache()

    def _report(self) -> None:
        m = self.manager
        m.take_events()
        m.make_prefix_cache_stats()
        m.take_new_block_ids()
        for req in self.running:
            m.estimate_cached_tokens(req)
