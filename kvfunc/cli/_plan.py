"""Capacity planning: how many blocks each manager key gets from a memory budget.

What the budget means (the seed's online sizing, spec §5.5)::

    cache budget = memory x mem_fraction - used - extra_reserved
                   \\_ device total     \\_ already in use when the cache is sized:
                                          model weights, activations, other processes

Model weights are *not* counted unless passed as ``used`` (``--used-memory``).
Fixed-block groups (sliding window, recurrent state) are sized by the batch
(``concurrency``) and taken from the budget first; paged groups
(full attention) share what is left, one token of every paged cache at a
time.  Offline mode (``offline_max_len``) sizes paged groups for that
length instead and only checks that they fit.

Every figure comes from :func:`kvfunc.calculate_block_num`; this module adds
bytes, token capacity and the concurrency a length allows.  A plan also holds
the shared layout (one pool for every group, :mod:`kvfunc.cli._plan_shared`,
sized by :func:`kvfunc.calculate_shared_block_num`), printed after the
per-type table by :func:`render_shared_plan`.
"""

from __future__ import annotations

from typing import Any

import attrs
from rich.console import Console
from rich.table import Table

from kvfunc.cli._errors import CLIError
from kvfunc.cli._inputs import show
from kvfunc.cli._plan_shared import SharedPlan, blocks_per_request, plan_shared
from kvfunc.cli._presets import MAX_MODEL_LEN, ModelPreset
from kvfunc.cli._units import MAX_BYTES, format_bytes
from kvfunc.core import (
    CacheAllocator,
    CacheEntry,
    MambaCacheEntry,
    SizingConfig,
    calculate_block_num,
    calculate_fixed_block_memory_bytes,
    calculate_shared_block_num,
    dtype_itemsize,
    shared_page_layout,
)

__all__ = ["MAX_CONCURRENCY", "Budget", "GroupPlan", "PlanConfig", "PlanReport",
           "entry_block_bytes", "plan_model", "render_shared_plan", "size_blocks",
           "size_shared_blocks"]

#: The most requests a plan or a simulation may run at once (``--concurrency``).
MAX_CONCURRENCY = 2**20


@attrs.frozen
class Budget:
    """A device memory budget (see the module docstring).

    >>> Budget(64 * 2**30, 0.9, used_bytes=16 * 2**30).cache_budget_bytes / 2**30
    41.6
    """

    memory_bytes: int
    mem_fraction: float = 0.9
    used_bytes: int = 0
    extra_reserved_bytes: int = 0

    def __attrs_post_init__(self) -> None:
        sizes = (("--memory", self.memory_bytes), ("--used-memory", self.used_bytes),
                 ("--extra-reserved", self.extra_reserved_bytes))
        for name, size in sizes:
            if type(size) is not int or size > MAX_BYTES:
                raise CLIError(f"{name} must be a whole number of bytes up to 1 EiB, got "
                               f"{size!r}")
        if self.memory_bytes <= 0:
            raise CLIError(f"--memory must be positive, got {self.memory_bytes} bytes")
        if not (isinstance(self.mem_fraction, int | float) and 0 < self.mem_fraction <= 1):
            raise CLIError(f"--mem-fraction must lie in (0, 1], got {self.mem_fraction}")
        if not 0 <= self.used_bytes <= self.memory_bytes:
            msg = (f"--used-memory ({format_bytes(self.used_bytes)}) must lie between 0 and "
                   f"--memory ({format_bytes(self.memory_bytes)})")
            raise CLIError(msg)
        if self.extra_reserved_bytes < 0:
            raise CLIError("--extra-reserved must not be negative")

    @property
    def cache_budget_bytes(self) -> float:
        """``memory x mem_fraction - used - extra_reserved`` (what caches may take)."""
        return (self.memory_bytes * self.mem_fraction - self.used_bytes
                - self.extra_reserved_bytes)


