"""The shared layout's plan: one pool for every group (:func:`kvfunc.calculate_shared_block_num`).

With ``layout="shared"`` every group draws from one pool whose block is a
page of every layer slot (see :func:`kvfunc.shared_page_layout`): the
pool's blocks are what the budget divided by the page gives, and each group
may use any of them, so a window or a recurrent state takes what it needs
and full attention the rest.  A group whose layers take less than the page
leaves the difference of each block it holds unused (``padding``).
"""

from __future__ import annotations

from typing import Any

import attrs

from kvfunc.core import (
    SharedPoolSizing,
    SizingConfig,
    calculate_shared_block_num,
)

__all__ = ["SharedGroupPlan", "SharedPlan", "blocks_per_request", "plan_shared"]


def blocks_per_request(attn_type: str, block_size: int, window: int | None, next_n: int,
                       length: int) -> int:
    """Blocks one request of ``length`` tokens holds at its peak in one group.

    >>> blocks_per_request("SlidingWindow", 16, 128, 0, 8192), blocks_per_request("Mamba", 1,
    ...                    None, 1, 8192)
    (9, 2)
    """
    if attn_type == "Mamba":
        return 1 + next_n
    # A decode step with MTP may write 2 * next_n tokens past the request.
    full = -(-(length + 2 * next_n) // block_size)
    if attn_type == "SlidingWindow" and window is not None:
        return min(full, -(-(window + 2 * next_n) // block_size) + 1)
    return full


@attrs.frozen
class SharedGroupPlan:
    """One group of the shared pool (a row of the shared table).

    ``tokens`` is what the pool's usable blocks hold if this group alone
    held them all (None for recurrent states); ``page_share`` the part of a
    page one block of the group uses.
    """

    manager_key: str
    attn_type: str
    block_size: int
    num_layers: int
    block_bytes: int
    padding_bytes: int
    tokens: int | None
    blocks_per_request: int

    @property
    def page_share(self) -> float:
        """``block_bytes / page``: 1.0 when the group fills the page."""
        page = self.block_bytes + self.padding_bytes
        return self.block_bytes / page if page else 0.0


@attrs.frozen
class SharedPlan:
    """The shared layout for a budget: one pool, its page, and every group's row."""

    num_blocks: int
    page_bytes: int
    num_slots: int
    groups: tuple[SharedGroupPlan, ...]

    @property
    def total_bytes(self) -> int:
        """Device bytes of the pool, the null block included."""
        return self.num_blocks * self.page_bytes

    @property
    def max_concurrency(self) -> int:
        """Requests that fit at once: usable blocks over one request's blocks in every group."""
        need = sum(g.blocks_per_request for g in self.groups)
        return (self.num_blocks - 1) // need if need else 0

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json`` (sizes in bytes)."""
        return {"num_blocks": self.num_blocks, "usable_blocks": self.num_blocks - 1,
                "page_bytes": self.page_bytes, "num_slots": self.num_slots,
                "total_bytes": self.total_bytes, "max_concurrency": self.max_concurrency,
                "groups": [attrs.asdict(g) for g in self.groups]}


def plan_shared(cache_info: Any, sizing: SizingConfig, *, memory_bytes: int, used_bytes: int,
                extra_reserved_bytes: int, max_len: int, offline_max_len: int | None
                ) -> SharedPlan:
    """Size one pool shared by every group of ``cache_info`` and describe each group.

    Raises:
        MemoryError, ValueError: as :func:`kvfunc.calculate_shared_block_num`.

    >>> from kvfunc.cli._presets import build_preset
    >>> plan = plan_shared(build_preset("gpt-oss-120b").cache_info,
    ...                    SizingConfig(64, 0.9, 8192), memory_bytes=80 * 2**30, used_bytes=0,
    ...                    extra_reserved_bytes=0, max_len=8192, offline_max_len=None)
    >>> plan.page_bytes, [(g.manager_key, g.padding_bytes) for g in plan.groups]
    (589824, [('SlidingWindow', 0), ('FullAttention', 0)])
    """
    pool: SharedPoolSizing = calculate_shared_block_num(
        sizing, cache_info, free_memory_bytes=memory_bytes - used_bytes,
        total_memory_bytes=memory_bytes, offline_max_len=offline_max_len,
        extra_reserved_memory_bytes=extra_reserved_bytes)
    layout = pool.layout
    windows: dict[str, int | None] = {}
    for _, cache in cache_info.iter_caches():
        windows.setdefault(cache.group_key, cache.sliding_window)
    rows = tuple(SharedGroupPlan(
        g.manager_key, g.attn_type, g.block_size, g.num_layers, g.block_bytes,
        layout.padding(g.manager_key),
        None if g.attn_type == "Mamba" else pool.tokens(g.manager_key),
        blocks_per_request(g.attn_type, g.block_size, windows.get(g.manager_key),
                           sizing.next_n, max_len)) for g in layout.groups)
    return SharedPlan(pool.num_blocks, layout.page_bytes, len(layout.slot_bytes), rows)
