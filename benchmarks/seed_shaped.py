"""A mutable allocator shaped like the seed's module: the baseline of bench_core's compat target.

Theory of operation
-------------------
The compat target compares ``kvfunc.compat.KVCacheManager`` with the system
it replaces.  That system is not a dependency, so this module rebuilds its
allocation path from the behavioural specification (``spec/reference-
behaviour.md`` sections 2-4), keeping its shape, which is what its cost comes
from: three layers of objects (a manager over single-type managers over one
block pool each), a ``deque`` plus ``set`` free queue, a two-phase
``allocate_slots`` that calls ``remove_skipped_blocks`` and
``pre_allocate_blocks`` on every manager, then ``allocate_new_blocks`` on
every manager (even for zero blocks).

It leaves out what the seed does besides allocating (its log lines and the
metadata it keeps), so it is a lower bound on the seed's cost: a ratio to it
is pessimistic for kvfunc.  Only the happy path a trace replay takes is here
(no argument checks beyond the seed's own), and only full attention and
sliding windows.  bench_core cross-checks its block tables and free queues
against every other path after each run.

>>> m = KVCacheManager(64, [Manager(8, 4), SlidingWindowManager(8, 4, 4)])
>>> m.allocate_slots("a", 0, 9), m.get_block_ids("a")
(True, [[1, 2, 3], [0, 1, 2]])
>>> m.allocate_slots("a", 12, 1), m.get_block_ids("a")
(True, [[1, 2, 3, 4], [0, 0, 2, 3]])
>>> m.single_type_managers[1].block_pool._free_block_queue
deque([4, 5, 6, 7, 1])
"""

from __future__ import annotations

from collections import deque

__all__ = ["BlockPool", "KVCacheManager", "Manager", "SlidingWindowManager"]


class BlockPool:
    """Ids ``1 .. num_blocks - 1`` handed out FIFO, freed to the tail; 0 is the null block."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self._free_block_queue = deque(range(num_blocks))
        self._free_block_set = set(range(num_blocks))
        self._null_block = self._free_block_queue.popleft()
        self._free_block_set.discard(self._null_block)

    def get_num_free_blocks(self) -> int:
        """Free blocks, the null block not counted."""
        return len(self._free_block_queue)

    def get_new_blocks(self, n: int) -> list[int]:
        """Pop ``n`` ids from the head."""
        if n < 0:
            raise ValueError("num_blocks must be non-negative")
        if n > len(self._free_block_queue):
            raise ValueError(f"requested {n} blocks, but only "
                             f"{len(self._free_block_queue)} are available")
        out = []
        for _ in range(n):
            block = self._free_block_queue.popleft()
            self._free_block_set.discard(block)
            out.append(block)
        return out

    def free_blocks(self, blocks: list[int]) -> None:
        """Append ids to the tail in order; the null id is skipped."""
        for block in blocks:
            if not 0 <= block < self.num_blocks:
                raise IndexError(f"block_id {block} is out of range [0, {self.num_blocks})")
            if block == self._null_block:
                continue
            if block in self._free_block_set:
                raise ValueError(f"block_id {block} is already free")
            self._free_block_queue.append(block)
            self._free_block_set.add(block)


class Manager:
    """One attention type's manager: full attention (nothing is ever skipped)."""

    def __init__(self, num_blocks: int, block_size: int, manager_key: str = "FullAttention"
                 ) -> None:
        self.manager_key = manager_key
        self.block_pool = BlockPool(num_blocks)
        self.block_size = block_size
        self._null_block = self.block_pool._null_block
        self.req_to_blocks: dict[object, list[int]] = {}

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens no longer attended to."""
        return 0

    def remove_skipped_blocks(self, request_id: object, total_computed_tokens: int) -> None:
        """Null the whole blocks of the skipped tokens, free them highest index first."""
        skipped = self.get_num_skipped_tokens(total_computed_tokens)
        if skipped <= 0:
            return
        blocks = self.req_to_blocks.get(request_id, [])
        removed = []
        for i in range(min(skipped // self.block_size, len(blocks)) - 1, -1, -1):
            if blocks[i] == self._null_block:
                break
            removed.append(blocks[i])
            blocks[i] = self._null_block
        self.block_pool.free_blocks(removed)

    def pre_allocate_blocks(self, request_id: object, num_tokens: int,
                            reserved_tokens: int = 0) -> tuple[int, bool]:
        """``(blocks needed, whether the pool has them beyond the reservation)``."""
        if num_tokens < 0:
            raise ValueError("num_tokens must be non-negative")
        required = (num_tokens + self.block_size - 1) // self.block_size
        need = max(0, required - len(self.req_to_blocks.get(request_id, [])))
        reserve = ((reserved_tokens + self.block_size - 1) // self.block_size
                   * len(self.req_to_blocks))
        return need, need <= self.block_pool.get_num_free_blocks() - reserve

    def allocate_new_blocks(self, request_id: object, n: int, num_tokens: int) -> None:
        """Take ``n`` ids and append them (registering the request even for 0)."""
        blocks = self.block_pool.get_new_blocks(n)
        self.req_to_blocks.setdefault(request_id, []).extend(blocks)

    def free(self, request_id: object) -> None:
        """Return the request's blocks in logical order."""
        blocks = self.req_to_blocks.pop(request_id, [])
        if blocks:
            self.block_pool.free_blocks(blocks)


