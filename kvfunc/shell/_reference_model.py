"""A tiny decoder with random weights, runnable densely or over kvfunc's paged caches.

Its purpose is verification: run the same tokens through
:meth:`TinyDecoder.forward_dense` (ordinary causal attention over the whole
sequence) and :meth:`TinyDecoder.forward_paged` (K/V written through slot
mappings, read back through block tables, step after step) and the logits
must agree to float rounding.  Any wrong block id, slot, null entry or stale
block shows up as a different logit.

Layers (``config.layers``), each ``x += attn(rms(x)); x += mlp(rms(x))``:

* ``"full"``: grouped-query attention, ``num_heads`` queries over
  ``num_kv_heads`` K/V heads, caches ``k_cache``/``v_cache`` (BnBsND);
* ``"sliding"``: the same over a window of ``sliding_window`` tokens, in a
  sliding-window group, caches in the BnNBsD layout;
* ``"latent"``: MLA-style: one latent vector per token, cached as a single
  head with list dims ``latent_dims``, up-projected to every query head's
  K and V after reading.

Weights come from a seeded generator, so two processes building the same
config hold the same model.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from kvfunc.core import (
    CacheEntry,
    InvalidArgumentError,
    LayerCacheInfo,
    MissingTensorError,
    ModelCacheInfo,
)
from kvfunc.shell._reference_attention import attend, paged_attention, write_to_cache

__all__ = ["TinyDecoder", "TinyDecoderConfig"]

_LAYOUT = {"full": "BnBsND", "sliding": "BnNBsD", "latent": "BnBsND"}
_GROUP = {"full": "FullAttention", "sliding": "SlidingWindow", "latent": "FullAttention"}


@attrs.frozen
class TinyDecoderConfig:
    """Sizes of a :class:`TinyDecoder` (all small: it runs in tests on a CPU)."""

    vocab_size: int = 61
    hidden_size: int = 32
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    latent_dims: tuple[int, ...] = (2, 8)
    sliding_window: int = 12
    block_size: int = 4
    max_model_len: int = 256
    layers: tuple[str, ...] = ("full", "sliding", "latent")
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        unknown = [kind for kind in self.layers if kind not in _LAYOUT]
        if unknown or self.num_heads % self.num_kv_heads:
            msg = (f"layers must be among {sorted(_LAYOUT)} and num_heads a multiple of "
                   f"num_kv_heads, but got layers={self.layers}, heads="
                   f"{self.num_heads}/{self.num_kv_heads}")
            raise InvalidArgumentError(msg)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class TinyDecoder:
    """A random-weight decoder over ``config.layers`` (see the module docstring).

    >>> model = TinyDecoder(TinyDecoderConfig())
    >>> model.forward_dense([1, 2, 3]).shape
    torch.Size([3, 61])
    >>> [(i, e.cache_name, e.group_key) for i, e in model.cache_info().iter_caches()][1:]
    [(0, 'v_cache', 'FullAttention'), (1, 'k_cache', 'SlidingWindow'),
     (1, 'v_cache', 'SlidingWindow'), (2, 'kv_latent', 'FullAttention')]
    """

    def __init__(self, config: TinyDecoderConfig) -> None:
        self.config = c = config
        gen = torch.Generator().manual_seed(c.seed)

        def weight(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) / math.sqrt(shape[0])

        h, q_width, kv_width = c.hidden_size, c.num_heads * c.head_dim, \
            c.num_kv_heads * c.head_dim
        latent = math.prod(c.latent_dims)
        self.embed = torch.randn(c.vocab_size, h, generator=gen)
        self.pos_embed = torch.randn(c.max_model_len, h, generator=gen) * 0.5
        self.lm_head = weight(h, c.vocab_size)
        self.weights: list[dict[str, torch.Tensor]] = []
        for kind in c.layers:
            w = {"q": weight(h, q_width), "o": weight(q_width, h),
                 "up": weight(h, 2 * h), "down": weight(2 * h, h)}
            if kind == "latent":
                w |= {"latent": weight(h, latent), "uk": weight(latent, q_width),
                      "uv": weight(latent, q_width)}
            else:
                w |= {"k": weight(h, kv_width), "v": weight(h, kv_width)}
            self.weights.append(w)
        self.caches: dict[tuple[int, str], torch.Tensor] = {}

    # -- caches ------------------------------------------------------------------
    def cache_info(self) -> ModelCacheInfo:
        """The model's caches; each entry's ``tensor_setter`` stores into :attr:`caches`."""
        c = self.config
        layers = []
        for i, kind in enumerate(c.layers):
            common: dict[str, Any] = {"dtype": torch.float32, "needs_block": True,
                                      "block_size": c.block_size,
                                      "cache_layout": _LAYOUT[kind]}
            if kind == "sliding":
                common["sliding_window"] = c.sliding_window
            if kind == "latent":
                caches = [CacheEntry("kv_latent", _GROUP[kind], list(c.latent_dims), 1,
                                     tensor_setter=self._setter(i, "kv_latent"), **common)]
            else:
                caches = [CacheEntry(name, _GROUP[kind], c.head_dim, c.num_kv_heads,
                                     tensor_setter=self._setter(i, name), **common)
                          for name in ("k_cache", "v_cache")]
            layers.append(LayerCacheInfo(i, caches))
        return ModelCacheInfo(len(layers), layers, is_mla_backend=False)

    def _setter(self, layer: int, name: str) -> Any:
        def set_cache(tensor: torch.Tensor) -> None:
            self.caches[(layer, name)] = tensor
        return set_cache

    def bind_caches(self, cache_info: ModelCacheInfo) -> None:
        """Use the tensors attached to ``cache_info`` (from ``with_cache_tensors``)."""
        for layer in cache_info.layer_infos:
            for entry in layer.caches:
                if entry.tensor is None:
                    msg = f"cache {entry.cache_name} of layer {layer.layer_idx} has no tensor"
                    raise MissingTensorError(msg)
                self.caches[(layer.layer_idx, entry.cache_name)] = entry.tensor

    def _cache(self, layer: int, name: str) -> torch.Tensor:
        try:
            return self.caches[(layer, name)]
        except KeyError:
            msg = f"no tensor for cache {name} of layer {layer}: allocate the caches first"
            raise MissingTensorError(msg) from None

    # -- forward -------------------------------------------------------------------
    def _qkv(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Queries and the entries this layer caches, for hidden states ``h``."""
        c, w = self.config, self.weights[i]
        q = (h @ w["q"]).view(-1, c.num_heads, c.head_dim)
        if c.layers[i] == "latent":
            return q, [(h @ w["latent"]).view(-1, 1, *c.latent_dims)]
        k = (h @ w["k"]).view(-1, c.num_kv_heads, c.head_dim)
        return q, [k, (h @ w["v"]).view(-1, c.num_kv_heads, c.head_dim)]

    def _to_kv(self, i: int, entries: Sequence[torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        c, w = self.config, self.weights[i]
        if c.layers[i] != "latent":
            return entries[0], entries[1]
        latent = entries[0].reshape(len(entries[0]), -1)
        shape = (-1, c.num_heads, c.head_dim)
        return (latent @ w["uk"]).view(shape), (latent @ w["uv"]).view(shape)

    def _window(self, i: int) -> int | None:
        return self.config.sliding_window if self.config.layers[i] == "sliding" else None

    def _finish(self, i: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        w = self.weights[i]
        x = x + attn.reshape(len(x), -1) @ w["o"]
        return x + F.gelu(_rms(x) @ w["up"]) @ w["down"]

    def _embed(self, tokens: Any, positions: torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(tokens, dtype=torch.int64)
        if len(positions) and not 0 <= int(positions.min()) <= int(positions.max()) \
                < self.config.max_model_len:
            msg = (f"positions must lie in [0, {self.config.max_model_len}), but got "
                   f"{int(positions.min())}..{int(positions.max())}")
            raise InvalidArgumentError(msg)
        return self.embed[ids] + self.pos_embed[positions]

    def forward_dense(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Logits ``[L, vocab]`` of a whole sequence with ordinary attention (no cache).

        >>> TinyDecoder(TinyDecoderConfig(layers=("full",))).forward_dense([4]).shape
        torch.Size([1, 61])
        """
        pos = torch.arange(len(tokens))
        x = self._embed(tokens, pos)
        for i in range(len(self.config.layers)):
            q, entries = self._qkv(i, _rms(x))
            k, v = self._to_kv(i, entries)
            x = self._finish(i, x, attend(q, k, v, pos, pos, sliding_window=self._window(i)))
        return _rms(x) @ self.lm_head

    def forward_paged(self, tokens: Sequence[int] | torch.Tensor, positions: torch.Tensor,
                      cu_seqlens_q: Sequence[int], block_tables: Mapping[str, torch.Tensor],
                      slot_mappings: Mapping[str, torch.Tensor], *,
                      on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits ``[T, vocab]`` of one batch step over the paged caches.

        Row ``r`` of the batch owns tokens ``cu[r-1]:cu[r]`` at consecutive
        positions that continue what its earlier steps cached; its K/V entries
        are written at ``slot_mappings`` and earlier ones read through
        ``block_tables`` (both keyed by manager key, rows in batch order).

        ``on_layer_done(i)``, if given, is called right after layer ``i`` has
        written this step's K/V entries into its caches (before its attention
        reads them), layer after layer in order: the hook a layer-wise KV push
        waits on.  Without it the step runs exactly as before.

        >>> c = TinyDecoderConfig(layers=("full", "full"))
        >>> model = TinyDecoder(c)
        >>> for i, e in model.cache_info().iter_caches():  # 4 blocks, BnBsND
        ...     model.caches[(i, e.cache_name)] = torch.zeros(
        ...         4, c.block_size, c.num_kv_heads, c.head_dim)
        >>> done = []
        >>> tables = {"FullAttention": torch.tensor([[1]])}
        >>> slots = {"FullAttention": torch.tensor([4, 5])}
        >>> model.forward_paged([1, 2], torch.arange(2), [2], tables, slots,
        ...                     on_layer_done=done.append).shape
        torch.Size([2, 61])
        >>> done
        [0, 1]
        """
        pos = torch.as_tensor(positions, dtype=torch.int64)
        ends = [int(e) for e in cu_seqlens_q]
        x = self._embed(tokens, pos)
        for i, kind in enumerate(self.config.layers):
            key = _GROUP[kind]
            layout = _LAYOUT[kind]
            q, entries = self._qkv(i, _rms(x))
            names = ["kv_latent"] if kind == "latent" else ["k_cache", "v_cache"]
            caches = [self._cache(i, name) for name in names]
            for cache, entry in zip(caches, entries, strict=True):
                write_to_cache(cache, slot_mappings[key], entry, layout=layout)
            if on_layer_done is not None:
                on_layer_done(i)
            attn = paged_attention(q, caches, entries, block_tables[key], pos, ends,
                                   layout=layout, sliding_window=self._window(i),
                                   to_kv=functools.partial(self._to_kv, i))
            x = self._finish(i, x, attn)
        return _rms(x) @ self.lm_head
