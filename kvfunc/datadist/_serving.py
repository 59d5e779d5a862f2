"""Serving the requests of many links fairly: a queue per link, a slot of its own each,
and a shared rest handed out round robin.

Theory of operation
-------------------
Each request a peer sends (a pull to serve, a push to take) holds a thread
until it ends, and how long is partly the peer's choice: a decoder may
take almost the whole transfer timeout to acknowledge each pull it asked
for, legally.  Were every link to draw on one pool of threads, first come
first served, one greedy link could hold them all and every other link's
requests would wait behind it until their own transfers timed out.  So
the requests of a cluster are scheduled per link (:class:`FairQueue`, the
policy, no threads; :class:`Server`, the threads):

* **A slot of its own.**  A link with no request running starts its next
  one at once, whatever the other links hold.  A peer that asks one thing
  at a time (the usual decoder) is never delayed by another link.
* **A shared rest.**  Further requests of a link run in ``shared`` slots
  common to all links, at most ``per_link`` of them per link, so one link
  holds at most ``1 + per_link`` threads.
* **Fewest first.**  A shared slot that frees goes to the waiting link with
  the fewest requests running; ties go round robin (the link served least
  recently first).  No link is given a slot beyond another waiting link's
  share.
* Within a link, requests start in the order they arrived.

So with ``n`` links the cluster runs at most ``n + shared`` requests at
once (a thread each); the threads are started as requests need them and
end after ``IDLE_S`` seconds without work.  A link that queues too much
is refused by its own reader (``MAX_REQUESTS`` in :mod:`._link`), which
breaks that link only.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Generic, TypeVar

__all__ = ["IDLE_S", "LINK_SHARE", "SHARED_SLOTS", "FairQueue", "Server"]

SHARED_SLOTS = 32  # slots common to every link of a cluster
LINK_SHARE = 8  # of those, the most one link may hold at once
IDLE_S = 10.0  # a serving thread with nothing to do for this long ends

T = TypeVar("T")


class FairQueue(Generic[T]):
    """The serving policy (see the module docstring): FIFO per owner (a link), a slot
    of its own per owner, ``shared`` more slots, at most ``per_link`` per owner.

    :meth:`pop` returns the next item that may start now and counts it as
    running until :meth:`done`.  No threads, no I/O.

    >>> q = FairQueue(shared=1, per_link=1)
    >>> for item in ("a1", "a2", "a3"):
    ...     q.push("a", item)
    >>> q.push("b", "b1")
    >>> q.pop(), q.pop(), q.pop(), q.pop()
    (('a', 'a1'), ('b', 'b1'), ('a', 'a2'), None)
    >>> q.done("b"); q.push("b", "b2"); q.pop()
    ('b', 'b2')
    >>> q.done("a"); q.pop()
    ('a', 'a3')
    """

    def __init__(self, shared: int, per_link: int) -> None:
        if type(shared) is not int or type(per_link) is not int or shared < 0 or per_link < 0:
            raise ValueError(f"shared={shared!r} and per_link={per_link!r} must be ints >= 0")
        self.shared, self.per_link = shared, per_link
        self.shared_running = 0
        self._waiting: dict[Hashable, deque[T]] = {}
        self._running: dict[Hashable, int] = {}
        self._order: deque[Hashable] = deque()  # owners with waiting items, least recent first

    def running(self, owner: Hashable) -> int:
        """How many of ``owner``'s items run now."""
        return self._running.get(owner, 0)

    def waiting(self, owner: Hashable) -> int:
        """How many of ``owner``'s items wait."""
        return len(self._waiting.get(owner, ()))

    def push(self, owner: Hashable, item: T) -> None:
        """Queue ``item`` behind ``owner``'s earlier ones."""
        queue = self._waiting.get(owner)
        if queue is None:
            queue = self._waiting[owner] = deque()
            self._order.append(owner)
        queue.append(item)

    def _may_start(self, owner: Hashable) -> bool:
        running = self.running(owner)
        return running == 0 or (self.shared_running < self.shared and
                                running - 1 < self.per_link)

    def pop(self) -> tuple[Hashable, T] | None:
        """The next ``(owner, item)`` that may start now (counted as running), or None."""
        best = None
        for owner in self._order:
            if self._may_start(owner) and (best is None or
                                           self.running(owner) < self.running(best)):
                best = owner
                if not self.running(owner):
                    break
        if best is None:
            return None
        queue = self._waiting[best]
        item = queue.popleft()
        self._order.remove(best)
        if queue:
            self._order.append(best)  # served: it goes behind the others
        else:
            del self._waiting[best]
        running = self.running(best)
        self.shared_running += running > 0
        self._running[best] = running + 1
        return best, item

    def done(self, owner: Hashable) -> None:
        """One of ``owner``'s running items ended."""
        running = self._running.pop(owner)
        assert running > 0, f"{owner!r} has nothing running"
        self.shared_running -= running > 1
        if running > 1:
            self._running[owner] = running - 1

    def drain(self) -> list[T]:
        """Remove every waiting item; they are returned (oldest of each owner first)."""
        items = [item for queue in self._waiting.values() for item in queue]
        self._waiting.clear()
        self._order.clear()
        return items


