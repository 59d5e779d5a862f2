#!/usr/bin/env bash
# Lay out vLLM's own tests/v1/core (and the two helper modules they import), unmodified,
# from vLLM's source distribution, with hand-made model configs for them to read offline.
#
#   bash .ci/vllm-tests.sh DEST       # DEST/tests/... and DEST/hf (an HF_HOME)
#
# The wheel has no tests; the sdist has them at exactly the released version. pip
# prepares the sdist's metadata before saving it, so vLLM's setup.py gets what it imports,
# an empty target device and the plain version. Nothing is built.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="${1:?usage: bash .ci/vllm-tests.sh DEST}"
VER="${VLLM_VERSION:-0.33.0}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python -m pip install --quiet --target "$tmp/bd" setuptools_scm setuptools_rust
PYTHONPATH="$tmp/bd" VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE="$VER" \
    python -m pip download --quiet --no-deps --no-build-isolation --no-binary :all: \
    "vllm==$VER" -d "$tmp"
tar xzf "$tmp/vllm-$VER.tar.gz" -C "$tmp" "vllm-$VER/tests"
S="$tmp/vllm-$VER/tests"
rm -rf "$DEST/tests"
mkdir -p "$DEST/tests/v1/kv_connector/unit"
cp "$S/__init__.py" "$DEST/tests/" && cp "$S/v1/__init__.py" "$DEST/tests/v1/"
cp -r "$S/v1/core" "$DEST/tests/v1/"
cp "$S/v1/kv_connector/__init__.py" "$DEST/tests/v1/kv_connector/"
cp "$S/v1/kv_connector/unit/__init__.py" "$S/v1/kv_connector/unit/utils.py" \
    "$DEST/tests/v1/kv_connector/unit/"
python "$ROOT/.ci/vllm_hf_configs.py" "$DEST/hf"
echo "vLLM $VER tests under $DEST/tests: $(find "$DEST/tests" -name 'test_*.py' | wc -l) files"
