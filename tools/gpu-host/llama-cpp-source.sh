#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The part of llama.cpp's source that build-llama-cpp-cuda.sh builds from, cut out of
# the pinned llama-cpp-python sdist (sha256-checked) into one archive small enough for
# a device call: vendor/llama.cpp without models/ (vocabularies), docs/, media/,
# benches/ and CI files.
#
#   bash tools/gpu-host/llama-cpp-source.sh [SDIST] OUT.tar.xz
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
read -r SDIST_NAME SDIST_SHA < <(cd "$ROOT" && python3 -c "
from tests.models.quantization import gguf_reference as g; print(*g.LLAMA_CPP_PYTHON[1:])")
CACHE="${VLLM_OVERLAY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-overlay}/upstream"
if [ $# -ge 2 ]; then SDIST="$1"; OUT="$2"; else SDIST="$CACHE/$SDIST_NAME"; OUT="${1:?OUT.tar.xz}"; fi
got="$(sha256sum "$SDIST" | cut -d' ' -f1)"
[ "$got" = "$SDIST_SHA" ] || { echo "$SDIST: sha256 $got, the pin is $SDIST_SHA" >&2; exit 2; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
prefix="${SDIST_NAME%.tar.gz}/vendor/llama.cpp"
tar -xzf "$SDIST" -C "$work" "$prefix"
tar -cJf "$OUT.partial" -C "$work/${prefix%/llama.cpp}" \
    --exclude=llama.cpp/models --exclude=llama.cpp/docs --exclude=llama.cpp/media \
    --exclude=llama.cpp/benches --exclude=llama.cpp/.github llama.cpp
mv "$OUT.partial" "$OUT"
echo "$OUT: $(du -h "$OUT" | cut -f1)"
