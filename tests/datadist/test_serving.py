"""Fair serving: the policy against a simple model, and the threads that run it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
from hostile import wait_for
from hypothesis import given
from hypothesis import strategies as st

from kvfunc.datadist._serving import LINK_SHARE, FairQueue, Server

OWNERS = "abcd"
OPS = st.lists(st.tuples(st.sampled_from(["push", "pop", "done"]), st.sampled_from(OWNERS)),
               max_size=80)


class Model:
    """The policy said plainly: start the waiting owner with the fewest running (the
    least recently served first) among those that may start."""

    def __init__(self, shared: int, per_link: int) -> None:
        self.shared, self.per_link = shared, per_link
        self.waiting: dict[str, list[int]] = {o: [] for o in OWNERS}
        self.running = dict.fromkeys(OWNERS, 0)
        self.stamp = dict.fromkeys(OWNERS, 0)  # when queued or last served
        self.clock = 0

    def shared_running(self) -> int:
        return sum(max(r - 1, 0) for r in self.running.values())

    def may_start(self, owner: str) -> bool:
        r = self.running[owner]
        return bool(self.waiting[owner]) and (
            r == 0 or (self.shared_running() < self.shared and r - 1 < self.per_link))

    def push(self, owner: str, item: int) -> None:
        if not self.waiting[owner]:
            self.clock += 1
            self.stamp[owner] = self.clock
        self.waiting[owner].append(item)

    def pop(self) -> tuple[str, int] | None:
        ready = [o for o in OWNERS if self.may_start(o)]
        if not ready:
            return None
        owner = min(ready, key=lambda o: (self.running[o], self.stamp[o]))
        self.running[owner] += 1
        self.clock += 1
        self.stamp[owner] = self.clock
        return owner, self.waiting[owner].pop(0)


@given(OPS, st.integers(0, 3), st.integers(0, 3))
def test_the_queue_starts_what_the_model_starts(ops: list[tuple[str, str]], shared: int,
                                                per_link: int) -> None:
    """Any program of pushes, pops and ends: each pop is the model's (FIFO per owner,
    fewest running first, then least recently served), an owner never runs more than
    1 + per_link at once nor all owners more than shared beyond their own slots, and an
    owner with something waiting and nothing running always gets a start."""
    queue: FairQueue[int] = FairQueue(shared, per_link)
    model = Model(shared, per_link)
    for n, (op, owner) in enumerate(ops):
        if op == "push":
            queue.push(owner, n)
            model.push(owner, n)
        elif op == "pop":
            own_slot = any(model.waiting[o] and not model.running[o] for o in OWNERS)
            popped = queue.pop()
            assert model.pop() == popped
            assert popped is not None or not own_slot, "nothing running: it must start"
        elif model.running[owner]:
            queue.done(owner)
            model.running[owner] -= 1
        for o in OWNERS:
            assert (model.running[o], len(model.waiting[o])) == (queue.running(o),
                                                                 queue.waiting(o))
            assert queue.running(o) <= 1 + per_link
        assert model.shared_running() == queue.shared_running <= shared


def test_drain_empties_the_queue_and_keeps_the_running_counts() -> None:
    """drain returns every waiting item; what runs still counts until done."""
    queue: FairQueue[str] = FairQueue(shared=0, per_link=0)
    for item in ("a1", "a2", "b1"):
        queue.push(item[0], item)
    assert ("a", "a1") == queue.pop()
    assert ["a2", "b1"] == queue.drain()
    assert (1, 0, None) == (queue.running("a"), queue.waiting("a"), queue.pop())


@pytest.mark.parametrize(("shared", "per_link"), [(-1, 0), (1, -2), (1.5, 1)])
def test_a_bad_share_is_refused(shared: int, per_link: int) -> None:
    """Negative or non-int shares are a ValueError."""
    with pytest.raises(ValueError, match="must be ints >= 0"):
        FairQueue(shared, per_link)


class Gate:
    """Jobs that report they started and wait until let go."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.release = threading.Event()
        self.lock = threading.Lock()

    def job(self, name: str) -> Callable[[], None]:
        def run() -> None:
            with self.lock:
                self.started.append(name)
            assert self.release.wait(30)
        return run


