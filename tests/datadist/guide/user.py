"""The user's side of the guide's samples: settings, the model, and the hand-over between
the two processes (the guide leaves each to the user).

Settings come from the environment the test sets: ``GUIDE_PORT`` (the
prompt cluster's port), ``GUIDE_DIR`` (a directory both processes share to
hand over addresses and readiness) and ``GUIDE_MODE`` (``pull`` or
``push``: the two ways of the guide's step 4).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import torch

PROMPT_CLUSTER_ID = 0
DECODER_CLUSTER_ID = 1
DEVICE_ID = 0
PROMPT_IP = "127.0.0.1"
DECODER_IP = "127.0.0.1"
PROMPT_PORT = int(os.environ.get("GUIDE_PORT", "26000"))
MODE = os.environ.get("GUIDE_MODE", "pull")
POOL_BYTES = str(64 << 20)  # ge.flowGraphMemMaxSize
_DIR = Path(os.environ.get("GUIDE_DIR", "."))


def expected(shape: list[int], tensor: int) -> torch.Tensor:
    """What the model computes into tensor ``tensor`` of a cache of ``shape``."""
    numel = 1
    for d in shape:
        numel *= d
    return ((torch.arange(numel) % 1000) + 1000 * (tensor + 1)).to(torch.float16).view(shape)


class Model:
    """The user's model: writes each layer's K and V, then records that layer's event."""

    def Predict(self, kv_tensors: list[torch.Tensor],
                events: list[Any] | None = None) -> None:
        def run() -> None:
            for i, t in enumerate(kv_tensors):
                t.copy_(expected(list(t.shape), i))
                if events is not None and i % 2 == 1:
                    events[i // 2].record()
        if events is None:
            run()
        else:  # the model runs on while the push waits for each layer
            threading.Thread(target=run, daemon=True).start()


user_model = Model()


def put(name: str, value: Any) -> None:
    """Hand ``value`` to the other process."""
    tmp = _DIR / f".{name}.tmp"
    tmp.write_text(json.dumps(value))
    tmp.rename(_DIR / name)


def get(name: str, timeout: float = 60.0) -> Any:
    """Wait (bounded) for what the other process handed over as ``name``."""
    path, done = _DIR / name, threading.Event()
    for _ in range(int(timeout / 0.01)):
        if path.exists():
            return json.loads(path.read_text())
        done.wait(0.01)
    raise TimeoutError(f"{name} never came")