@attrs.frozen
class PlanConfig:
    """The engine settings a plan is made for.

    Attributes:
        budget: device memory and what of it the cache may take.
        concurrency: the most requests running at once (``batch_size_per_dp_rank``).
        max_prefill_tokens: the longest prefill the cache must hold.
        max_len: the request length (prompt + output) the concurrency column is for.
        offline_max_len: size paged groups for this fixed length instead of the budget.
    """

    budget: Budget
    concurrency: int = 64
    max_prefill_tokens: int = 8192
    max_len: int = 8192
    offline_max_len: int | None = None

    def __attrs_post_init__(self) -> None:
        checks = (("--concurrency", self.concurrency, 1, MAX_CONCURRENCY),
                  ("--max-len", self.max_len, 1, MAX_MODEL_LEN),
                  ("--offline-max-len", self.offline_max_len, 1, MAX_MODEL_LEN),
                  ("--max-prefill-tokens", self.max_prefill_tokens, 0, MAX_MODEL_LEN))
        for name, value, least, most in checks:
            if value is None and name == "--offline-max-len":
                continue
            if type(value) is not int or not least <= value <= most:
                raise CLIError(f"{name} must be an integer from {least} to {most:,}, got "
                               f"{show(value)}")


@attrs.frozen
class GroupPlan:
    """One manager key's share of the budget (a row of the plan table)."""

    manager_key: str
    attn_type: str
    sizing: str  # "paged" (from the budget) or "fixed" (from the batch)
    block_size: int
    num_blocks: int  # the pool, null block included (what calculate_block_num returns)
    tokens: int | None  # token slots, the null block excluded; None for recurrent states
    block_bytes: int
    bytes: int
    blocks_per_request: int
    max_concurrency: int


@attrs.frozen
class PlanReport:
    """A whole plan: one :class:`GroupPlan` per manager key, in manager order (the per-type
    layout), and the shared layout's pool (``shared``, or why it does not fit: ``shared_error``).
    """

    model: ModelPreset
    config: PlanConfig
    groups: tuple[GroupPlan, ...]
    shared: SharedPlan | None = None
    shared_error: str | None = None

    @property
    def total_bytes(self) -> int:
        """Bytes of every cache, null blocks included."""
        return sum(g.bytes for g in self.groups)

    @property
    def max_concurrency(self) -> int:
        """Requests of ``max_len`` tokens the scarcest group can hold at once."""
        return min(g.max_concurrency for g in self.groups)

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json`` (sizes in bytes)."""
        budget = self.config.budget
        return {
            "model": {"name": self.model.name, "title": self.model.title,
                      "sources": list(self.model.sources), "notes": list(self.model.notes),
                      "num_layers": self.model.cache_info.num_layers,
                      "max_model_len": self.model.max_model_len, "mtp_depth": self.model.next_n},
            "budget": {"memory_bytes": budget.memory_bytes, "mem_fraction": budget.mem_fraction,
                       "used_bytes": budget.used_bytes,
                       "extra_reserved_bytes": budget.extra_reserved_bytes,
                       "cache_budget_bytes": int(budget.cache_budget_bytes)},
            "concurrency": self.config.concurrency,
            "max_prefill_tokens": self.config.max_prefill_tokens,
            "max_len": self.config.max_len,
            "offline_max_len": self.config.offline_max_len,
            "groups": [{**attrs.asdict(g), "usable_blocks": g.num_blocks - 1}
                       for g in self.groups],
            "total_bytes": self.total_bytes,
            "max_concurrency": self.max_concurrency,
            "shared": (self.shared.to_json() if self.shared is not None
                       else {"error": self.shared_error}),
        }


def entry_block_bytes(cache: CacheEntry) -> int:
    """Bytes one block of ``cache`` takes in one layer (what sizing charges)."""
    if CacheAllocator(cache.allocator) is not CacheAllocator.HBM:
        return 0
    itemsize = dtype_itemsize(cache.dtype)
    if isinstance(cache, MambaCacheEntry):
        return cache.cache_dim_numel() * itemsize
    assert cache.block_size is not None and cache.num_head is not None  # validated
    token_bytes = cache.cache_dim_numel() * cache.num_head * itemsize
    if cache.attn_type == "SlidingWindow":
        return cache.block_size * token_bytes  # windows are sized uncompressed
    return cache.block_size * (token_bytes // cache.compress_ratio)


def _budget_line(budget: Budget) -> str:
    return (f"the cache budget is {format_bytes(max(0.0, budget.cache_budget_bytes))} "
            f"({format_bytes(budget.memory_bytes)} x {budget.mem_fraction:g} - "
            f"{format_bytes(budget.used_bytes)} used - "
            f"{format_bytes(budget.extra_reserved_bytes)} reserved)")


def _explain_shortage(model: ModelPreset, config: PlanConfig, sizing: SizingConfig,
                      reason: str) -> str:
    """One line: why the budget is too small, in the command's terms, and what to change."""
    budget = config.budget
    have = _budget_line(budget)
    _, fixed = calculate_fixed_block_memory_bytes(sizing, model.cache_info)
    if config.offline_max_len:
        why = f"offline sizing for {config.offline_max_len:,}-token requests does not fit"
        fix = "lower --offline-max-len or --concurrency, or raise --memory"
    elif fixed >= budget.cache_budget_bytes:
        why = (f"{model.name}'s window and state caches alone take {format_bytes(fixed)} at "
               f"--concurrency {config.concurrency}")
        fix = "raise --memory or --mem-fraction, or lower --concurrency or --used-memory"
    elif "max input length" in reason:
        left = (f"what is left after {format_bytes(fixed)} of window and state caches"
                if fixed else "it")
        why = (f"{left} holds fewer than --max-prefill-tokens {config.max_prefill_tokens:,} "
               "tokens")
        fix = "raise --memory or --mem-fraction, or lower --max-prefill-tokens"
    else:
        why = reason
        fix = "raise --memory or --mem-fraction"
    return f"{have}; {why}: {fix}"