class SlidingWindowManager(Manager):
    """A window of ``sliding_window`` tokens: a prefill starts with null entries."""

    def __init__(self, num_blocks: int, block_size: int, sliding_window: int,
                 manager_key: str = "SlidingWindow") -> None:
        super().__init__(num_blocks, block_size, manager_key)
        self.sliding_window = sliding_window

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens left of the window."""
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def _get_logical_block_layout(self, num_tokens: int) -> tuple[int, int, int]:
        total = (num_tokens + self.block_size - 1) // self.block_size
        last = num_tokens - 1
        first = max(0, last - self.sliding_window) // self.block_size
        return total, first, last // self.block_size - first + 1

    def pre_allocate_blocks(self, request_id: object, num_tokens: int,
                            reserved_tokens: int = 0) -> tuple[int, bool]:
        """Growth of a running request, else the blocks of a prefill's window."""
        if num_tokens < 0:
            raise ValueError("num_tokens must be non-negative")
        blocks = self.req_to_blocks.get(request_id, [])
        if blocks:
            need = max(0, (num_tokens + self.block_size - 1) // self.block_size - len(blocks))
        else:
            need = self._get_logical_block_layout(num_tokens)[2]
        return need, need <= self.block_pool.get_num_free_blocks()

    def allocate_new_blocks(self, request_id: object, n: int, num_tokens: int) -> None:
        """A prefill gets its null head first; a running request appends."""
        new = self.block_pool.get_new_blocks(n)
        blocks = self.req_to_blocks.setdefault(request_id, [])
        if blocks:
            blocks.extend(new)
            return
        total, first, _ = self._get_logical_block_layout(num_tokens)
        blocks.extend([self._null_block] * first)
        blocks.extend(new)
        if len(blocks) != total:
            raise ValueError("Sliding-window block table length mismatch after prefill "
                             f"allocation: got={len(blocks)}, expected={total}")


class KVCacheManager:
    """The request-level coordinator: a two-phase ``allocate_slots`` over every manager."""

    def __init__(self, max_model_len: int, single_type_managers: list[Manager]) -> None:
        self.max_model_len = max_model_len
        self.single_type_managers = tuple(single_type_managers)

    def allocate_slots(self, request_id: object, computed_tokens: int, num_new_tokens: int,
                       lookahead_tokens: int = 0, reserved_tokens: int = 0,
                       manager_keys: object = None) -> bool:
        """Recycle and check every manager, then allocate in every manager; False changes
        no allocation."""
        if num_new_tokens < 0:
            raise ValueError("num_new_tokens must be non-negative")
        total_computed = min(computed_tokens, self.max_model_len)
        num_tokens = min(computed_tokens + num_new_tokens + lookahead_tokens,
                         self.max_model_len)
        selected = [m for m in self.single_type_managers
                    if manager_keys is None or m.manager_key in manager_keys]  # type: ignore[operator]
        needs = []
        for manager in selected:
            manager.remove_skipped_blocks(request_id, total_computed)
            need, ok = manager.pre_allocate_blocks(request_id, num_tokens, reserved_tokens)
            if not ok:
                return False
            needs.append(need)
        for manager, need in zip(selected, needs, strict=True):
            manager.allocate_new_blocks(request_id, need, num_tokens)
        return True

    def get_block_ids(self, request_id: object) -> list[list[int]]:
        """The request's block list in every manager (live lists)."""
        return [m.req_to_blocks.get(request_id, []) for m in self.single_type_managers]

    def free(self, request_id: object) -> None:
        """Free the request in every manager."""
        for manager in self.single_type_managers:
            manager.free(request_id)
