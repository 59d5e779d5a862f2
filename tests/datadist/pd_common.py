"""What the prefill process and the decode test share: the model, its caches, one batch step."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

import kvfunc.datadist as dd
from kvfunc.compat import (
    KVCacheManager,
    create_single_type_managers,
    prepare_block_tables,
    prepare_slot_mapping,
)
from kvfunc.shell import TinyDecoder, TinyDecoderConfig

CONFIG = TinyDecoderConfig(layers=("full", "sliding", "latent", "sliding", "full"))
POOLS = {"FullAttention": 64, "SlidingWindow": 40}


class LayerSignals:
    """Sets ``done[i]`` when the model reports layer ``i`` written (``forward_paged``'s
    ``on_layer_done``), and serves the LayerSynchronizer protocol over it."""

    def __init__(self, num_layers: int) -> None:
        self.done = [threading.Event() for _ in range(num_layers)]

    def layer_done(self, layer_index: int) -> None:
        """``on_layer_done``: layer ``layer_index`` has written its K/V."""
        self.done[layer_index].set()

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        """The LayerSynchronizer protocol over ``done``."""
        timeout = None if timeout_in_millis is None else timeout_in_millis / 1000
        return self.done[layer_index].wait(timeout)


class Side:
    """One cluster's model over DataDist-pooled caches, and the allocator that manages them."""

    def __init__(self, cm: dd.CacheManager) -> None:
        self.model = TinyDecoder(CONFIG)
        self.signals = LayerSignals(len(CONFIG.layers))
        self.paged = dd.allocate_paged_caches(cm, self.model.cache_info(), POOLS)
        self.model.bind_caches(self.paged.cache_info)
        info = self.paged.cache_info
        self.mgr = KVCacheManager(CONFIG.max_model_len, create_single_type_managers(
            info, POOLS, CONFIG.max_model_len), info)
        self.layout = self.paged.layout(self.mgr.get_contiguous_buf_infos())
        self.widths = self.mgr.get_block_table_max_lens(CONFIG.max_model_len)

    def step(self, rows: Sequence[tuple[str, int, Sequence[int]]]) -> list[torch.Tensor]:
        """One batch step: each row ``(request, tokens cached before, new tokens)``; the
        logits of each row's new tokens."""
        tokens = [t for _, _, new in rows for t in new]
        positions = torch.tensor([cached + i for _, cached, new in rows
                                  for i in range(len(new))])
        ends = torch.cumsum(torch.tensor([len(new) for _, _, new in rows]), 0).tolist()
        requests = [SimpleNamespace(request_id=rid) for rid, _, _ in rows]
        tables = prepare_block_tables(requests, self.mgr, self.widths, "cpu", len(rows))
        slots = prepare_slot_mapping(positions, ends, self.mgr, tables)
        logits = self.model.forward_paged(tokens, positions, ends, tables, slots,
                                          on_layer_done=self.signals.layer_done)
        return list(torch.tensor_split(logits, ends[:-1]))


def jsonable(block_ids: dict[str, Any]) -> dict[str, list[int]]:
    """Block ids as plain lists."""
    return {k: [int(b) for b in v] for k, v in block_ids.items()}