@pytest.fixture
def server() -> Iterator[Server]:
    """A server with 2 shared slots, at most 2 per link."""
    s = Server(shared=2, per_link=2)
    try:
        yield s
    finally:
        s.shutdown()


def test_a_link_runs_its_request_while_another_holds_every_shared_slot(server: Server
                                                                        ) -> None:
    """Link a holds its own slot and both shared ones, more of its requests wait; link
    b's request starts and ends all the same."""
    gate = Gate()
    held = [server.submit("a", gate.job(f"a{i}")) for i in range(6)]
    assert wait_for(lambda: 3 == len(gate.started))
    server.submit("b", lambda: None).result(timeout=10)
    assert (3, ["a0", "a1", "a2"]) == (server.running("a"), sorted(gate.started))
    gate.release.set()
    for future in held:
        future.result(timeout=10)


def test_a_freed_shared_slot_goes_to_the_link_with_fewest_running(server: Server) -> None:
    """a holds 3 (its own + 2 shared) with more waiting; b holds its own with more
    waiting; when one of a's requests ends, the freed shared slot goes to b."""
    gates = {name: Gate() for name in ("a0", "rest")}
    first = server.submit("a", gates["a0"].job("a0"))
    rest = [server.submit(o, gates["rest"].job(f"{o}{i}"))
            for o, i in (("a", 1), ("a", 2), ("a", 3), ("b", 0), ("b", 1))]
    assert wait_for(lambda: 3 == len(gates["rest"].started))
    assert ["a1", "a2", "b0"] == sorted(gates["rest"].started)  # threads start in any order
    gates["a0"].release.set()
    first.result(timeout=10)
    assert wait_for(lambda: 4 == len(gates["rest"].started))
    assert "b1" == gates["rest"].started[-1]
    gates["rest"].release.set()
    for future in rest:
        future.result(timeout=10)


def test_one_link_holds_at_most_its_share_of_the_default_server() -> None:
    """With the defaults, a link that queues 20 blocking requests runs 1 + LINK_SHARE of
    them; a request of another link still runs."""
    server, gate = Server(), Gate()
    try:
        held = [server.submit("a", gate.job(f"a{i}")) for i in range(20)]
        assert wait_for(lambda: 1 + LINK_SHARE == len(gate.started))
        server.submit("b", lambda: None).result(timeout=10)
        assert 1 + LINK_SHARE == server.running("a") == len(gate.started)
        gate.release.set()
        for future in held:
            future.result(timeout=10)
    finally:
        server.shutdown()


def test_shutdown_cancels_what_waits_and_refuses_more(server: Server) -> None:
    """Waiting requests are cancelled at shutdown, running ones end, later submits raise."""
    gate = Gate()
    futures = [server.submit("a", gate.job(f"a{i}")) for i in range(5)]
    assert wait_for(lambda: 3 == len(gate.started))
    gate.release.set()
    server.shutdown()
    assert [False] * 3 + [True] * 2 == [f.cancelled() for f in futures]
    with pytest.raises(RuntimeError, match="shut down"):
        server.submit("a", lambda: None)


def test_a_cancelled_request_is_skipped_and_an_error_reaches_its_future(server: Server
                                                                        ) -> None:
    """A request cancelled while it waits never runs; one that raises hands its error to
    its future and the thread serves on."""
    gate = Gate()
    blocking = [server.submit("a", gate.job(f"a{i}")) for i in range(3)]
    assert wait_for(lambda: 3 == len(gate.started))
    ran = threading.Event()
    skipped = server.submit("a", ran.set)
    assert skipped.cancel()

    def boom() -> None:
        raise KeyError("boom")
    failing = server.submit("a", boom)
    gate.release.set()
    with pytest.raises(KeyError, match="boom"):
        failing.result(timeout=10)
    for future in blocking:
        future.result(timeout=10)
    server.submit("a", lambda: None).result(timeout=10)
    assert not ran.is_set()
