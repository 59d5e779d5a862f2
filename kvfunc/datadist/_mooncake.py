"""The Mooncake transfer engine as a transport (optional: ``kvfunc[mooncake]``).

Theory of operation
-------------------
One engine per cluster, started with peer-to-peer handshakes (no metadata
server) over TCP, with the cluster's pools registered once.  A transfer is
a one-sided **read by the receiver**: the sender's descriptor says where
its rows are, and the receiver's engine reads them into its own memory,
as ``(local, remote, length)`` slices (:mod:`._slices`).

Over TCP each slice costs the engine a fixed time on top of its bytes, so
scattered blocks are slow to read in place (a 64 MiB pull of 256 scattered
16 KiB blocks of 16 tensors is 4096 slices).  Each side therefore chooses
per transfer, from its own rows (:func:`~kvfunc.datadist._slices.stages`):

* **in place**: contiguous runs are read straight from the sender's rows
  into the receiver's, one slice per run contiguous on both sides
  (adjacent runs merged, across tensors too), no copy of ours;
* **staged**: short runs are copied through a region of the engine's
  staging arena (:class:`~._mooncake_engine.Staging`, registered once).  A staged sender
  gathers its rows there in stream order, chunk by chunk, and reports
  each chunk (``x/<tid>/staged/<k>``) as soon as it is there; a staged
  receiver reads each chunk into its own region and scatters it into the
  rows while the next chunk is read.  A staged region is one slice per
  chunk.

A side whose arena is full moves in place.  The engine's read cannot be
cancelled: a receiver that gives up (its deadline) keeps the destination
cache pinned and its staging region taken until every read it started
returns, so that memory never goes to another use while data may land in
it; the blocks themselves belong to the engine's allocator, which must not
reuse a timed-out transfer's blocks before the link is torn down
(``docs/datadist.md``).  A sender keeps its staging region until the
receiver's acknowledgement or its own timeout, which breaks the link, so a
pull that succeeds read it whole.  The engine trusts its peers: a
registered pool can be read and written by any peer the engine talks to.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvfunc.datadist import _slices
from kvfunc.datadist._backends import Endpoint, Incoming, Outgoing, rows_as_bytes
from kvfunc.datadist._errors import InvalidParamError, PeerProtocolError
from kvfunc.datadist._mooncake_engine import POLL_S, MooncakeEngine, Read
from kvfunc.datadist._protocol import get_int, get_ints
from kvfunc.datadist._slices import Chunk, Side
from kvfunc.datadist._wire import Connection

__all__ = ["MooncakeEndpoint", "MooncakeEngine"]

_ADDRESS_LIMIT = 1 << 62


def _row_bytes(tensors: Sequence[torch.Tensor]) -> int:
    first = tensors[0]
    return int(first[0].numel() * first.element_size())


def _take_staging(engine: MooncakeEngine, tensors: Sequence[torch.Tensor],
                  rows: Sequence[int]) -> tuple[int, torch.Tensor] | None:
    """A staging region for these rows of every tensor, if the rule stages them and the
    arena has room (host tensors only)."""
    rb = _row_bytes(tensors)
    if not _slices.stages(rows, rb, len(tensors)) or \
            not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return None
    return engine.staging.take(len(tensors) * len(rows) * rb)


class _Outgoing(Outgoing):
    """The sender's half: its rows in place (the receiver reads them where they are) or
    gathered into a staging region, chunk after chunk, each one reported once there."""

    def __init__(self, endpoint: MooncakeEndpoint, tensors: Sequence[torch.Tensor],
                 rows: Sequence[int], tag: int, layers: Sequence[Sequence[int]]) -> None:
        self.endpoint, self.tag = endpoint, tag
        self.tensors, self.rows = list(tensors), list(rows)
        self.layers = [list(layer) for layer in layers]
        rb = _row_bytes(self.tensors)
        self.region = _take_staging(endpoint.engine, self.tensors, self.rows)
        if self.region is None:
            self.descriptor = {"addrs": [t.data_ptr() for t in self.tensors],
                               "rows": self.rows, "row_bytes": rb}
            return
        chunk_rows = min(_slices.chunk_rows_for(rb), len(self.rows) * len(self.tensors))
        self.descriptor = {"staged": self.region[1].data_ptr(), "n_rows": len(self.rows),
                           "chunk_rows": chunk_rows, "row_bytes": rb}
        self.chunks = _slices.chunks_of(self.layers, len(self.rows), chunk_rows)
        self.order = [i for layer in self.layers for i in layer]
        self.index = torch.tensor(self.rows)
        self.staged = self.region[1].view(-1, rb)
        self.released: set[int] = set()
        self.next_layer = 0

    def send(self, indices: Sequence[int]) -> None:
        """Gather each layer whose tensors are all released, in order, chunk by chunk."""
        if self.region is None:
            return  # the receiver reads the rows where they are
        self.released.update(indices)
        while self.next_layer < len(self.layers) and \
                self.released.issuperset(self.layers[self.next_layer]):
            for chunk in self.chunks:
                if chunk.layer == self.next_layer:
                    self._gather(chunk)
                    self.endpoint.conn.put(f"x/{self.tag}/staged/{chunk.number}", {"ok": True})
            self.next_layer += 1

    def _gather(self, chunk: Chunk) -> None:
        n = len(self.rows)
        for p, j0, j1 in _slices.spans(chunk, n):
            src = self.tensors[self.order[p]]
            torch.index_select(src.view(src.shape[0], -1).view(torch.uint8), 0,
                               self.index[j0:j1], out=self.staged[p * n + j0:p * n + j1])

    def wait(self, timeout_s: float) -> None:
        """Nothing to wait for: the receiver's acknowledgement says when it has read."""

    def close(self) -> None:
        """Give the staging region back (the receiver read it, or the link broke)."""
        region, self.region = self.region, None
        if region is not None:
            self.endpoint.engine.staging.give(region)


