"""Mooncake Store as the remote tier, against a real ``mooncake_master`` on loopback.

Fault tests end in a typed error or a miss within a bounded time, with no
host block outside the call touched and none left half written.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("mooncake.store", reason="needs the kvfunc[mooncake] extra and libibverbs1")

from mooncake.store import MooncakeDistributedStore
from mooncake_servers import MooncakeServers, free_port

from kvfunc.core import BlockIndexError, InvalidArgumentError, InvalidTypeError
from kvfunc.shell import (
    HostBlockPool,
    MooncakeStore,
    MooncakeStoreConfig,
    StoreDataError,
    StoreError,
    StoreMissError,
    StoreTimeoutError,
    StoreUnavailableError,
    block_key,
)

NUM_BLOCKS = 16
DEADLINE_S = 5.0
SLOW_CALL_S = 20.0  # a get with the master gone: the client retries about 4 s, then fails


def device_tensors() -> dict[str, torch.Tensor]:
    """Two layers' K and V of 8 blocks, 1 KiB per tensor block, seeded random bytes."""
    gen = torch.Generator().manual_seed(7)
    return {f"layer {i // 2} {'kv'[i % 2]}": torch.randint(
        0, 256, (8, 4, 2, 64), generator=gen, dtype=torch.uint8).view(torch.float16)
        for i in range(4)}


def pool(layout: str) -> HostBlockPool:
    """A host pool like :func:`device_tensors` whose blocks hold distinct random bytes."""
    host = HostBlockPool.like(device_tensors(), NUM_BLOCKS, layout=layout)
    gen = torch.Generator().manual_seed(11)
    for buf in host.buffers:
        buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8))
    return host


def block(host: HostBlockPool, b: int) -> bytes:
    """Host block ``b``'s bytes, tensor by tensor (the object a store keeps)."""
    return b"".join(t[b].contiguous().view(torch.uint8).numpy().tobytes() for t in host.tensors)


def config(servers: MooncakeServers, **extra: Any) -> MooncakeStoreConfig:
    """A client of ``servers`` lending no memory, with short deadlines and small batches."""
    base: dict[str, Any] = {"master_address": servers.master_address,
                            "metadata_server": servers.metadata_server,
                            "probe_timeout_s": DEADLINE_S, "call_timeout_s": DEADLINE_S,
                            "batch_objects": 3}
    return MooncakeStoreConfig(**(base | extra))


def raw_client(servers: MooncakeServers) -> Any:
    """A plain Mooncake client of ``servers``: the store as other processes see it."""
    client = MooncakeDistributedStore()
    assert 0 == client.setup("127.0.0.1", servers.metadata_server, 0, 16 << 20, "tcp", "",
                             servers.master_address)
    return client


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeServers]:
    """A master and a memory lender shared by the module's tests that do not break them."""
    s = MooncakeServers(tmp_path_factory.mktemp("mooncake"))
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def raw(servers: MooncakeServers) -> Iterator[Any]:
    """A plain Mooncake client of the module's store: the store as other processes see it."""
    client = raw_client(servers)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="module", params=["block", "layer"])
def store(request: pytest.FixtureRequest, servers: MooncakeServers) -> Iterator[MooncakeStore]:
    """A store client over a fresh host pool of each layout, shared by the module's tests
    (each test uses hashes of its own)."""
    st = MooncakeStore.connect(config(servers), pool(request.param), namespace="test",
                               group_key="full")
    try:
        yield st
    finally:
        st.close()


@pytest.fixture
def own_servers(tmp_path: Path) -> Iterator[MooncakeServers]:
    """A master and a lender of the test's own, for tests that kill or pause the master."""
    s = MooncakeServers(tmp_path / "mooncake")
    try:
        yield s
    finally:
        s.stop()


def hashes(tag: str, n: int) -> list[bytes]:
    """``n`` distinct block hashes unique to one test."""
    return [f"{tag}-{i}".encode() for i in range(n)]


