"""The framed connection moves exactly the bytes it is given, whatever their views."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
import torch

from kvfunc.datadist._wire import Connection


@pytest.fixture
def pair() -> Iterator[tuple[Connection, Connection]]:
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname()[:2], timeout=5)
    accepted, _ = server.accept()
    server.close()
    a, b = Connection(client, "a", 5.0), Connection(accepted, "b", 5.0)
    yield a, b
    a.close()
    b.close()


def _move(pair: tuple[Connection, Connection], send: list[memoryview],
          receive: list[memoryview]) -> None:
    sender, receiver = pair
    reader = threading.Thread(target=receiver.read_into, args=(receive,), daemon=True)
    reader.start()
    sender.send(b"", send, 5.0)
    reader.join(10)
    assert not reader.is_alive()


def test_views_of_any_format_arrive_as_their_bytes(pair: tuple[Connection, Connection]
                                                   ) -> None:
    """A float16 view and a 2-D view are sent as their bytes, not their items."""
    half = torch.randn(1 << 20).to(torch.float16)
    grid = torch.arange(4096, dtype=torch.int32).view(64, 64)
    out = bytearray(half.numel() * 2 + grid.numel() * 4)
    _move(pair, [memoryview(half.numpy()), memoryview(grid.numpy())], [memoryview(out)])
    assert bytes(out) == half.numpy().tobytes() + grid.numpy().tobytes()


def test_thousands_of_small_buffers_cross_windows_intact(pair: tuple[Connection, Connection]
                                                         ) -> None:
    """2,500 buffers of uneven sizes (over two windows of 1,024) land where they belong."""
    sizes = [1 + (i * 7919) % 3000 for i in range(2500)]
    data = bytes(i % 251 for i in range(sum(sizes)))
    src = memoryview(data)
    send, recv, out, at = [], [], bytearray(len(data)), 0
    view = memoryview(out)
    for size in sizes:
        send.append(src[at:at + size])
        at += size
    at = 0
    for size in reversed(sizes):  # the receiver cuts the same bytes differently
        recv.append(view[at:at + size])
        at += size
    _move(pair, send, recv)
    assert bytes(out) == data