def _sizing_config(model: ModelPreset, config: PlanConfig) -> SizingConfig:
    return SizingConfig(batch_size_per_dp_rank=config.concurrency,
                        mem_fraction_static=float(config.budget.mem_fraction),
                        max_prefill_tokens=config.max_prefill_tokens, next_n=model.next_n)


def size_blocks(model: ModelPreset, config: PlanConfig) -> dict[str, int]:
    """``{manager_key: num_blocks}`` from :func:`kvfunc.calculate_block_num`.

    Raises:
        CLIError: the budget cannot hold the caches (with what to change).

    >>> from kvfunc.cli._presets import build_preset
    >>> size_blocks(build_preset("llama-3-8b"), PlanConfig(Budget(64 * 2**30)))
    {'FullAttention': 29491}
    """
    budget = config.budget
    sizing = _sizing_config(model, config)
    try:
        blocks = calculate_block_num(
            sizing, model.cache_info, free_memory_bytes=budget.memory_bytes - budget.used_bytes,
            total_memory_bytes=budget.memory_bytes, offline_max_len=config.offline_max_len,
            extra_reserved_memory_bytes=budget.extra_reserved_bytes)
        # The sizing checks the window and state caches only on its way to the paged
        # groups: a model without paged groups needs the check here.
        _, fixed = calculate_fixed_block_memory_bytes(sizing, model.cache_info)
    except MemoryError as exc:
        raise CLIError(_explain_shortage(model, config, sizing, str(exc))) from None
    except ValueError as exc:
        raise CLIError(f"cannot size {model.name}: {exc}") from None
    if fixed > budget.cache_budget_bytes:
        raise CLIError(_explain_shortage(model, config, sizing, "state caches do not fit"))
    return blocks


def size_shared_blocks(model: ModelPreset, config: PlanConfig) -> int:
    """Blocks of one pool shared by every group, from :func:`kvfunc.calculate_shared_block_num`.

    What ``--layout shared`` runs on; every group states this count.

    Raises:
        CLIError: the budget cannot hold the pool (with what to change).

    >>> from kvfunc.cli._presets import build_preset
    >>> size_shared_blocks(build_preset("gpt-oss-120b"), PlanConfig(Budget(24 * 2**30)))
    39321
    """
    budget = config.budget
    try:
        pool = calculate_shared_block_num(
            _sizing_config(model, config), model.cache_info,
            free_memory_bytes=budget.memory_bytes - budget.used_bytes,
            total_memory_bytes=budget.memory_bytes, offline_max_len=config.offline_max_len,
            extra_reserved_memory_bytes=budget.extra_reserved_bytes)
    except MemoryError as exc:
        msg = (f"{_budget_line(budget)}; the shared pool does not fit it: {exc}"
               f"{_padding_hint(model)}: raise --memory or --mem-fraction, lower "
               "--concurrency or --max-batched-tokens, or try --layout per-type")
        raise CLIError(msg) from None
    except ValueError as exc:
        raise CLIError(f"cannot size {model.name}'s shared pool: {exc}") from None
    return pool.num_blocks


