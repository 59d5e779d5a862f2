"""kvfunc.vllm's tests need vLLM 0.33 (``bash .ci/vllm-env.sh``); without it they are skipped.

vLLM is imported here once, its import-time deprecation warnings silenced
(the suite turns warnings into errors), so the tests see only their own.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

collect_ignore_glob: list[str] = []

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob.append("test_*.py")
else:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import vllm.config
        import vllm.v1.core.kv_cache_manager
        import vllm.v1.core.sched.async_scheduler
        import vllm.v1.core.sched.scheduler
        import vllm.v1.outputs
        import vllm.v1.structured_output  # noqa: F401
