"""The sizing configuration: the seed's batch, length and memory settings, checked."""

from __future__ import annotations

from typing import Any

import attrs

from kvfunc.core._checks import check_int
from kvfunc.core._errors import InvalidArgumentError, InvalidTypeError

__all__ = ["SizingConfig"]


@attrs.frozen
class SizingConfig:
    """The engine settings that sizing reads (the seed reads them off ``infer_config``).

    Attributes:
        batch_size_per_dp_rank: the most requests one DP rank runs at once.
        mem_fraction_static: the share of device memory the engine may hold.
        max_prefill_tokens: the longest prefill the cache must be able to hold.
        next_n: MTP depth; a sliding window keeps ``2 * next_n`` extra tokens.
        offline_prefill_dp_group_size: offline, FullAttention caches are
            split over this many DP ranks.

    >>> SizingConfig(batch_size_per_dp_rank=8, mem_fraction_static=0.9, max_prefill_tokens=4096)
    SizingConfig(batch_size_per_dp_rank=8, mem_fraction_static=0.9, max_prefill_tokens=4096, \
next_n=0, offline_prefill_dp_group_size=1)
    """

    batch_size_per_dp_rank: int
    mem_fraction_static: float
    max_prefill_tokens: int
    next_n: int = 0
    offline_prefill_dp_group_size: int = 1

    def __attrs_post_init__(self) -> None:
        check_int("SizingConfig", "batch_size_per_dp_rank", self.batch_size_per_dp_rank, 1)
        check_int("SizingConfig", "max_prefill_tokens", self.max_prefill_tokens, 0)
        check_int("SizingConfig", "next_n", self.next_n, 0)
        check_int("SizingConfig", "offline_prefill_dp_group_size",
                   self.offline_prefill_dp_group_size, 1)
        fraction = self.mem_fraction_static
        if type(fraction) not in (int, float):
            msg = f"SizingConfig mem_fraction_static must be a number, but got {fraction!r}"
            raise InvalidTypeError(msg)
        if not 0 <= fraction <= 1:
            msg = f"SizingConfig mem_fraction_static must lie in [0, 1], but got {fraction}"
            raise InvalidArgumentError(msg)

    @classmethod
    def from_infer_config(cls, infer_config: Any) -> SizingConfig:
        """Read the seed's nested ``infer_config`` attributes.

        ``model_config.next_n`` defaults to 0 and
        ``parallel_config.offline_prefill_dp_group_size`` to 1 when absent;
        the scheduler settings are required.

        >>> from types import SimpleNamespace as NS
        >>> cfg = NS(scheduler_config=NS(batch_size_per_dp_rank=4, mem_fraction_static=0.8,
        ...                              max_prefill_tokens=1024), model_config=NS(next_n=1))
        >>> SizingConfig.from_infer_config(cfg).offline_prefill_dp_group_size
        1
        """
        scheduler = getattr(infer_config, "scheduler_config", None)
        values = {}
        for name in ("batch_size_per_dp_rank", "mem_fraction_static", "max_prefill_tokens"):
            if not hasattr(scheduler, name):
                msg = f"infer_config has no scheduler_config.{name}: {infer_config!r}"
                raise InvalidArgumentError(msg)
            values[name] = getattr(scheduler, name)
        model = getattr(infer_config, "model_config", None)
        parallel = getattr(infer_config, "parallel_config", None)
        return cls(next_n=getattr(model, "next_n", 0),
                   offline_prefill_dp_group_size=getattr(
                       parallel, "offline_prefill_dp_group_size", 1),
                   **values)
