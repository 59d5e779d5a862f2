"""Which decode calls ``kvfunc.vllm``'s manager owes, and when a call pays what is owed.

The manager answers some decode calls at once and makes their transitions
later, together (``ManagerBase._pay_owed``): a call that only caches the
blocks it fills (:meth:`Owing._owe`), one that only takes blocks, promised
from the free queue (:meth:`Owing._owe_take`), and one that only lets a
window's cached blocks go (:meth:`Owing._owe_slide`).  Before any other call,
:meth:`Owing._settle_owed` decides whether the call merges what its request
owes, comes before the owed calls, or pays them first.  The rules and why
they keep every answer vLLM's are in ``docs/how-to/vllm.md``, "Calls owed to
the cache".
"""

from __future__ import annotations

from typing import Any

import kvfunc as kf
from kvfunc.core._fold import CACHING, SLIDES, lane_plan
from kvfunc.core._pool import next_free, slid_blocks
from kvfunc.vllm._base import ManagerBase

__all__ = ["Owing"]

_new = tuple.__new__
#: The digests of a call that caches nothing: no keys, none known, from position 0.
NONE: tuple[Any, int, int] = ((), 0, 0)


class Owing(ManagerBase):
    """The owing decisions of the manager (see the module docstring)."""

    def _owe(self, request: Any, computed: int, new: int, lookahead: int,
             hashes: kf.BlockHashes) -> None:
        """Owe a call whose only work is caching the blocks it fills, with the hashes its
        step would cache with (``RequestHashes.for_step``; see :meth:`_pay_owed`)."""
        keys, n, first = self._digests(request, hashes)
        if not self._owed_keys.isdisjoint(keys):  # an owed call caches one of them too
            self._pay_owed()
        self._note(request, computed, new, lookahead, hashes, (keys, n, first), None)

    def _owe_take(self, request: Any, state: kf.KVState, work: int, computed: int, new: int,
                  lookahead: int, hashes: kf.BlockHashes | None) -> Any:
        """Owe a decode call whose work is taking blocks (and caching what fills): the
        ``KVCacheBlocks`` of the blocks it will take, or None (nothing owed) when it does more,
        does not fit, or its caching meets an owed call's (see :meth:`_pay_owed`).

        The blocks are the free queue's next ones past those already promised: the owed
        calls are made in the order they came, so each pops exactly what was promised.
        """
        rid = request.request_id
        plan = lane_plan(state.groups, rid, computed, computed + new + lookahead)
        if plan is None:  # no window lets a block go here (``work`` has no SLIDES)
            return None
        needs = [need for need, _ in plan]
        n = sum(needs)
        if not n:
            return None
        # the manager's one pool (``layout="shared"``); None: fewer blocks free past those
        # promised, or a store not at hand
        ids = next_free(state.pools[0], self._cursor, n)
        if ids is None:
            return None
        mine = self._owed.get(rid)
        if mine is not None:  # what it owes merges into the take, or nothing is owed here
            if not self._merges(request, mine, computed):
                return None
            self._forgive(rid)
            if hashes is None:
                hashes = self._hashes.of(request)
        elif work & CACHING and self._meets(request, computed):
            return None  # its caching is ordered against the owed call's: pay first
        digests = (self._digests(request, hashes)  # (disjoint from the other owed calls')
                   if hashes is not None and (work & CACHING or mine is not None) else NONE)
        tables, at = [], 0
        for need in needs:
            tables.append(ids[at:at + need])
            at += need
        self._note(request, computed, new, lookahead, hashes, digests, tables)
        self._takes += n
        self._cursor = ids[-1]
        return self._blocks_type(tuple(map(self._handles.blocks, tables)))

    def _owe_slide(self, request: Any, state: kf.KVState, work: int, computed: int, new: int,
                   lookahead: int, hashes: kf.BlockHashes | None) -> bool:
        """Owe a decode call whose work is letting a window's cached blocks go (and caching
        what fills): True when owed, False when it does more (takes a block, lets go a block
        that caches nothing), the request owes a call already, priorities order the free
        queue, or its caching meets an owed call's.

        The blocks it lets go join the back of the free queue, behind every block promised,
        so the owed takes still pop theirs; those it frees count free at once
        (``num_free_blocks``): a block whose other holders owed slides before it let go.
        Nothing else comes before an owed slide (:meth:`_ahead_of_takes`): the order in
        which blocks join the back is the order they are evicted in.
        """
        rid = request.request_id
        if rid in self._owed or state.pools[0].queue.levels:
            return False
        plan = lane_plan(state.groups, rid, computed, computed + new + lookahead)
        if plan is None or any(need or front for need, front in plan):
            return False
        digests = self._digests(request, hashes) if hashes is not None and work & CACHING else NONE
        if not self._owed_keys.isdisjoint(digests[0]):
            return False  # its caching is ordered against the owed call's: pay first
        blocks = slid_blocks(state, rid, computed)
        if blocks is None:
            return False
        self._note(request, computed, new, lookahead, hashes, digests, ())  # a slide: ``()``
        self._slides += 1
        letgo = self._letgo
        for b, holders in blocks:  # the holders it leaves, after the owed slides before it
            n = letgo.get(b, 0)
            self._freed += holders - n == 1
            letgo[b] = n + 1
        return True

    def _digests(self, request: Any, hashes: kf.BlockHashes) -> tuple[Any, int, int]:
        """``(keys, known, first)``: the digests a step of ``request`` with ``hashes`` may
        cache (positions ``first`` to ``known``, its first uncached one to the hashes' end),
        and no more: a later transition of the request caches past them only with digests
        after them."""
        known = hashes.num_blocks
        first = self._first_uncached(request.request_id, known)
        return request.block_hashes[first:known], known, first

    def _note(self, request: Any, computed: int, new: int, lookahead: int,
              hashes: kf.BlockHashes | None, digests: tuple[Any, int, int], tables: Any
              ) -> None:
        """Owe the call: its entry (hashes only when it has digests to cache), its digests
        (:meth:`_digests`) and what it takes (a take's tables, ``()`` for a slide, None)."""
        keys, known, first = digests
        rid = request.request_id
        self._owed[rid] = (_new(kf.SlotRequest, (rid, computed, new, lookahead, 0, None,
                                                 hashes if keys else None, None)),
                           keys, known, first, tables)
        self._owed_keys.update(keys)

    def _first_uncached(self, rid: Any, limit: int) -> int:
        """The first position, at most ``limit``, that some group of ``rid`` has not cached
        (or nulled); 0 without rows.  A transition of ``rid`` caches no digest before it,
        except a block it copies on write, which it caches again: that is a block of tokens
        it writes, so a caller whose step may copy passes ``computed // block_size``."""
        first = limit
        for g in self._value.groups:
            row = g.rows.get(rid)
            if row is None:
                return 0
            first = min(first, row[2] if row[2] > row[1] else row[1])
        return first

    def _settle_owed(self, request: Any, work: int, computed: int, total: int) -> bool:
        """Before a step of ``request`` from ``computed`` tokens (``work``: what its rows
        say is left to do), with something owed: True when the step caches what the request
        owes itself (call :meth:`_forgive` once it is accepted); else every owed call is
        paid first if takes or slides are owed and the step may not come before them
        (:meth:`_ahead_of_takes`, ``total``: its tokens with the lookahead), if the request
        owes one, or if the step could cache a digest owed.

        A step merges unless a window lets a block go (it could be an owed one), it writes
        below the owed blocks (a block copied on write is cached again), or a digest after
        the owed ones is owed by another call.
        """
        if self._owes_blocks and not self._ahead_of_takes(request, computed, total):
            self._pay_owed()
            return False
        mine = self._owed.get(request.request_id)
        if mine is not None and not work & SLIDES and self._merges(request, mine, computed):
            return True
        if mine is not None or (work & CACHING and self._meets(request, computed)):
            self._pay_owed()
        return False

    def _meets(self, request: Any, computed: int) -> bool:
        """Whether a step of ``request`` from ``computed`` tokens could cache a digest an owed
        call caches: its digests from its first uncached block (its computed blocks', when
        it may copy on write) against the owed ones."""
        first = self._first_uncached(request.request_id, computed // self._layout.block_size)
        return bool(self._owed_keys) and not self._owed_keys.isdisjoint(
            request.block_hashes[first:])

    def _ahead_of_takes(self, request: Any, computed: int, total: int) -> bool:
        """Whether a step of ``request`` may come before the owed takes it follows: it takes
        no block and every block it lets go joins the back of the free queue, behind the
        blocks promised, so every owed take still pops its own; nothing comes before an owed
        slide (the order blocks join the back is their eviction order).  (A request that owes
        a take or a slide itself pays it first all the same: :meth:`_merges` merges
        neither.)"""
        if self._slides or self._value.pools[0].queue.levels:
            return False  # behind an owed slide's block, or a priority's segment
        plan = lane_plan(self._value.groups, request.request_id, computed, total)
        return plan is not None and not any(need or front for need, front in plan)

    def _merges(self, request: Any, mine: tuple[Any, ...], computed: int) -> bool:
        """Whether a step of ``request`` from ``computed`` tokens may cache what the request
        owes (``mine``, not a take) in its own transition: it writes nothing below the owed
        blocks (a block copied on write is cached again), and no digest after them is owed
        by another call."""
        return (mine[4] is None and computed // self._layout.block_size >= mine[3]
                and self._owed_keys.isdisjoint(request.block_hashes[mine[2]:]))

    def _forgive(self, rid: Any) -> None:
        """``rid``'s owed call is done (its own transition cached what it owed)."""
        keys = self._owed.pop(rid)[1]
        self._owed_keys.difference_update(keys)
