"""The pool layout a simulation runs on, and block usage counted per pool.

Theory of operation
-------------------
A state's groups draw their blocks from pools (:class:`kvfunc.KVState`):

* ``per-type`` -- a pool per group, each sized for its own need by
  :func:`kvfunc.calculate_block_num` (the seed's layout): a window or a
  recurrent state gets the blocks ``--concurrency`` requests need, full
  attention the rest;
* ``shared`` -- one pool for every group, sized by
  :func:`kvfunc.calculate_shared_block_num` (vLLM's hybrid layout): a block
  is a page of every layer slot, any group may take any block, and one
  eviction order covers them all, so a window's cached blocks stay as long
  as the whole budget allows.

A model with one group has one pool either way, of the same size: the two
layouts run alike.  ``kvfunc simulate`` takes ``shared`` for a model with
more than one group, ``per-type`` otherwise (:func:`default_layout`) -- unless
a group would fill less than half of the shared page: qwen3-next-80b's
recurrent state makes a page 181 times its attention block, so a shared pool
would leave 99 % of every attention block unused (vLLM raises such a group's
block size to fill the page; a model file can do the same with
``block_size``).  Such a model runs ``per-type`` unless told otherwise.

Capacity is a pool's, so usage is counted per pool: in a shared pool a block
one group holds is a block no other group can take, and counting each
group against the whole pool would count it twice.  A :class:`PoolUsage`
is one pool's blocks in use over a run; with ``per-type`` there is one per
group, with ``shared`` one in all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kvfunc.cli._errors import CLIError
from kvfunc.cli._inputs import show
from kvfunc.cli._presets import ModelPreset
from kvfunc.core import KVState, shared_page_layout

__all__ = ["SIM_LAYOUTS", "PoolUsage", "check_layout", "default_layout", "group_rows",
           "num_groups", "pool_usage"]

#: The layouts a simulation runs on (``--layout``).
SIM_LAYOUTS = ("shared", "per-type")


def num_groups(model: ModelPreset) -> int:
    """The model's groups: manager keys with a cache that needs blocks.

    >>> from kvfunc.cli._presets import build_preset
    >>> num_groups(build_preset("gpt-oss-120b")), num_groups(build_preset("llama-3-8b"))
    (2, 1)
    """
    return len({cache.group_key for _, cache in model.cache_info.iter_caches()
                if cache.needs_block})


def default_layout(model: ModelPreset) -> str:
    """``"shared"`` for a model with more than one group, else ``"per-type"``.

    A model whose shared page would leave more than half of some group's
    blocks unused runs ``per-type`` (see the module docstring).

    >>> from kvfunc.cli._presets import build_preset
    >>> [default_layout(build_preset(name))
    ...  for name in ("gpt-oss-120b", "llama-3-8b", "qwen3-next-80b")]
    ['shared', 'per-type', 'per-type']
    """
    if num_groups(model) < 2:
        return "per-type"
    try:
        page = shared_page_layout(model.cache_info)
    except ValueError:  # groups the shared layout cannot place: the per-type sizing says why
        return "per-type"
    return "per-type" if any(2 * g.block_bytes < page.page_bytes for g in page.groups) \
        else "shared"


def check_layout(value: object) -> str:
    """``value`` if it names a layout of :data:`SIM_LAYOUTS`, else a :class:`CLIError`.

    >>> check_layout("shared")
    'shared'
    >>> check_layout("both")
    Traceback (most recent call last):
    ...
    kvfunc.cli._errors.CLIError: --layout must be one of shared, per-type, got 'both'
    """
    if type(value) is not str or value not in SIM_LAYOUTS:
        raise CLIError(f"--layout must be one of {', '.join(SIM_LAYOUTS)}, got {show(value)}")
    return value


@attrs.frozen
class PoolUsage:
    """Blocks in use in one pool over a run (the null block excluded).

    Attributes:
        pool: the pool's name: its group's manager key (``per-type``) or ``"shared"``.
        manager_keys: the groups that draw from it, in manager order.
        attn_types: their attention types, in the same order.
        num_blocks: the pool's blocks, the null block included.
        peak_blocks: the most blocks held at the end of a step.
        mean_blocks: blocks held, averaged over steps.

    >>> u = PoolUsage("shared", ("SlidingWindow", "FullAttention"),
    ...               ("SlidingWindow", "FullAttention"), 101, 50, 25.0)
    >>> u.label, u.peak_fraction
    ('shared (SlidingWindow + FullAttention)', 0.5)
    """

    pool: str
    manager_keys: tuple[str, ...]
    attn_types: tuple[str, ...]
    num_blocks: int
    peak_blocks: int
    mean_blocks: float

    @property
    def label(self) -> str:
        """The pool's name, and its groups when it is not one group's own pool."""
        if self.manager_keys == (self.pool,):
            kind = self.attn_types[0]
            return self.pool if kind == self.pool else f"{self.pool} ({kind})"
        return f"{self.pool} ({' + '.join(self.manager_keys)})"

    @property
    def peak_fraction(self) -> float:
        """Peak usage as a share of the usable blocks."""
        return self.peak_blocks / max(1, self.num_blocks - 1)

    @property
    def mean_fraction(self) -> float:
        """Mean usage over steps as a share of the usable blocks."""
        return self.mean_blocks / max(1, self.num_blocks - 1)

    def to_json(self) -> dict[str, Any]:
        """One row of ``--json``'s ``"pools"``."""
        return {"pool": self.pool, "manager_keys": list(self.manager_keys),
                "attn_types": list(self.attn_types), "num_blocks": self.num_blocks,
                "usable_blocks": self.num_blocks - 1, "peak_blocks": self.peak_blocks,
                "peak_fraction": round(self.peak_fraction, 4),
                "mean_blocks": round(self.mean_blocks, 2),
                "mean_fraction": round(self.mean_fraction, 4)}


def pool_usage(state: KVState, usage: Sequence[Sequence[int]]) -> tuple[PoolUsage, ...]:
    """One :class:`PoolUsage` per pool of ``state``, from each pool's blocks held per step.

    >>> from kvfunc.core import FullAttention
    >>> s = KVState.create({"full": FullAttention(num_blocks=11, block_size=16)}, 64)
    >>> pool_usage(s, [[2, 4]])
    (PoolUsage(pool='full', manager_keys=('full',), attn_types=('FullAttention',), \
num_blocks=11, peak_blocks=4, mean_blocks=3.0),)
    """
    kinds = {g.key: g.policy.attn_type for g in state.groups}
    return tuple(
        PoolUsage(p.name, p.members, tuple(kinds[k] for k in p.members), p.num_blocks,
                  max(used, default=0), sum(used) / len(used) if used else 0.0)
        for p, used in zip(state.pools, usage, strict=True))


def group_rows(state: KVState) -> list[dict[str, Any]]:
    """``--json``'s ``"groups"``: each manager key, its type, its pool and the pool's blocks.

    >>> from kvfunc.core import FullAttention
    >>> group_rows(KVState.create({"f": FullAttention(num_blocks=5, block_size=16)}, 64))
    [{'manager_key': 'f', 'attn_type': 'FullAttention', 'pool': 'f', 'num_blocks': 5, \
'usable_blocks': 4}]
    """
    pools = state.pools
    return [{"manager_key": g.key, "attn_type": g.policy.attn_type, "pool": pools[g.pool].name,
             "num_blocks": pools[g.pool].num_blocks,
             "usable_blocks": pools[g.pool].num_blocks - 1} for g in state.groups]