_Job = tuple[Future[None], Callable[[], None]]


class _Worker:
    """A serving thread: runs the jobs the server hands it, ends when idle too long."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.job: tuple[Hashable, _Job] | None = None
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="kvfunc-serve")

    def _run(self) -> None:
        while True:
            if not self.wake.wait(IDLE_S) and self.server._retire(self):
                return
            self.wake.clear()
            if self.job is None:  # woken to end (the server shuts down)
                return
            owner, (future, fn) = self.job
            self.job = None
            try:
                fn()
                future.set_result(None)
            except BaseException as exc:  # the future carries it; the thread goes on
                future.set_exception(exc)
            self.server._finished(self, owner)


class Server:
    """Runs the requests of every link of a cluster on threads, scheduled by a
    :class:`FairQueue` (see the module docstring).

    >>> server = Server()
    >>> server.submit("link a", lambda: None).result(timeout=5)
    >>> server.shutdown()
    """

    def __init__(self, shared: int = SHARED_SLOTS, per_link: int = LINK_SHARE) -> None:
        self._queue: FairQueue[_Job] = FairQueue(shared, per_link)
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []  # a stack: the most recently idle is woken first
        self._workers: set[_Worker] = set()
        self._closed = False

    def submit(self, owner: Hashable, fn: Callable[[], None]) -> Future[None]:
        """Queue ``fn`` as a request of ``owner``; its future ends with it (cancel it to
        drop it while it waits).

        Raises:
            RuntimeError: the server was shut down.
        """
        future: Future[None] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the server was shut down")
            self._queue.push(owner, (future, fn))
            self._start_ready()
        return future

    def running(self, owner: Hashable) -> int:
        """How many of ``owner``'s requests run now."""
        with self._lock:
            return self._queue.running(owner)

    def _start_ready(self) -> None:
        """Hand every request that may start now to a thread (under the lock)."""
        while (popped := self._queue.pop()) is not None:
            owner, job = popped
            if not job[0].set_running_or_notify_cancel():  # cancelled while it waited
                self._queue.done(owner)
                continue
            worker = self._idle.pop() if self._idle else _Worker(self)
            worker.job = (owner, job)
            if worker not in self._workers:
                try:
                    worker.thread.start()
                except RuntimeError as exc:  # no thread to be had: this request fails
                    self._queue.done(owner)
                    job[0].set_exception(exc)
                    return
                self._workers.add(worker)
            worker.wake.set()

    def _finished(self, worker: _Worker, owner: Hashable) -> None:
        with self._lock:
            self._queue.done(owner)
            if self._closed:
                self._workers.discard(worker)
                worker.wake.set()  # no job: the thread ends
                return
            self._idle.append(worker)
            self._start_ready()

    def _retire(self, worker: _Worker) -> bool:
        """Whether an idle ``worker`` may end now (it was handed no job meanwhile)."""
        with self._lock:
            if worker.job is not None or worker not in self._idle:
                return False
            self._idle.remove(worker)
            self._workers.discard(worker)
            return True

    def shutdown(self, wait: bool = True) -> None:
        """Stop taking requests, cancel the waiting ones and, with ``wait``, wait for the
        running ones to end."""
        with self._lock:
            self._closed = True
            dropped = self._queue.drain()
            idle, self._idle = self._idle, []
            for worker in idle:
                self._workers.discard(worker)
                worker.wake.set()
            busy = list(self._workers)
        for future, _ in dropped:
            future.cancel()
        if wait:
            for worker in busy:
                if worker.thread is not threading.current_thread():
                    worker.thread.join()
