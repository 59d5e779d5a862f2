"""Start and drive ``peer.py`` processes from a test (bounded waits, always cleaned up)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

PEER = Path(__file__).with_name("peer.py")
POOL = '{"memory_size": 67108864, "page_shift": 12}'


def options(**extra: Any) -> dict[str, Any]:
    """Options of a test cluster: CPU, a 64 MiB pool, loopback, short timeouts."""
    base = {"llm.MemPoolConfig": POOL, "llm.Device": "cpu", "llm.SyncKvCacheWaitTime": 3000}
    return base | extra


class PeerProcess:
    """A cluster in a child process; :meth:`call` sends one command and waits its reply."""

    def __init__(self, role: str, cluster_id: int, opts: dict[str, Any],
                 script: Path = PEER) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self.proc = subprocess.Popen(
            [sys.executable, str(script), role, str(cluster_id), json.dumps(opts)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, env=env)
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            hello = self.lines.get(timeout=60)
        except queue.Empty:
            self.kill()
            raise RuntimeError("the peer process did not start") from None
        host, port = hello["listen"] or (None, None)
        self.address = (host, port)
        self.hello = hello

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            (self.events if "event" in message else self.lines).put(message)

    def call(self, op: str, timeout: float = 30, **args: Any) -> dict[str, Any]:
        """Run one command; its reply (``ok`` False carries ``code`` and ``message``)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self.lines.get(timeout=timeout)

    def ok(self, op: str, timeout: float = 30, **args: Any) -> dict[str, Any]:
        """Run one command that must succeed."""
        reply = self.call(op, timeout, **args)
        assert reply["ok"], reply
        return reply

    def event(self, timeout: float = 30) -> dict[str, Any]:
        """The next unprompted message."""
        return self.events.get(timeout=timeout)

    def signal(self, sig: signal.Signals) -> None:
        """Send a signal (SIGSTOP, SIGCONT, SIGKILL)."""
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """End the process now and reap it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=30)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def close(self) -> None:
        """Ask the process to finalize and exit; kill it if it does not."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"op": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