def test_blocks_round_trip_in_batches(store: MooncakeStore) -> None:
    """Seven blocks put in batches of 3 come back whole into other host blocks; contains agrees."""
    host = store.host
    hs = hashes(f"round-{host.layout}", 7)
    want = [block(host, b) for b in range(7)]
    put = store.put_blocks(hs, list(range(7)))
    assert (tuple(range(7)), (0,) * 7) == (put.ok, put.codes)
    assert (True,) * 7 + (False,) == store.contains([*hs, b"never-stored"])
    got = store.get_blocks(hs[::-1], list(range(9, 16)))
    assert (tuple(range(7)), 7) == (got.ok, got.leading_ok)
    assert want[::-1] == [block(host, b) for b in range(9, 16)]


def test_a_stored_key_keeps_its_first_value(store: MooncakeStore) -> None:
    """A second put of a key is ok and keeps the first bytes (keys name their bytes)."""
    host = store.host
    first = block(host, 0)
    key = f"once-{host.layout}".encode()
    assert (0,) == store.put_blocks([key], [0]).ok
    assert (0,) == store.put_blocks([key], [1]).ok
    assert (0,) == store.get_blocks([key], [2]).ok
    assert first == block(host, 2)


def test_namespaces_and_formats_do_not_share_blocks(store: MooncakeStore, raw: Any) -> None:
    """The same hash under another namespace, group or block format is another object."""
    h = f"shared-{store.host.layout}".encode()
    assert (0,) == store.put_blocks([h], [0]).ok
    fp = store.host.fingerprint
    others = [block_key("another", "full", fp, h), block_key("test", "swa", fp, h),
              block_key("test", "full", "0" * len(fp), h)]
    assert [1, 0, 0, 0] == raw.batch_is_exist([store.key(h), *others])


def test_bad_arguments_raise_and_touch_nothing(store: MooncakeStore) -> None:
    """Wrong types, lengths, ranges and repeated destinations raise typed errors; no block moves."""
    host = store.host
    before = [block(host, b) for b in range(NUM_BLOCKS)]
    bad = [f"bad-{host.layout}-{i}".encode() for i in range(2)]
    with pytest.raises(InvalidTypeError):
        store.get_blocks(["not-bytes"], [0])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError):
        store.get_blocks(bad, [0])
    with pytest.raises(InvalidArgumentError):
        store.put_blocks([b""], [0])
    with pytest.raises(BlockIndexError):
        store.put_blocks(bad[:1], [NUM_BLOCKS])
    with pytest.raises(InvalidArgumentError):
        store.get_blocks(bad, [3, 3])
    with pytest.raises(InvalidTypeError):
        store.get_blocks(bad, [0.5, 1])
    assert (False, False) == store.contains(bad)
    assert before == [block(host, b) for b in range(NUM_BLOCKS)]


def test_a_block_dropped_after_lookup_is_a_miss(store: MooncakeStore, raw: Any) -> None:
    """Fault 1: removed between contains and the get: a miss, its block zeroed, others kept."""
    host = store.host
    hs = hashes(f"dropped-{host.layout}", 3)
    assert (0, 1, 2) == store.put_blocks(hs, [0, 1, 2]).ok
    assert (True, True, True) == store.contains(hs)
    assert 0 == raw.remove(store.key(hs[1]), True)  # forced: within the read lease
    neighbours = [block(host, b) for b in (4, 6)]
    t0 = time.monotonic()
    got = store.get_blocks(hs, [3, 5, 7])
    assert time.monotonic() - t0 < DEADLINE_S
    assert (("ok", "miss", "ok"), 1) == (got.outcomes, got.leading_ok)
    assert isinstance(got.error(1), StoreMissError) and got.error(1).code == -704
    assert [block(host, 0), bytes(host.block_bytes), block(host, 2)] == [
        block(host, b) for b in (3, 5, 7)]
    assert neighbours == [block(host, b) for b in (4, 6)]


