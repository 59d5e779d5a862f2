"""The LLM-DataDist guide's samples run against kvfunc.datadist, P and D in two processes.

Each sample (``guide/*.py``) is the guide's code with only the import lines
changed (CPU in place of NPU); its ``user`` lines hand addresses and
go-aheads over and check what arrived.  Both ways of the guide's step 4 run:
the decoder pulls, or the prompt side pushes layer by layer
(``transfer_cache_async`` with ``TransferConfig(DECODER_CLUSTER_ID,
decoder_kv_cache_addrs)``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torch_threads import one_torch_thread  # noqa: F401  (autouse)

GUIDE = Path(__file__).with_name("guide")


def free_port() -> int:
    """A port nothing listens on now (the prompt program listens on it next)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def listening(port: int, proc: subprocess.Popen[str], timeout: float = 60.0) -> bool:
    """Whether ``proc`` listens on ``port`` within ``timeout`` (polled every 50 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            threading.Event().wait(0.05)
    return False


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("sample", ["cache", "blocks"])
def test_guide_sample_runs_unchanged_and_moves_the_right_data(tmp_path: Path, sample: str,
                                                              mode: str) -> None:
    """Both sides of the sample exit 0: every check of what arrived passed, and both ends
    released what they allocated, unlinked and finalized."""
    port = free_port()
    env = dict(os.environ, GUIDE_PORT=str(port), GUIDE_DIR=str(tmp_path),
               GUIDE_MODE=mode, PYTHONPATH=os.pathsep.join([str(GUIDE), *sys.path]))
    procs: dict[str, subprocess.Popen[str]] = {}
    outputs = {}
    try:
        for side in ("prompt", "decoder"):  # the decoder links once the prompt side listens
            procs[side] = subprocess.Popen([sys.executable, str(GUIDE / f"{sample}_{side}.py")],
                                           env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True)
            if side == "prompt":
                assert listening(port, procs[side]), procs[side].communicate(timeout=30)[0]
        for side, proc in procs.items():
            outputs[side] = proc.communicate(timeout=120)[0]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
    assert {"prompt": 0, "decoder": 0} == {s: p.returncode for s, p in procs.items()}, outputs
