"""KV events: the prefix cache's stores, evictions and resets, for subscribers such as routers.

* :func:`events_from_delta` derives :class:`BlockStored`, :class:`BlockRemoved`
  and :class:`AllBlocksCleared` events from a transition's delta, with vLLM's
  field names plus ``group`` (the manager key) and ``block_ids``;
* :func:`encode_event_batch` / :func:`decode_event_batch` turn a
  :class:`KVEventBatch` into msgpack bytes laid out as vLLM's, and back;
* :class:`CachedBlocksView` rebuilds every group's cached blocks from the events;
* :func:`events_from_tier_delta` adds the events of the tiers below the device
  (host memory, medium ``"CPU"``; a remote store, medium ``"REMOTE"``).

Imports only the public core, attrs, pyrsistent and msgpack (never torch).

>>> import kvfunc as kf
>>> from kvfunc.events import CachedBlocksView, KVEventBatch, decode_event_batch
>>> from kvfunc.events import encode_event_batch, events_from_delta
>>> s = kf.KVState.create({"full": kf.FullAttention(num_blocks=8, block_size=4)}, 64,
...                       enable_prefix_caching=True)
>>> r = kf.allocate_slots(s, "a", 0, 9, block_hashes=kf.BlockHashes.of(range(9), 4))
>>> data = encode_event_batch(KVEventBatch(0.0, events_from_delta(r.delta, s)))
>>> CachedBlocksView().apply(decode_event_batch(data)).matches(r.state)
True
"""

from kvfunc.events._codec import decode_event_batch, encode_event_batch
from kvfunc.events._events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    events_from_delta,
)
from kvfunc.events._tier_events import MEDIUM_CPU, MEDIUM_REMOTE, events_from_tier_delta
from kvfunc.events._view import CachedBlocksView

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_REMOTE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CachedBlocksView",
    "KVCacheEvent",
    "KVEventBatch",
    "decode_event_batch",
    "encode_event_batch",
    "events_from_delta",
    "events_from_tier_delta",
]