@pytest.mark.parametrize("delta", [-100, 100])
def test_a_value_of_the_wrong_size_fails_the_block(store: MooncakeStore, raw: Any,
                                                   delta: int) -> None:
    """Fault 4: a value shorter or longer than a block under the key: failed, zeroed, contained."""
    host = store.host
    h = f"wrong-size{delta}-{host.layout}".encode()
    size = host.block_bytes + delta
    assert 0 == raw.put(store.key(h), bytes(range(256)) * (size // 256) + bytes(size % 256))
    neighbours = [block(host, b) for b in (4, 6)]
    got = store.get_blocks([h], [5])
    assert ("failed",) == got.outcomes
    assert isinstance(got.error(0), StoreDataError)
    assert bytes(host.block_bytes) == block(host, 5)
    assert neighbours == [block(host, b) for b in (4, 6)]


def test_the_master_dying_during_a_store_raises(own_servers: MooncakeServers) -> None:
    """Fault 2: the master killed after the first batch: StoreUnavailableError in bounded time;
    a get then raises too (its client retries for seconds first) and zeroes every destination."""
    host = pool("block")
    st = MooncakeStore.connect(config(own_servers, call_timeout_s=SLOW_CALL_S), host,
                               namespace="test", group_key="full")
    client, calls = st._client, []

    class KillAfterFirstBatch:
        """Forwards to the real client; kills the master once the first batch has returned."""

        def __getattr__(self, name: str) -> Any:
            return getattr(client, name)

        def batch_put_from(self, *args: Any) -> Any:
            result = client.batch_put_from(*args)
            calls.append(result)
            if len(calls) == 1:
                own_servers.kill_master()
            return result

    st._client = KillAfterFirstBatch()
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailableError) as err:
            st.put_blocks(hashes("dying", 7), list(range(7)))
        assert time.monotonic() - t0 < SLOW_CALL_S
        assert (2, [0, 0, 0], -900) == (len(calls), calls[0], err.value.code)
        with pytest.raises(StoreUnavailableError):
            st.get_blocks(hashes("dying", 2), [9, 10])
        assert time.monotonic() - t0 < 2 * SLOW_CALL_S
        assert [bytes(host.block_bytes)] * 2 == [block(host, 9), block(host, 10)]
    finally:
        st._client = client
        st.close()


def test_an_unreachable_master_fails_connect_in_time() -> None:
    """Fault 3: no master at all: connect raises StoreUnavailableError within the probe deadline."""
    cfg = MooncakeStoreConfig(master_address=f"127.0.0.1:{free_port()}",
                              metadata_server=f"http://127.0.0.1:{free_port()}/metadata",
                              probe_timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=r"not reached within 2\.0 s"):
        MooncakeStore.connect(cfg, pool("block"), namespace="test", group_key="full")
    assert time.monotonic() - t0 < 2.0 + DEADLINE_S


def test_a_silent_master_times_out_and_blocks_are_fenced(own_servers: MooncakeServers) -> None:
    """A paused master: the get passes its deadline with its blocks named busy, later calls
    are refused until it returns, the store works again once the master runs, and a closed
    store refuses calls."""
    host = pool("block")
    hs = hashes("paused", 2)
    with MooncakeStore.connect(config(own_servers, call_timeout_s=1.0), host,
                               namespace="test", group_key="full") as st:
        assert (0, 1) == st.put_blocks(hs, [0, 1]).ok
        own_servers.pause_master()
        try:
            with pytest.raises(StoreTimeoutError) as err:
                st.get_blocks(hs, [4, 5])
            assert (4, 5) == err.value.busy_block_ids
            with pytest.raises(StoreUnavailableError, match="still running past its deadline"):
                st.contains(hs)
        finally:
            own_servers.resume_master()
        assert st.wait_idle(30)
        assert (True, True) == st.contains(hs)
    with pytest.raises(StoreUnavailableError, match="closed"):
        st.contains(hs)


@pytest.mark.parametrize("answer", [[1], ["1", 1], None, RuntimeError("boom")])
def test_answers_of_the_wrong_shape_raise_store_errors(store: MooncakeStore, answer: Any) -> None:
    """A client answer of the wrong length or type, or a client that raises, is a StoreError
    (never taken for a status), and the store keeps working afterwards."""
    client = store._client

    class Answers:
        """Forwards to the real client, except ``batch_is_exist``, which answers ``answer``."""

        def __getattr__(self, name: str) -> Any:
            return getattr(client, name)

        def batch_is_exist(self, keys: list[str]) -> Any:
            if isinstance(answer, Exception):
                raise answer
            return answer

    store._client = Answers()
    try:
        with pytest.raises(StoreError) as err:
            store.contains([b"x", b"y"])
        assert type(err.value) is StoreError
    finally:
        store._client = client
    assert (False, False) == store.contains([b"x", b"y"])
