#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# llama.cpp's CUDA binaries built off the GPU host (`llama-compare-calls.sh prepare-cuda`,
# where nvcc is), unpacked where the host's own build would have put them:
#   bash tools/gpu-host/llama-cpp-unpack.sh ARCHIVE [OUT_DIR]
# ARCHIVE: .llama-cuda/llama-cpp-cuda.tar.xz (bin/: the tools and their shared libraries,
#   RUNPATH $ORIGIN and OUT_DIR/cublas; src/include, src/ggml/include: the C runner's headers).
# OUT_DIR: default /tmp/llama-cpp-cuda, the path they were built for.
# cuBLAS and the CUDA runtime are the host's own (its toolkit's, else the nvidia pip wheels
# beside torch), linked into OUT_DIR/cublas under the names the binaries ask for. Fails,
# naming the library, when one cannot be found: no benchmark starts on a binary that cannot
# load.
set -euo pipefail
archive="$(readlink -f "${1:?ARCHIVE}")"
out="${2:-/tmp/llama-cpp-cuda}"
[ -f "$archive" ] || { echo "no $archive (llama-compare-calls.sh prepare-cuda makes it)" >&2; exit 2; }
xz -t "$archive" || { echo "$archive: not a whole xz archive" >&2; exit 2; }
rm -rf "$out/bin" "$out/cublas" && mkdir -p "$out/cublas"
tar -xJf "$archive" -C "$out"

dirs=()
tk="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")")")"
dirs+=("$tk/lib64" "$tk"/targets/*/lib)
while read -r d; do dirs+=("$d"); done < <(python3 -c 'import glob, os, nvidia
for d in sorted(glob.glob(os.path.join(nvidia.__path__[0], "*", "lib"))): print(d)' 2>/dev/null || true)
needs() { objdump -p "$@" 2>/dev/null | awk '/NEEDED/ && $2 ~ /^libcu(blas|dart)/ {print $2}'; }
queue=($(needs "$out"/bin/lib*.so* "$out"/bin/llama-* | sort -u))
while [ ${#queue[@]} -gt 0 ]; do  # and what those need (cuBLAS needs cuBLASLt), once each
  name=${queue[0]}; queue=("${queue[@]:1}")
  [ -e "$out/cublas/$name" ] && continue
  for d in "${dirs[@]}"; do
    if [ -e "$d/$name" ]; then ln -sf "$d/$name" "$out/cublas/$name"; break; fi
  done
  [ -e "$out/cublas/$name" ] || { echo "$name: in neither $tk nor the nvidia pip wheels" >&2; exit 1; }
  queue+=($(needs "$out/cublas/$name"))
done
missing="$(ldd "$out/bin/llama-bench" "$out/bin/libggml-cuda.so" | awk '/not found/ {print $1}' | sort -u)"
[ -z "$missing" ] || { echo "llama.cpp's binaries cannot load: $missing not found" >&2; exit 1; }
echo "unpacked $(basename "$archive") into $out: $(ls "$out/bin" | tr '\n' ' ')"
