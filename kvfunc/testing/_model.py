"""A deliberately simple, mutable model of the allocator, written from the spec.

Theory of operation
-------------------
:class:`NaiveAllocator` restates ``spec/reference-behaviour.md`` sections 2-4
with plain ``list``/``dict``/``collections.deque`` values and no cleverness:
one manager per key, each with a FIFO deque of free ids (the null block 0 is
removed at the start), ``req_to_blocks`` (request id -> list of block ids in
logical order), and ``allocate_slots`` following the seed's two-phase
pseudocode line by line.

It differs from the seed in exactly one place, kvfunc's deliberate
deviation: a refused (or failing) ``allocate_slots`` changes nothing.

Two options model what kvfunc adds: ``layout="shared"`` makes every manager
draw from one free deque (vLLM's hybrid layout: phase 1 sums the managers'
needs against it), and ``free_order="vllm"`` returns freed blocks to the
front of the deque (vLLM's last in, first out reuse: a request's blocks
last block first, recycled blocks highest index first).  The
seed recycles sliding-window blocks of the managers it visited before it
refuses; the model runs the seed's code on the live managers and, when the
call is refused or raises, puts back a deep copy taken before.  That is slow
and obviously correct, which is the point of a model.

Of kvfunc it uses only the policy records, to read their configuration
(and the program records of :mod:`kvfunc.testing` in :func:`apply_to_model`),
never the core's state, transitions or policy methods.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from kvfunc import FullAttention, Mamba, RequestId, SlidingWindow
from kvfunc.testing._strategies import Allocate, Batch, Free, Operation, Recycle

__all__ = ["NaiveAllocator", "apply_to_model"]

NULL = 0  # the null block id of every pool (spec §2)


def _ceil(a: int, b: int) -> int:
    # The spec's ``(a + b - 1) // b``; equal to an exact ceiling for b > 0,
    # also for negative ``a`` (which only the reservation formula can see).
    return (a + b - 1) // b


class _Pool:
    """A free deque (spec §2): FIFO, or vLLM's front re-entry."""

    def __init__(self, num_blocks: int, lifo: bool) -> None:
        self.num_blocks = num_blocks
        self.lifo = lifo
        self.free_queue: deque[int] = deque(range(num_blocks))
        self.free_queue.popleft()  # block 0 becomes the null block