def plan_model(model: ModelPreset, config: PlanConfig) -> PlanReport:
    """Size ``model`` for ``config`` and describe every manager key.

    >>> from kvfunc.cli._presets import build_preset
    >>> report = plan_model(build_preset("gpt-oss-120b"), PlanConfig(Budget(80 * 2**30)))
    >>> [(g.manager_key, g.sizing, g.block_size) for g in report.groups]
    [('SlidingWindow', 'fixed', 16), ('FullAttention', 'paged', 16)]
    """
    num_blocks = size_blocks(model, config)
    groups: dict[str, list[CacheEntry]] = {}
    for _, cache in model.cache_info.iter_caches():
        if cache.needs_block:
            groups.setdefault(cache.group_key, []).append(cache)
    rows = []
    for key, entries in groups.items():
        first = entries[0]
        attn_type, block_size = first.attn_type, first.block_size or 1
        blocks = num_blocks[key]
        block_bytes = sum(entry_block_bytes(e) for e in entries)
        per_request = blocks_per_request(attn_type, block_size, first.sliding_window,
                                          model.next_n, config.max_len)
        rows.append(GroupPlan(
            key, attn_type, "fixed" if attn_type in ("SlidingWindow", "Mamba") else "paged",
            block_size, blocks, None if attn_type == "Mamba" else (blocks - 1) * block_size,
            block_bytes, blocks * block_bytes, per_request, (blocks - 1) // per_request))
    shared, error = _plan_shared_layout(model, config)
    return PlanReport(model, config, tuple(rows), shared, error)


def _plan_shared_layout(model: ModelPreset, config: PlanConfig
                        ) -> tuple[SharedPlan | None, str | None]:
    """The shared layout's plan, or why it cannot be made (the per-type plan fits)."""
    budget = config.budget
    try:
        shared = plan_shared(model.cache_info, _sizing_config(model, config),
                             memory_bytes=budget.memory_bytes, used_bytes=budget.used_bytes,
                             extra_reserved_bytes=budget.extra_reserved_bytes,
                             max_len=config.max_len, offline_max_len=config.offline_max_len)
    except MemoryError as exc:
        return None, f"does not fit the budget: {exc}{_padding_hint(model)}"
    except ValueError as exc:
        return None, f"cannot be sized: {exc}"
    return shared, None


def _padding_hint(model: ModelPreset) -> str:
    """Why a shared page is large: the groups that fill little of it, and what vLLM does."""
    layout = shared_page_layout(model.cache_info)
    page = layout.page_bytes
    thin = [f"{g.manager_key} fills {g.block_bytes / page:.1%}" for g in layout.groups
            if page and g.block_bytes < page / 2]
    if not thin:
        return ""
    return (f" (a page of {format_bytes(page)}: {', '.join(thin)} of it; vLLM raises such a "
            "group's block_size to fill the page, or splits the larger group's layers into "
            "groups of equal size by manager_key)")


def render_shared_plan(report: PlanReport, console: Console) -> None:
    """Print the shared layout of a plan: the pool, its page, one row per group.

    >>> import io
    >>> from kvfunc.cli._presets import build_preset
    >>> out = Console(file=io.StringIO(), width=120)
    >>> render_shared_plan(plan_model(build_preset("gpt-oss-120b"),
    ...                               PlanConfig(Budget(80 * 2**30))), out)
    >>> "131,071 usable blocks of 576.00 KiB (18 layer slots)" in out.file.getvalue()
    True
    """
    shared, cfg = report.shared, report.config
    console.print()
    console.print("[bold]shared layout[/bold]: one pool for every group, block ids unique "
                  "across groups (vLLM's hybrid layout); the table above is the per-type "
                  "layout, a pool per manager key")
    if shared is None:
        console.print(f"the shared layout {report.shared_error}", soft_wrap=True)
        return
    console.print(f"pool: {shared.num_blocks - 1:,} usable blocks of "
                  f"{format_bytes(shared.page_bytes)} ({shared.num_slots} layer slots), "
                  f"{format_bytes(shared.total_bytes)}")
    table = Table(show_edge=False)
    for header in ("manager key", "type", "block\nsize", "layers", "block\nbytes",
                   "page\nused", "tokens\nalone", "blocks/\nreq"):
        table.add_column(header, justify="left" if header in ("manager key", "type")
                         else "right")
    for g in shared.groups:
        table.add_row(g.manager_key, g.attn_type, str(g.block_size), str(g.num_layers),
                      format_bytes(g.block_bytes), f"{g.page_share:.0%}",
                      "-" if g.tokens is None else f"{g.tokens:,}", f"{g.blocks_per_request:,}")
    console.print(table)
    console.print(f"requests of {cfg.max_len:,} tokens that fit at once: "
                  f"[bold]{shared.max_concurrency:,}[/bold] (per-type: "
                  f"{report.max_concurrency:,}) (tokens alone: what the usable blocks hold if "
                  "one group held them all; page used: the part of each block a group fills)")
