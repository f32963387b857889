#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The llama.cpp side of the comparison with llama.cpp, started by the first device call so
# that it runs while the bundle's parts upload and the stages run:
#   setsid bash tools/gpu-host/llama-side.sh KEEP SRC.tar.xz [MODEL ARGS [-- MODEL ARGS ...]] \
#     > /dev/null 2>&1 < /dev/null &
# KEEP: a folder outside the checkout (every call syncs the checkout again); the tree this
# needs is copied there first. SRC.tar.xz: tools/gpu-host/llama-cpp-source.sh's archive.
# 1. build-llama-cpp-cuda.sh with SHARED=ON: llama-bench, llama-batched-bench,
#    llama-imatrix, llama-server and libllama.so (the llamaacc stage's LLAMA_LIB) in $LLAMA_OUT/bin
#    (default /tmp/llama-cpp-cuda; LLAMA_SRC for the C runner is $LLAMA_OUT/src);
# 2. beside it, benchmarks/glm5_llama_cpp_model.py once per set of MODEL ARGS (sets split
#    by --), one after the other; default: the 2-layer file (--layers 2 --quants Q4_K_M
#    --out /tmp/shaped), then the 3-layer one (--layers 3 --quants Q4_K_M --intermediate
#    q8_0 --out /tmp/shaped3: its bf16 intermediate would not fit the 64 GB disk beside the
#    first) and its q6down variant (layer 1's down projections at Q6_K, as Q4_K_M gives the
#    2-layer file's MoE layer), the files of benchmarks/glm5_vs_llama_cpp.py --per-layer
#    (2L -> 3L: a Q4_K MoE layer; 2L -> 3L q6down: a Q4_K/Q6_K one); each checkpoint, and
#    the 3-layer intermediate, in /dev/shm. An importance matrix (IQ2_M) waits for the build's
#    llama-imatrix (KEEP/llama-imatrix). SETS=2L: the 2-layer file alone, so that the
#    comparison on it runs with the CPUs free (the 3-layer conversion loads every core);
#    SETS=none: no file (serve-calls.sh writes its own). BUILD=0: no build either.
#    BUILT=ARCHIVE: no build, the binaries of `llama-compare-calls.sh prepare-cuda` instead
#    (llama-cpp-unpack.sh: seconds, where the build takes 364-426 s of the call's CPUs).
# Each ends its log with "rc=N": KEEP/build.log, KEEP/model.log (after every set, its
# "set K rc=N" line). The .llama-cpp/ tree (the
# converter and a llama-quantize) comes from VLLM_OVERLAY_LLAMA_CPP and
# VLLM_OVERLAY_LLAMA_QUANTIZE, as for the GGUF stages. GGML_CUDA=OFF builds for the CPU.
set -uo pipefail
keep="$(mkdir -p "${1:?KEEP dir}" && cd "$1" && pwd)"; src="$(readlink -f "${2:?SRC.tar.xz}")"
shift 2
here="$(cd "$(dirname "$0")/../.." && pwd)"
out="${LLAMA_OUT:-/tmp/llama-cpp-cuda}"
two=(--layers 2 --quants Q4_K_M --out /tmp/shaped --work-dir /dev/shm/shaped-work)
three=(--layers 3 --quants Q4_K_M --intermediate q8_0 --out /tmp/shaped3
  --work-dir /dev/shm/shaped-work3 --intermediate-dir /dev/shm/shaped-inter3
  --variant 'q6down:blk\.1\.ffn_down=q6_k')
case "${SETS:-2L 3L}" in  # without MODEL ARGS: SETS=2L makes the 2-layer file alone
  "2L 3L") [ $# -gt 0 ] || set -- "${two[@]}" -- "${three[@]}" ;;
  2L) [ $# -gt 0 ] || set -- "${two[@]}" ;;
  none) set -- ;;  # the build alone
  *) echo "SETS: \"2L 3L\", 2L or none" >&2; exit 2 ;;
esac

tree="$keep/tree"
rm -rf "$tree" && mkdir -p "$tree"
(cd "$here" && cp -r build.py upstream.lock tools benchmarks tests "$tree/")

cat > "$keep/llama-imatrix" <<EOF
#!/usr/bin/env bash
# the build's llama-imatrix, once the build beside the model's conversion has finished
while ! grep -q "^rc=" "$keep/build.log" 2>/dev/null; do sleep 5; done
lib=""  # cuBLAS from the pip wheels, where build-llama-cpp-cuda.sh had to take it from there
[ -e "$out/cublas/libcublas.so" ] && lib=":\$(dirname "\$(readlink -f "$out/cublas/libcublas.so")")"
export LD_LIBRARY_PATH="$out/bin\$lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$out/bin/llama-imatrix" "\$@"
EOF
chmod +x "$keep/llama-imatrix"

if [ "${BUILD:-1}" = 0 ]; then  # no build: a device session that runs no llama.cpp binary
  echo "no build (BUILD=0)"$'\n'"rc=skipped" > "$keep/build.log"
elif [ -n "${BUILT:-}" ]; then  # built where nvcc is (llama-compare-calls.sh prepare-cuda)
( bash "$tree/tools/gpu-host/llama-cpp-unpack.sh" "$BUILT" "$out" > "$keep/build.log" 2>&1
  echo "rc=$?" >> "$keep/build.log" )
else
( SHARED=ON TARGETS="llama-bench llama-batched-bench llama-imatrix llama-server" \
    bash "$tree/tools/gpu-host/build-llama-cpp-cuda.sh" "$src" "$out" > "$keep/build.log" 2>&1
  echo "rc=$?" >> "$keep/build.log" ) &
fi
models() {  # each set of model args in turn; rc: the first failure's
  local rc=0 k=0 one=()
  for a in "$@" --; do
    if [ "$a" != "--" ]; then one+=("$a"); continue; fi
    k=$((k + 1))
    (cd "$tree" && PYTHONUNBUFFERED=1 python3 -m benchmarks.glm5_llama_cpp_model \
        --llama-imatrix "$keep/llama-imatrix" "${one[@]}")
    r=$?; echo "set $k rc=$r"; [ $rc -ne 0 ] || rc=$r; one=()
  done
  return $rc
}
: > "$keep/model.log"
if [ $# -gt 0 ]; then
  (models "$@" >> "$keep/model.log" 2>&1; echo "rc=$?" >> "$keep/model.log")
else
  echo "rc=0" >> "$keep/model.log"
fi
wait
