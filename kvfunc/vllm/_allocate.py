"""Prefix lookups and ``allocate_slots``: vLLM's admission rules on kvfunc transitions.

vLLM's ``allocate_slots`` for a request with ``comp`` computed tokens, a
local prefix hit of ``new_comp`` tokens, ``ext`` tokens a connector brings
and ``new`` tokens to compute::

    | comp | new_comp | ext | new | lookahead |
    |<-- processed -->| in flight: written, not yet confirmed
                      |<----- to be allocated ---------->|
                      |<-- cached as the blocks fill -->|

is one kvfunc ``allocate_slots``: ``computed_tokens`` is the processed
prefix (what a sliding window may let go), ``num_new_tokens`` reaches the
end of ``new`` (blocks that fill are cached with the request's own hashes)
and the lookahead comes on top.  vLLM frees what slid out of the window
before it checks for room, even when it then refuses; so does the manager:
a refused call is the recycling transition instead.

vLLM's three admission gates are questions about the transition: the
full-sequence gate counts blocks with vLLM's own arithmetic before anything
happens, and a request fits when the transition succeeds and leaves
``reserved_blocks + watermark`` blocks free, exactly when vLLM's
``needed + watermark <= free - reserved`` holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import kvfunc as kf
from kvfunc.core._fold import CACHING, NOTHING, SLIDES, work_of
from kvfunc.core._internal import busy_slots, run_batch
from kvfunc.core._rows import row_tail
from kvfunc.vllm import _accounting, _inflight
from kvfunc.vllm._events import cached_block_events
from kvfunc.vllm._owing import Owing

__all__ = ["Allocation"]

_WAITING_STATES: frozenset[Any] = frozenset()


def _waiting_states() -> frozenset[Any]:
    global _WAITING_STATES
    if not _WAITING_STATES:
        from vllm.v1.request import RequestStatus

        _WAITING_STATES = frozenset((RequestStatus.WAITING, RequestStatus.PREEMPTED))
    return _WAITING_STATES


class Allocation(Owing):
    """Prefix lookups, vLLM's block arithmetic and ``allocate_slots``."""

    def get_computed_blocks(self, request: Any, max_cache_hit_length: int | None = None
                            ) -> tuple[Any, int, int]:
        """The request's cached prefix: ``(blocks, tokens, shared_prefix_boundary)``.

        The boundary is the full-attention hit when a sliding window caches
        less of it (hybrid models), else 0, as vLLM reports it.
        """
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        limit = request.num_tokens - 1 if max_cache_hit_length is None else max_cache_hit_length
        limit = max(limit, 0)
        state = self._state_for(request)
        hashes = self._hashes.of(request)
        hit = kf.lookup_prefix(state, hashes, max_tokens=limit)
        n = hit.num_tokens
        boundary = 0
        if len(self._layout.keys) > 1:
            longest = _accounting.fa_hit_tokens(state, self._layout, hashes.hashes, limit)
            boundary = longest if longest > n else 0
        if not n:
            return self.empty_kv_cache_blocks, 0, boundary
        tables = [hit.block_ids[key] for key in self._layout.keys]
        if (self.enable_kv_cache_events
                and getattr(request, "kv_cache_report_mode", "incremental") == "full"):
            self._events.extend(cached_block_events(request, tables, self._layout.block_size))
        blocks = self._handles.blocks
        return (self._blocks_type(tuple(blocks(t) for t in tables)), n,
                boundary)

    def get_computed_blocks_for_connector(self, request: Any,
                                          max_cache_hit_length: int | None = None
                                          ) -> tuple[Any, int, int, bool]:
        """:meth:`get_computed_blocks` for a connector (the groups never diverge here)."""
        return (*self.get_computed_blocks(request, max_cache_hit_length), False)

    def truncate_computed_blocks(self, blocks: Any, num_computed_tokens: int) -> Any:
        """A lookup result cut at a block-aligned token count (nothing changes)."""
        bs = self._layout.block_size
        n = num_computed_tokens // bs
        if num_computed_tokens % bs or any(n > len(group) for group in blocks.blocks):
            msg = (f"cannot cut a lookup result of {[len(g) for g in blocks.blocks]} blocks at "
                   f"{num_computed_tokens} tokens (block size {bs})")
            raise kf.InvalidArgumentError(msg)
        return self.create_kv_cache_blocks(tuple(list(g[:n]) for g in blocks.blocks))

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                               new_computed_blocks: Sequence[Sequence[Any]] | None,
                               total_computed_tokens: int, apply_admission_cap: bool) -> int:
        """vLLM's block need of a request (``coordinator.get_num_blocks_to_allocate``)."""
        hit = None
        if new_computed_blocks is not None and any(new_computed_blocks):
            hit = [[b.block_id for b in g] for g in new_computed_blocks]
        return _accounting.blocks_to_allocate(self._tables, self._layout, request_id, num_tokens,
                                              hit, total_computed_tokens, apply_admission_cap)

    def allocate_slots(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Any = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, full_sequence_must_fit: bool = False,
                       reserved_blocks: int = 0, has_scheduled_reqs: bool = True,
                       skip_zeroing_group_ids: tuple[int, ...] = ()) -> Any:
        """Slots for a request's new tokens (see the module docstring); None when refused.

        The scheduler's usual call -- a running request's next tokens, no
        prefix hit, no connector, no gate, nothing in flight under a window,
        no watermark -- is one ``kf.allocate_slots`` from the computed count.
        Before it, the rows say (``work_of``) whether the call has nothing to
        do (a decode step that fills no block: it returns at once) or only a
        block to cache (it is owed: see ``_pay_owed``).  Every other call is
        :meth:`_allocate`.
        """
        if (num_new_computed_tokens or num_external_computed_tokens or full_sequence_must_fit
                or delay_cache_blocks or reserved_blocks or not num_new_tokens
                or (self._windowed and request.num_in_flight_tokens)
                or (self.watermark_blocks and has_scheduled_reqs
                    and request.status in _waiting_states())):
            return self._allocate(request, num_new_tokens, num_new_computed_tokens,
                                  new_computed_blocks, num_lookahead_tokens,
                                  num_external_computed_tokens, delay_cache_blocks,
                                  full_sequence_must_fit, reserved_blocks, has_scheduled_reqs,
                                  skip_zeroing_group_ids)
        state, rid = self._value, request.request_id
        computed = request.num_computed_tokens
        if computed > self.max_model_len:
            computed = self.max_model_len
        written = computed + num_new_tokens
        work = work_of(state.groups, state.max_model_len, rid, computed, written,
                       written + num_lookahead_tokens)
        if work == NOTHING:
            return self.empty_kv_cache_blocks  # the common decode step: nothing to do
        owed = self._owed
        hashes = None
        if self.enable_caching:  # without CACHING nothing caches: the news only is seen
            if work & CACHING:
                hashes = self._hashes.for_step(request, written)
            else:
                self._hashes.note(request, written)
        if work == CACHING and self._defers and rid not in owed:
            if hashes is not None:  # (without news the step caches nothing: nothing owed)
                self._owe(request, computed, num_new_tokens, num_lookahead_tokens, hashes)
            return self.empty_kv_cache_blocks  # a block filled: cached later (``_pay_owed``)
        if self._defers and not self._zeroing and self.metrics_collector is None:
            if not work & SLIDES:  # maybe only a take: owed (_owe_take)
                taken = self._owe_take(request, state, work, computed, num_new_tokens,
                                       num_lookahead_tokens, hashes)
                if taken is not None:
                    return taken
            elif self._owe_slide(request, state, work, computed, num_new_tokens,
                                 num_lookahead_tokens, hashes):
                return self.empty_kv_cache_blocks  # a window's block let go: owed
        merged = False
        if owed:  # this transition caches what the request owes, or what is owed is paid
            merged = self._settle_owed(request, work, computed, written + num_lookahead_tokens)
            state = self._value
            if merged and hashes is None:
                hashes = self._hashes.of(request)
        result = busy_slots(state, rid, computed, num_new_tokens, num_lookahead_tokens, hashes,
                            self._records)
        if merged and result.ok:
            self._forgive(rid)
        new_state = result.state
        if new_state is state:  # refused, or nothing to do
            return self.empty_kv_cache_blocks if result.ok else self._refused(
                request, max(0, computed - request.num_in_flight_tokens))
        if self._owes_blocks:  # it comes before the owed takes: it takes no block
            self._commit(new_state, result.delta, "allocate_slots", request,
                         (computed, written), ahead=True)
            return self.empty_kv_cache_blocks
        return self._adopt(state, new_state, result.delta, request, None, (computed, written), 0,
                           skip_zeroing_group_ids)

    def _allocate(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int,
                  new_computed_blocks: Any, num_lookahead_tokens: int,
                  num_external_computed_tokens: int, delay_cache_blocks: bool,
                  full_sequence_must_fit: bool, reserved_blocks: int, has_scheduled_reqs: bool,
                  skip_zeroing_group_ids: tuple[int, ...]) -> Any:
        """:meth:`allocate_slots` with every argument vLLM can pass (see the module docstring)."""
        if not (num_new_tokens or num_external_computed_tokens or num_new_computed_tokens):
            raise ValueError("num_new_tokens must be greater than 0 when there are no "
                             "computed tokens to adopt")
        state, rid = self._state_for(request), request.request_id
        local = request.num_computed_tokens + num_new_computed_tokens
        computed = min(local + num_external_computed_tokens, self.max_model_len)
        watermark = (self.watermark_blocks if has_scheduled_reqs
                     and request.status in _waiting_states() else 0)
        hit = None
        if new_computed_blocks is not None and num_new_computed_tokens:
            hit = self._hit(request, new_computed_blocks, num_new_computed_tokens,
                            num_external_computed_tokens)
        if full_sequence_must_fit and self._full_sequence_refused(
                request, hit, computed, watermark):
            return None
        processed = max(0, computed - request.num_in_flight_tokens)
        written = computed + num_new_tokens
        hashes = self._hashes_for(request, hit, delay_cache_blocks, written)
        result = self._transition(rid, hit, min(local, self.max_model_len), processed, computed,
                                  written, num_lookahead_tokens, hashes)
        if result is None or (
                (reserved_blocks or watermark)
                and result[0].pools[0].num_free < reserved_blocks + watermark):
            return self._refused(request, processed)
        return self._adopt(state, result[0], result[1], request, hit, (computed, written),
                           computed if num_external_computed_tokens else 0,
                           skip_zeroing_group_ids)

    def _refused(self, request: Any, processed: int) -> None:
        """A refused allocation: vLLM still lets go what slid out of the windows (None)."""
        rid = request.request_id
        state = self._state_for(request, False)  # what it owes is cached first
        self._hashes.unsee(rid)
        if state.group(self._layout.keys[0]).row(rid) is not None:
            self._commit(*kf.recycle_skipped_blocks(state, rid, processed),
                         "recycle_skipped_blocks", request, (processed,))

    def _adopt(self, state: kf.KVState, new_state: kf.KVState, delta: kf.BlocksChanged | None,
               request: Any, hit: kf.PrefixHit | None, args: tuple[int, int],
               external_end: int, skip_zeroing: tuple[int, ...]) -> Any:
        """Commit an accepted allocation; the ``KVCacheBlocks`` of the blocks it added (read
        from the rows: none when the delta, if built, appended none)."""
        if delta is not None and "A" not in delta.order:  # no block taken
            self._commit(new_state, delta, "allocate_slots", request, args)
            return self.empty_kv_cache_blocks
        blocks, zeroed = self._new_blocks(state, new_state, request.request_id, hit,
                                          external_end, skip_zeroing)
        self._commit(new_state, delta, "allocate_slots", request, args, zeroed=zeroed)
        return blocks

    def _transition(self, rid: str, hit: kf.PrefixHit | None, local: int, processed: int,
                    computed: int, written: int, lookahead: int,
                    hashes: kf.BlockHashes | None
                    ) -> tuple[kf.KVState, kf.BlocksChanged | None] | None:
        """The allocation as one kvfunc transition, or None when it does not fit (its delta
        None when none is read: ``_records``).

        Usually one ``busy_slots`` (an admission with a hit: one entry of a
        ``run_batch``).  Two cases are two entries of one ``run_batch``
        instead: a connector's external tokens (vLLM gives every group its
        external blocks before any group its new ones), and tokens in flight
        under a window (``_inflight``).
        """
        state, record = self._value, self._records
        if computed > local:  # external tokens: every group's, then every group's new ones
            start = hit.num_tokens if hit is not None else local
            entries = [kf.SlotRequest(rid, start, computed - start, 0, 0, None, hashes, hit),
                       kf.SlotRequest(rid, computed, written - computed, lookahead, 0, None,
                                      hashes)]
        elif hit is not None:
            entries = [kf.SlotRequest(rid, hit.num_tokens, written - hit.num_tokens, lookahead,
                                      0, None, hashes, hit)]
        else:
            found = None
            if processed < computed:
                found = _inflight.entries(state, self._layout, rid, processed, computed, written,
                                          lookahead, hashes)
            if found is None:
                r = busy_slots(state, rid, computed, written - computed, lookahead, hashes,
                               record)
                return (r.state, r.delta) if r.ok else None
            entries = found
        b = run_batch(state, entries, record)
        return None if b.refused else (b.state, b.delta)

    def _hit(self, request: Any, blocks: Any, tokens: int, external: int) -> kf.PrefixHit | None:
        """The prefix hit vLLM hands back, as a :class:`~kvfunc.PrefixHit`.

        With external tokens after it, a window's hit blocks that the
        external tokens push out of the window are left out (null), as vLLM
        skips them.
        """
        tables = [tuple(b.block_id for b in g) for g in blocks.blocks]
        if not any(tables):
            return None
        if external:
            bs = self._layout.block_size
            for i, window in enumerate(self._layout.windows):
                if window is not None:
                    skipped = min(max(0, tokens + external - window + 1) // bs, len(tables[i]))
                    tables[i] = (0,) * skipped + tables[i][skipped:]
        return kf.PrefixHit(tokens, dict(zip(self._layout.keys, tables, strict=True)),
                            max(request.num_tokens, tokens))

    def _full_sequence_refused(self, request: Any, hit: kf.PrefixHit | None, computed: int,
                               watermark: int) -> bool:
        """vLLM's full-sequence gate: the whole sequence would not fit now."""
        full = min(request.num_tokens, self.max_model_len)
        tables = None if hit is None else [hit.block_ids[k] for k in self._layout.keys]
        need = _accounting.blocks_to_allocate(self._value, self._layout, request.request_id,
                                              full, tables, computed, True)
        return need + watermark > self._value.pools[0].num_free

    def _hashes_for(self, request: Any, hit: kf.PrefixHit | None, delay_cache_blocks: bool,
                    written: int) -> kf.BlockHashes | None:
        """The hashes the allocation caches with: none without caching, or when no block can
        complete (``RequestHashes.for_step``); a delayed caching keeps only the hit's."""
        if not self.enable_caching:
            return None
        if not delay_cache_blocks:
            if hit is None:
                return self._hashes.for_step(request, written)
            return self._hashes.of(request)
        if hit is None:
            return None
        hashes = self._hashes.of(request)
        n = hit.num_tokens // hashes.block_size
        return kf.BlockHashes.of_digests(hashes.hashes[:n], None, hashes.block_size)

    def _new_blocks(self, before: kf.KVState, after: kf.KVState, rid: str,
                    hit: kf.PrefixHit | None, external_end: int,
                    skip_zeroing: tuple[int, ...]) -> tuple[Any, list[int]]:
        """The blocks this allocation added to the request's tables, per group, and the
        ids to zero (none when vLLM does not zero).

        Blocks for tokens a connector brings (before ``external_end``) are not
        returned (vLLM returns only the blocks for tokens to compute), and are
        not zeroed in the groups the load writes.
        """
        bs = self._layout.block_size
        first_new = -(-external_end // bs)
        out: list[list[Any]] = []
        zeroed: list[int] = []
        handles, zeroing = self._handles.blocks, self._zeroing
        for i, (old, new) in enumerate(zip(before.groups, after.groups, strict=True)):
            if hit is not None:
                held = len(hit.block_ids[old.key])
            else:
                row = old.rows.get(rid)
                held = 0 if row is None else row.length
            row = new.rows[rid]
            returned = row_tail(row, held if held > first_new else first_new)
            out.append(handles(returned))
            if zeroing:
                zeroed += (b for b in (returned if i in skip_zeroing else row_tail(row, held))
                           if b)
        return self.create_kv_cache_blocks(tuple(out)), zeroed