class _Manager:
    """One single-type manager drawing from a block pool (spec §2 and §3)."""

    def __init__(self, key: str, policy: Any, pool: _Pool) -> None:
        if isinstance(policy, FullAttention):
            self.kind = "FullAttention"
        elif isinstance(policy, SlidingWindow):
            self.kind = "SlidingWindow"
            self.window: int = policy.sliding_window
        elif isinstance(policy, Mamba):
            self.kind = "Mamba"
            self.next_n: int = policy.next_n
        else:
            msg = f"NaiveAllocator does not model {type(policy).__name__} (group {key!r})"
            raise NotImplementedError(msg)
        self.key = key
        self.num_blocks: int = policy.num_blocks
        self.block_size: int = policy.block_size
        self.pool = pool
        self.req_to_blocks: dict[Any, list[int]] = {}

    @property
    def free_queue(self) -> deque[int]:
        return self.pool.free_queue

    # -- the block pool (spec §2) --------------------------------------------
    def get_new_blocks(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError("num_blocks must be non-negative")
        if n > len(self.free_queue):
            msg = f"requested {n} blocks, but only {len(self.free_queue)} are available"
            raise ValueError(msg)
        return [self.free_queue.popleft() for _ in range(n)]

    def free_blocks(self, ids: list[int]) -> None:
        for block_id in ids:
            if not 0 <= block_id < self.num_blocks:
                msg = f"block_id {block_id} is out of range [0, {self.num_blocks})"
                raise IndexError(msg)
            if block_id == NULL:
                continue
            if block_id in self.free_queue:
                raise ValueError(f"block_id {block_id} is already free")
        real = [b for b in ids if b != NULL]
        if self.pool.lifo:  # vLLM: the run goes to the front, its first block first
            self.free_queue.extendleft(reversed(real))
        else:
            self.free_queue.extend(real)

    # -- the single-type manager (spec §3) ------------------------------------
    def num_skipped_tokens(self, computed: int) -> int:
        if self.kind == "SlidingWindow":
            return max(0, computed - self.window + 1)
        return 0

    def swa_layout(self, n: int) -> tuple[int, int, int]:
        """``(total, first_blk, valid)`` of a sliding-window table of ``n`` tokens."""
        bs = self.block_size
        total = _ceil(n, bs)
        last_tok = n - 1
        last_blk = last_tok // bs
        first_tok = max(0, last_tok - self.window)
        first_blk = first_tok // bs
        return total, first_blk, last_blk - first_blk + 1

    def pre_allocate_blocks(self, rid: Any, n: int, reserved: int) -> tuple[int, bool]:
        if n < 0:
            raise ValueError("num_tokens must be non-negative")
        blocks = self.req_to_blocks.get(rid, [])
        free = len(self.free_queue)
        if self.kind == "FullAttention":
            need = max(0, _ceil(n, self.block_size) - len(blocks))
            # Every registered request counts, the caller and empty lists included.
            reserve = _ceil(reserved, self.block_size) * len(self.req_to_blocks)
            return need, need <= free - reserve
        if self.kind == "SlidingWindow":
            if blocks:  # decode: grow at the tail (the length counts null entries)
                need = max(0, _ceil(n, self.block_size) - len(blocks))
            else:  # prefill, also for a registered empty list
                need = self.swa_layout(n)[2]
            return need, need <= free
        target = 1 + self.next_n if blocks else 1  # Mamba ignores the token count
        need = max(0, target - len(blocks))
        return need, need <= free

    def allocate_new_blocks(self, rid: Any, n: int, num_tokens: int) -> None:
        ids = self.get_new_blocks(n)
        blocks = self.req_to_blocks.setdefault(rid, [])  # registers even when n == 0
        if self.kind == "SlidingWindow" and not blocks:
            total, first_blk, _ = self.swa_layout(num_tokens)
            blocks.extend([NULL] * first_blk)
            blocks.extend(ids)
            assert len(blocks) == total, f"SWA prefill length {len(blocks)} != {total}"
        else:
            blocks.extend(ids)

    def remove_skipped_blocks(self, rid: Any, computed: int) -> None:
        s = self.num_skipped_tokens(computed)
        if s <= 0:
            return
        blocks = self.req_to_blocks.get(rid, [])
        k = min(s // self.block_size, len(blocks))
        removed = []
        for i in range(k - 1, -1, -1):
            if blocks[i] == NULL:
                break  # everything left of a null entry is null already
            removed.append(blocks[i])
            blocks[i] = NULL
        self.free_blocks(removed)  # highest logical index first

    def free(self, rid: Any) -> None:
        blocks = self.req_to_blocks.pop(rid, [])
        if blocks:  # vLLM frees a request's blocks last block first
            self.free_blocks(blocks[::-1] if self.pool.lifo else blocks)


class NaiveAllocator:
    """The seed's ``KVCacheManager`` as plain mutable code, refusals made atomic.

    Built from the same ``{manager_key: policy}`` mapping as
    :meth:`kvfunc.KVState.create`; answers the same questions as the pure API.

    Args:
        groups: ``{manager_key: policy}`` in manager order (FullAttention,
            SlidingWindow or Mamba records).
        max_model_len: token counts are clamped to it.
        layout: ``"per-type"`` (a pool per manager) or ``"shared"`` (one pool).
        free_order: ``"seed"`` (FIFO) or ``"vllm"`` (freed blocks reused first).

    >>> import kvfunc as kf
    >>> m = NaiveAllocator({"full": kf.FullAttention(num_blocks=4, block_size=16)}, 1024)
    >>> m.allocate_slots("a", 0, 40), m.get_block_ids("a")
    (True, {'full': (1, 2, 3)})
    >>> m.allocate_slots("b", 0, 1), m.format_usage()
    (False, 'full:4/4')
    """

    def __init__(self, groups: Mapping[str, Any], max_model_len: int, *,
                 layout: str = "per-type", free_order: str = "seed") -> None:
        self.max_model_len = max_model_len
        lifo = free_order == "vllm"
        if layout == "shared":
            sizes = {p.num_blocks for p in groups.values()}
            assert len(sizes) <= 1, "a shared pool has one size"
            shared = _Pool(sizes.pop() if sizes else 1, lifo)
            self._managers = [_Manager(k, p, shared) for k, p in groups.items()]
        else:
            self._managers = [_Manager(k, p, _Pool(p.num_blocks, lifo)) for k, p in groups.items()]

    @property
    def manager_keys(self) -> tuple[str, ...]:
        """Manager keys in manager order."""
        return tuple(m.key for m in self._managers)

    def _selected(self, manager_keys: Collection[str] | None) -> list[_Manager]:
        return [m for m in self._managers if manager_keys is None or m.key in manager_keys]

    def allocate_slots(self, request_id: Any, computed_tokens: int, num_new_tokens: int,
                       lookahead_tokens: int = 0, reserved_tokens: int = 0,
                       manager_keys: Collection[str] | None = None) -> bool:
        """Spec §4 ``allocate_slots``; a refused or failing call changes nothing.

        >>> import kvfunc as kf
        >>> m = NaiveAllocator({"swa": kf.SlidingWindow(num_blocks=9, block_size=4,
        ...                                            sliding_window=8)}, 64)
        >>> m.allocate_slots("a", 0, 12), m.get_block_ids("a")
        (True, {'swa': (1, 2, 3)})
        >>> m.allocate_slots("a", 12, 1), m.get_block_ids("a")
        (True, {'swa': (0, 2, 3, 4)})
        """
        if num_new_tokens < 0:
            raise ValueError("num_new_tokens must be non-negative")
        if computed_tokens < 0:  # kvfunc's contract (the seed let it through)
            raise ValueError("computed_tokens must be non-negative")
        before = copy.deepcopy(self._managers)
        try:
            ok = self._seed_allocate_slots(request_id, computed_tokens, num_new_tokens,
                                           lookahead_tokens, reserved_tokens, manager_keys)
        except BaseException:
            self._managers = before
            raise
        if not ok:
            self._managers = before  # the seed keeps its recycling; kvfunc does not
        return ok

    def _seed_allocate_slots(self, rid: Any, computed: int, new: int, lookahead: int,
                             reserved: int, manager_keys: Collection[str] | None) -> bool:
        c = min(computed, self.max_model_len)
        t = min(computed + new + lookahead, self.max_model_len)
        selected = self._selected(manager_keys)
        needs = []
        for m in selected:  # phase 1
            m.remove_skipped_blocks(rid, c)
        wanted: dict[int, int] = {}
        for m in selected:
            need, ok = m.pre_allocate_blocks(rid, t, reserved)
            if not ok:
                return False
            needs.append(need)
            reserve = (_ceil(reserved, m.block_size) * len(m.req_to_blocks)
                       if m.kind == "FullAttention" else 0)
            wanted[id(m.pool)] = wanted.get(id(m.pool), 0) + need + reserve
        if any(n > len(m.free_queue) for m in selected for n in (wanted[id(m.pool)],)):
            return False  # a shared pool must hold every manager's need at once
        for m, need in zip(selected, needs, strict=True):  # phase 2
            m.allocate_new_blocks(rid, need, t)
        return True

    def allocate_batch(self, requests: Iterable[Sequence[Any]]) -> tuple[Any, ...]:
        """``allocate_slots`` for each request in order; the refused request ids.

        Each request is a ``SlotRequest`` (or a tuple of its first 3-6 fields).
        If one raises, the whole batch changes nothing (kvfunc's contract).

        >>> import kvfunc as kf
        >>> m = NaiveAllocator({"full": kf.FullAttention(num_blocks=4, block_size=16)}, 64)
        >>> m.allocate_batch([("a", 0, 20), ("b", 0, 40)]), m.get_block_ids("a")
        (('b',), {'full': (1, 2)})
        """
        before = copy.deepcopy(self._managers)
        refused = []
        try:
            for request in requests:
                if not self.allocate_slots(*request[:6]):
                    refused.append(request[0])
        except BaseException:
            self._managers = before
            raise
        return tuple(refused)

    def free(self, request_id: Any, manager_keys: Collection[str] | None = None) -> None:
        """Release a request's blocks to the tail of each pool; unknown ids: no-op."""
        for m in self._selected(manager_keys):
            m.free(request_id)

    def remove_skipped_blocks(self, request_id: Any, computed_tokens: int,
                              manager_keys: Collection[str] | None = None) -> None:
        """Recycle the blocks that slid out of the window (``computed`` clamped).

        >>> import kvfunc as kf
        >>> m = NaiveAllocator({"swa": kf.SlidingWindow(num_blocks=9, block_size=4,
        ...                                            sliding_window=4)}, 64)
        >>> m.allocate_slots("a", 0, 12), m.get_block_ids("a")
        (True, {'swa': (0, 1, 2)})
        >>> m.remove_skipped_blocks("a", 16)
        >>> m.get_block_ids("a"), m.free_block_ids("swa")
        ({'swa': (0, 0, 0)}, (3, 4, 5, 6, 7, 8, 2, 1))
        """
        if computed_tokens < 0:  # kvfunc's contract (the seed let it through)
            raise ValueError("computed_tokens must be non-negative")
        computed = min(computed_tokens, self.max_model_len)
        for m in self._selected(manager_keys):
            m.remove_skipped_blocks(request_id, computed)

    def get_block_ids(self, request_id: Any) -> dict[str, tuple[int, ...]]:
        """``{manager_key: block ids}`` snapshot, ``()`` for unknown requests."""
        return {m.key: tuple(m.req_to_blocks.get(request_id, ())) for m in self._managers}

    def registered_request_ids(self, manager_key: str) -> set[Any]:
        """Requests with a (possibly empty) list in ``manager_key``.

        >>> import kvfunc as kf
        >>> m = NaiveAllocator({"full": kf.FullAttention(num_blocks=4, block_size=16)}, 64)
        >>> m.allocate_slots("a", 0, 0), m.registered_request_ids("full"), m.get_block_ids("a")
        (True, {'a'}, {'full': ()})
        """
        return set(self._manager(manager_key).req_to_blocks)

    def request_ids(self) -> set[Any]:
        """Every request registered in any manager."""
        return {rid for m in self._managers for rid in m.req_to_blocks}

    def num_free_blocks(self, manager_key: str) -> int:
        """Length of the free queue of ``manager_key`` (the null block never counts)."""
        return len(self._manager(manager_key).free_queue)

    def free_block_ids(self, manager_key: str) -> tuple[int, ...]:
        """Free ids of ``manager_key`` in hand-out order (head first)."""
        return tuple(self._manager(manager_key).free_queue)

    def format_usage(self) -> str:
        """``"key:used/num_blocks,..."``; the null block counts as used.

        >>> import kvfunc as kf
        >>> NaiveAllocator({"FullAttention": kf.FullAttention(num_blocks=12, block_size=4)},
        ...                64).format_usage()
        'FullAttention:1/12'
        """
        if not self._managers:
            return "0/0"
        return ",".join(f"{m.key}:{m.num_blocks - len(m.free_queue)}/{m.num_blocks}"
                        for m in self._managers)

    def _manager(self, key: str) -> _Manager:
        for m in self._managers:
            if m.key == key:
                return m
        raise KeyError(key)


def apply_to_model(model: NaiveAllocator, op: Operation) -> tuple[RequestId, ...]:
    """Run one program operation on the model; the refused request ids.

    >>> import kvfunc as kf
    >>> from kvfunc.testing import Allocate
    >>> m = NaiveAllocator({"f": kf.FullAttention(num_blocks=3, block_size=4)}, 64)
    >>> apply_to_model(m, Allocate(kf.SlotRequest("a", 0, 9)))
    ('a',)
    """
    if isinstance(op, Allocate):
        return () if model.allocate_slots(*op.request[:6]) else (op.request.request_id,)
    if isinstance(op, Batch):
        return model.allocate_batch(op.requests)
    if isinstance(op, Free):
        model.free(op.request_id, op.manager_keys)
    elif isinstance(op, Recycle):
        model.remove_skipped_blocks(op.request_id, op.computed_tokens, op.manager_keys)
    else:
        raise TypeError(f"not a program operation: {op!r}")
    return ()
