"""Handles of moves in flight, and the CPU worker that runs them in order.

A CPU move is a job on a :class:`MoveWorker`: one daemon thread takes jobs
in the order they were queued, and only one job runs at a time (``run``),
so a move always sees the bytes of every move queued before it.  A caller
that waits for a move its worker has not started yet runs the queued jobs
itself, in the same order and under the same rule, up to its own: waiting
right after queueing costs no hand-off to another thread.

A CUDA move is a set of events recorded on a side stream, one per layer;
its handles query and synchronise them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from kvfunc.shell._device import DeviceError

__all__ = ["LayerHandle", "MoveHandle", "MoveWorker"]


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class LayerHandle:
    """Completion of one layer of a move: ``done()`` and ``wait()``."""

    __slots__ = ("_cuda", "_index", "_move")

    def __init__(self, move: MoveHandle, index: int, cuda_event: Any = None) -> None:
        self._move = move
        self._index = index
        self._cuda = cuda_event

    def done(self) -> bool:
        """Whether the layer's blocks are all in place (or the move failed).

        On the CPU an answer of False first lets the worker thread run a
        moment (it gives up the GIL): a loop that polls ``done()`` would
        otherwise hold the GIL and starve the copy it waits for.

        Raises:
            DeviceError: the move failed.
        """
        if self._cuda is not None:
            finished = bool(self._cuda.query())
        else:
            finished = self._move.layers_done > self._index
            if not finished and self._move.worker is not None:
                time.sleep(0)  # the worker's turn
        if finished:
            self._move.raise_error()
        return finished

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the layer's blocks are in place; False if ``timeout`` s passed first.

        Raises:
            DeviceError: the move failed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._cuda is not None:
            finished = self._wait_cuda(deadline)
        else:
            move = self._move
            if move.worker is not None:
                move.worker.help(move, self._index, deadline)
            finished = move.wait_layers(self._index + 1, deadline)
        if finished:
            self._move.raise_error()
        return finished

    def _wait_cuda(self, deadline: float | None) -> bool:
        if deadline is None:
            self._cuda.synchronize()
            return True
        while not self._cuda.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0002)
        return True


class MoveHandle:
    """A move in flight: ``wait()``, ``done()`` and ``layers[i]``, one per layer.

    Made by :class:`~kvfunc.shell.BlockMover`; on the CPU its worker calls
    :meth:`finish_layer` as each layer's blocks land, in order (one lock
    and one count for the whole move, whatever its number of layers):

    >>> h = MoveHandle(2)
    >>> len(h.layers), h.layers[0].done()
    (2, False)
    >>> h.finish_layer(); h.layers[0].done(), h.done(), h.wait_layers(2, time.monotonic())
    (True, False, False)
    >>> h.finish_layer(); h.wait(), h.done(), h.wait_layers(2, None)
    (True, True, True)
    """

    __slots__ = ("_cond", "_error", "layers", "layers_done", "worker")

    def __init__(self, num_layers: int, cuda_events: Sequence[Any] | None = None,
                 worker: MoveWorker | None = None) -> None:
        self._error: BaseException | None = None
        self.worker = worker
        self._cond = threading.Condition(threading.Lock())
        #: layers whose blocks are in place (CPU moves: they finish in order)
        self.layers_done = 0
        events = cuda_events if cuda_events is not None else [None] * num_layers
        self.layers = tuple(LayerHandle(self, i, e) for i, e in enumerate(events))

    def done(self) -> bool:
        """Whether every layer is done.

        Raises:
            DeviceError: the move failed.
        """
        return self.layers[-1].done() if self.layers else True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every layer is done; False if ``timeout`` s passed first.

        Layers finish in order, so this waits for the last one only.

        Raises:
            DeviceError: the move failed.
        """
        return self.layers[-1].wait(timeout) if self.layers else True

    def raise_error(self) -> None:
        """Raise the failure of the move, if it failed."""
        if self._error is not None:
            raise DeviceError(f"moving blocks failed: {self._error}") from self._error

    def finish_layer(self) -> None:
        """The next layer's blocks are in place (the CPU worker's report)."""
        with self._cond:
            self.layers_done += 1
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Record ``error`` and release every waiter."""
        with self._cond:
            self._error = error
            self.layers_done = len(self.layers)
            self._cond.notify_all()

    def wait_layers(self, count: int, deadline: float | None) -> bool:
        """Block until ``count`` layers are done; False if ``deadline`` passed first."""
        if self.layers_done >= count:
            return True
        with self._cond:
            return self._cond.wait_for(lambda: self.layers_done >= count, _left(deadline))


class MoveWorker:
    """Runs jobs one at a time in queue order, on its thread or in a waiting caller's."""

    def __init__(self) -> None:
        self._queue: deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()
        self._run = threading.Lock()  # held while a job runs: one at a time, in order
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name="kvfunc-block-mover")
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job`` (it must not raise)."""
        with self._cond:
            self._queue.append(job)
            self._cond.notify()

    def _run_next(self) -> bool:
        """Run the oldest queued job, if any (False when none); the caller holds ``_run``."""
        with self._cond:
            job = self._queue.popleft() if self._queue else None
        if job is None:
            return False
        job()
        return True

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
            with self._run:
                self._run_next()

    def help(self, move: MoveHandle, layer: int, deadline: float | None) -> None:
        """Run queued jobs in this thread until ``move``'s ``layer`` is done or ``deadline``
        passes.

        While this thread holds ``_run`` no job is running, so the awaited
        job is either done or still queued: running the oldest job brings it
        nearer, and never runs a job before one queued earlier.
        """
        while move.layers_done <= layer:
            left = _left(deadline)
            if not self._run.acquire(timeout=-1 if left is None else left):
                return
            try:
                if move.layers_done > layer or not self._run_next():
                    return  # done, or nothing queued: the job ended without a report
            finally:
                self._run.release()
            if left is not None and _left(deadline) == 0.0:
                return  # the time is up: the waiter reports it

    def stop(self, wait: bool = True) -> None:
        """Run what is queued, then end the thread (and with ``wait``, join it)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()
