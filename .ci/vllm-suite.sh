#!/usr/bin/env bash
# vLLM's own tests/v1/core, unmodified, with kvfunc as the KV cache manager (KVFUNC_VLLM=1,
# through kvfunc's vLLM plugin): the tests listed in tests/on_vllm/targets/*.txt. Any failure,
# or a test that built no kvfunc manager, fails the run.
#
#   bash .ci/vllm-suite.sh [DEST]      # DEST as laid out by .ci/vllm-tests.sh (.vllm-tests)
#   KVFUNC_VLLM=shadow bash .ci/vllm-suite.sh       # the same tests in shadow mode
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="$(cd "${1:-$ROOT/.vllm-tests}" && pwd)"
mapfile -t ids < <(cat "$ROOT"/tests/on_vllm/targets/*.txt)
cd "$DEST"
KVFUNC_VLLM="${KVFUNC_VLLM:-1}" VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 HF_HOME="$DEST/hf" \
    PYTHONPATH="$ROOT/tests/on_vllm${PYTHONPATH:+:$PYTHONPATH}" \
    python -m pytest -c "$ROOT/tests/on_vllm/vllm-suite.ini" --rootdir "$DEST" \
    -p kvfunc_vllm_suite -p no:cacheprovider -q \
    --kvfunc-report="$DEST/kvfunc-report.json" "${ids[@]}"
