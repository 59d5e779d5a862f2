"""A Mooncake Store on loopback for tests: ``mooncake_master`` and a memory lender.

Both are the binaries the ``mooncake`` wheel ships, started on free ports of
127.0.0.1 and stopped by :meth:`MooncakeServers.stop` (always called by the
fixtures).  The master serves the HTTP metadata too; the lender
(``mooncake_client``) lends the store its memory, so the client under test
lends none, as an engine's would not.  Readiness is each process accepting
connections on its port, waited for within a deadline.
"""

from __future__ import annotations

import contextlib
import importlib.util
import signal
import socket
import subprocess
import time
from pathlib import Path

START_TIMEOUT_S = 30.0
SEGMENT = "64MB"


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on (the OS's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def binary(name: str) -> str:
    """The path of one of the wheel's binaries (``mooncake_master``, ``mooncake_client``)."""
    spec = importlib.util.find_spec("mooncake")
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / name
    assert path.exists(), f"{path} is missing from the mooncake wheel"
    return str(path)


def wait_listening(proc: subprocess.Popen[bytes], port: int, what: str) -> None:
    """Return once ``port`` accepts connections; raise if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)  # the process is still starting: poll its port again
    raise RuntimeError(f"{what} did not listen on port {port} within {START_TIMEOUT_S} s")


class MooncakeServers:
    """A master (RPC + HTTP metadata) and a lender of ``SEGMENT`` bytes, logs in ``log_dir``."""

    def __init__(self, log_dir: Path, *, lender: bool = True) -> None:
        self.rpc_port, self.http_port = free_port(), free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        try:
            self.master = self._start("master", [
                binary("mooncake_master"), "-rpc_address=127.0.0.1",
                f"-rpc_port={self.rpc_port}", "-enable_http_metadata_server=true",
                "-http_metadata_server_host=127.0.0.1",
                f"-http_metadata_server_port={self.http_port}", f"-metrics_port={free_port()}",
                "-rpc_thread_num=2", "-default_kv_lease_ttl=1000"])
            wait_listening(self.master, self.rpc_port, "mooncake_master")
            wait_listening(self.master, self.http_port, "the metadata server")
            if lender:
                port = free_port()
                proc = self._start("lender", [
                    binary("mooncake_client"), f"-master_server_address={self.master_address}",
                    f"-metadata_server={self.metadata_server}", "-host=127.0.0.1",
                    f"-port={port}", f"-global_segment_size={SEGMENT}",
                    "-local_buffer_size=0"])
                wait_listening(proc, port, "mooncake_client")
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with open(self.log_dir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    @property
    def master_address(self) -> str:
        """``127.0.0.1:<rpc port>``."""
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        """The master's HTTP metadata URL."""
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def kill_master(self) -> None:
        """Kill the master at once (SIGKILL) and reap it."""
        self.master.kill()
        self.master.wait(timeout=10)

    def pause_master(self) -> None:
        """Stop the master (SIGSTOP): it keeps its sockets but answers nothing."""
        self.master.send_signal(signal.SIGSTOP)

    def resume_master(self) -> None:
        """Let a paused master run again (SIGCONT)."""
        self.master.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Kill every process started here and reap it (idempotent)."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            proc.wait(timeout=10)
        self.procs = []