class _Incoming(Incoming):
    """The receiver's half: reads each chunk (after the sender reported it, when it
    staged) into the rows, or into a staging region that it then scatters while the next
    chunk is read."""

    def __init__(self, endpoint: MooncakeEndpoint, tensors: Sequence[torch.Tensor],
                 rows: Sequence[int], tag: int, layers: Sequence[Sequence[int]],
                 descriptor: dict[str, Any]) -> None:
        self.endpoint, self.tag = endpoint, tag
        self.tensors, self.rows = list(tensors), list(rows)
        self.layers = [list(layer) for layer in layers]
        self.order = [i for layer in self.layers for i in layer]
        n, rb = len(self.rows), _row_bytes(self.tensors)
        if get_int(descriptor, "row_bytes") != rb:
            raise InvalidParamError(f"the sender's rows are {descriptor['row_bytes']} bytes, "
                                    f"here {rb}")
        remote, src_rows, chunk_rows = self._remote(descriptor, n, rb)
        self.region = _take_staging(endpoint.engine, self.tensors, self.rows)
        if self.region is not None:
            local = Side(self.region[1].data_ptr(), (), ())
            self.staged = self.region[1].view(-1, rb).numpy()
            self.index = torch.tensor(self.rows).numpy()
        else:
            local = Side(None, [self.tensors[i].data_ptr() for i in self.order], self.rows)
        if chunk_rows is None:  # chunks pipeline a scatter here, else a layer reads at once
            chunk_rows = _slices.chunk_rows_for(rb) if self.region else n * len(self.order)
        starts = _slices.run_starts(n, None if self.region else self.rows, src_rows)
        self.chunks = [(c, _slices.chunk_slices(c, n, rb, starts, local, remote))
                       for c in _slices.chunks_of(self.layers, n, chunk_rows)]
        self.sender_staged = remote.base is not None
        self.done_layers: set[int] = set()
        self.reads: list[Read] = []

    def _remote(self, descriptor: dict[str, Any], n: int, rb: int
                ) -> tuple[Side, list[int] | None, int | None]:
        """The sender's side, its rows in place (None: staged) and its chunking, checked."""
        if descriptor.get("staged") is not None:
            get_int(descriptor, "n_rows", n, n)
            chunk_rows = get_int(descriptor, "chunk_rows", 1, n * len(self.order))
            return Side(get_int(descriptor, "staged", 1, _ADDRESS_LIMIT), (), ()), None, \
                chunk_rows
        addrs = get_ints(descriptor, "addrs", _ADDRESS_LIMIT, len(self.tensors))
        src_rows = get_ints(descriptor, "rows", _ADDRESS_LIMIT // max(rb, 1), n)
        if len(addrs) != len(self.tensors) or len(src_rows) != n:
            raise InvalidParamError("the sender's descriptor does not match this transfer")
        return Side(None, [addrs[i] for i in self.order], src_rows), src_rows, None

    def receive(self, indices: Sequence[int], timeout_s: float) -> None:
        """Read the chunks of every layer that holds one of ``indices``, each read
        overlapping the scatter of the one before."""
        deadline = time.monotonic() + timeout_s
        wanted = {number for number, layer in enumerate(self.layers)
                  if number not in self.done_layers and set(layer) & set(indices)}
        previous: tuple[Chunk, Read] | None = None
        for chunk, slices in self.chunks:
            if chunk.layer not in wanted:
                continue
            if self.sender_staged:
                self._staged(chunk, deadline)
            read = Read(self.endpoint.engine.engine, self.endpoint.peer_session, slices)
            self.reads.append(read)
            if previous is not None:
                self._land(*previous, deadline)
            previous = chunk, read
        if previous is not None:
            self._land(*previous, deadline)
        self.done_layers |= wanted
        if len(self.done_layers) == len(self.layers):
            self._give_back()

    def _staged(self, chunk: Chunk, deadline: float) -> None:
        """Wait until the sender reports chunk ``chunk`` gathered."""
        key = f"x/{self.tag}/staged/{chunk.number}"
        reply = self.endpoint.conn.take(key, max(deadline - time.monotonic(), 0.0))
        if reply != {"ok": True}:
            raise PeerProtocolError(f"{key} must be {{'ok': true}}, got {reply!r:.80}")

    def _land(self, chunk: Chunk, read: Read, deadline: float) -> None:
        """Wait for ``chunk``'s read, then scatter it from staging (if staged here)."""
        read.wait(deadline, f"reading chunk {chunk.number} from {self.endpoint.peer_session}")
        self.reads.remove(read)
        if self.region is None:
            return
        n = len(self.rows)
        for p, j0, j1 in _slices.spans(chunk, n):
            rows_as_bytes(self.tensors[self.order[p]])[self.index[j0:j1]] = \
                self.staged[p * n + j0:p * n + j1]

    def _give_back(self) -> None:
        region, self.region = self.region, None
        if region is not None:
            self.endpoint.engine.staging.give(region)

    def abandon(self, on_settled: Callable[[], None]) -> None:
        """A read in flight cannot be cancelled: ``on_settled`` runs once every read this
        transfer started has returned (a thread looks), and the staging region goes back
        then too."""
        reads = [read for read in self.reads if not read.settled()]

        def settle() -> None:
            for read in reads:
                while not read.settled():
                    time.sleep(POLL_S * 10)
            self._give_back()
            on_settled()

        if not reads:
            settle()
            return
        threading.Thread(target=settle, daemon=True, name="kvfunc-mooncake-settle").start()


class MooncakeEndpoint(Endpoint):
    """A link whose transfers are Mooncake reads from the peer's session; the link's
    connection carries the staged chunks' reports."""

    def __init__(self, engine: MooncakeEngine, peer_session: str, conn: Connection) -> None:
        self.engine, self.peer_session, self.conn = engine, peer_session, conn

    def outgoing(self, tensors: Sequence[torch.Tensor], rows: Sequence[int], tag: int,
                 layers: Sequence[Sequence[int]]) -> Outgoing:
        return _Outgoing(self, tensors, rows, tag, layers)

    def incoming(self, tensors: Sequence[torch.Tensor], rows: Sequence[int], tag: int,
                 layers: Sequence[Sequence[int]], descriptor: dict[str, Any] | None
                 ) -> Incoming:
        if descriptor is None:
            raise InvalidParamError("a Mooncake read needs the sender's descriptor")
        return _Incoming(self, tensors, rows, tag, layers, descriptor)

    def close(self) -> None:
        """Nothing to tear down per link: the engine belongs to the cluster."""
