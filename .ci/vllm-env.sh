#!/usr/bin/env bash
# vLLM 0.33 on CPU, into the active Python environment (kvfunc installed with -e already).
#
#   bash .ci/vllm-env.sh
#
# vLLM's wheel pins a CUDA build of torch and GPU kernels: it is installed without its
# dependency set, next to the CPU torch already there, and kvfunc's "vllm" extra adds what
# vLLM's scheduler imports. The check at the end imports the scheduler.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
python -m pip install --quiet --no-deps "vllm==$VLLM_VERSION"
python -m pip install --quiet -e ".[vllm]"
VLLM_TARGET_DEVICE=cpu python - <<'PY'
import torch, vllm
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
print("vLLM", vllm.__version__, "with torch", torch.__version__)
PY
