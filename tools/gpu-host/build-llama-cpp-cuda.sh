#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Build llama.cpp with CUDA from the pinned llama-cpp-python sdist's vendored source,
# offline, for the GGUF-vs-llama.cpp benchmark (benchmarks/glm5_vs_llama_cpp.py).
#
#   bash tools/gpu-host/build-llama-cpp-cuda.sh [SDIST] [OUT_DIR]
#
# SDIST: llama_cpp_python-<pin>.tar.gz, the pin of
#   tests/models/quantization/gguf_reference.py LLAMA_CPP_PYTHON (checked by sha256 here).
#   Default: $VLLM_OVERLAY_CACHE/upstream/<file>, else ~/.cache/vllm-overlay/upstream/<file>,
#   where build.py's fetch caches it (the first `python -m pytest tests` or any
#   gguf_reference.llama_cpp_dir() call downloads it on a machine with network).
#   The GPU host has no network: carry the source. The sdist is 73 MiB, more than one
#   device call carries (64 MiB); tools/gpu-host/llama-cpp-source.sh cuts what the build
#   needs out of it (6 MiB, xz-checked), and SDIST may name that archive instead.
#   Nothing is downloaded: every FetchContent path (BoringSSL/LibreSSL, CCCL, the
#   prebuilt web UI) is switched off.
# OUT_DIR: the build tree; the binaries end in OUT_DIR/bin (default /tmp/llama-cpp-cuda).
#
# Environment:
#   GGML_CUDA=ON|OFF          (default ON; OFF builds the same tools for the CPU, e.g. to
#                              check this recipe on a machine without nvcc)
#   CUDA_ARCHS=90             CMAKE_CUDA_ARCHITECTURES (H200: 90; SM120: 120a-real)
#   TARGETS="..."             default: llama-bench llama-cli llama-server llama-imatrix
#                              (llama-imatrix: IQ2_M needs an importance matrix, see
#                              benchmarks/glm5_llama_cpp_model.py)
#   JOBS=N                    parallel compile jobs (default: nproc)
#   SHARED=ON|OFF             (default OFF) ON links ggml and llama as shared libraries
#                              (copied to OUT_DIR/bin too): one copy of the CUDA code for
#                              every tool, small enough to carry to the GPU host
#   EXTRA_CMAKE="..."         more cmake -D flags, e.g. where cuBLAS lives on a machine
#                              whose CUDA toolkit lacks it (-DCUDA_cublas_LIBRARY=...)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
read -r SDIST_NAME SDIST_SHA < <(cd "$ROOT" && python3 -c "
from tests.models.quantization import gguf_reference as g; print(*g.LLAMA_CPP_PYTHON[1:])")
CACHE="${VLLM_OVERLAY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-overlay}/upstream"
SDIST="${1:-$CACHE/$SDIST_NAME}"
OUT="${2:-/tmp/llama-cpp-cuda}"
GGML_CUDA="${GGML_CUDA:-ON}"
CUDA_ARCHS="${CUDA_ARCHS:-90}"
TARGETS="${TARGETS:-llama-bench llama-cli llama-server llama-imatrix}"
JOBS="${JOBS:-$(nproc)}"
SHARED="${SHARED:-OFF}"

[ -f "$SDIST" ] || { echo "no sdist at $SDIST (carry $SDIST_NAME; see the header)" >&2; exit 2; }
if [ "${SDIST%.tar.xz}" = "$SDIST" ]; then
    got="$(sha256sum "$SDIST" | cut -d' ' -f1)"
    [ "$got" = "$SDIST_SHA" ] || { echo "$SDIST: sha256 $got, the pin is $SDIST_SHA" >&2; exit 2; }
else
    xz -t "$SDIST" || { echo "$SDIST: not a whole xz archive" >&2; exit 2; }
fi
for tool in cmake ninja; do
    command -v "$tool" >/dev/null || { echo "needs $tool" >&2; exit 2; }
done
if [ "$GGML_CUDA" = ON ]; then
    command -v nvcc >/dev/null || { echo "GGML_CUDA=ON needs nvcc on PATH" >&2; exit 2; }
fi

SRC="$OUT/src"
prefix="${SDIST_NAME%.tar.gz}/vendor/llama.cpp"
if [ ! -f "$SRC/.complete" ]; then
    rm -rf "$SRC" && mkdir -p "$SRC"
    if [ "${SDIST%.tar.xz}" = "$SDIST" ]; then
        tar -xzf "$SDIST" -C "$SRC" --strip-components=3 "$prefix"
    else
        tar -xJf "$SDIST" -C "$SRC" --strip-components=1 llama.cpp
    fi
    touch "$SRC/.complete"
fi

flags=(
    -G Ninja -DCMAKE_BUILD_TYPE=Release
    -DGGML_CUDA="$GGML_CUDA" -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS="$SHARED"
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_BORINGSSL=OFF -DLLAMA_BUILD_LIBRESSL=OFF
    -DGGML_CUDA_CUB_3DOT2=OFF
    -DFETCHCONTENT_FULLY_DISCONNECTED=ON
    -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON  # bin/ finds its libraries wherever it is copied
)
[ "$GGML_CUDA" = ON ] && flags+=(-DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCHS")
# A toolkit without cuBLAS (some images carry nvcc and the runtime only): the cuBLAS of
# the pip wheels beside torch (nvidia-cublas), and the driver's libcuda for the stub.
if [ "$GGML_CUDA" = ON ]; then
    tk="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
    if ! compgen -G "$tk/lib64/libcublas.so*" >/dev/null \
            && ! compgen -G "$tk/targets/*/lib/libcublas.so*" >/dev/null; then
        lib="$(python3 -c 'import glob, nvidia, os
print(os.path.dirname(sorted(glob.glob(os.path.join(nvidia.__path__[0], "*", "lib",
                                                    "libcublas.so.*")))[0]))' 2>/dev/null)" \
            || { echo "no cuBLAS in $tk nor in the nvidia pip wheels" >&2; exit 2; }
        mkdir -p "$OUT/cublas/include"
        cp -p "${lib%/lib}"/include/cublas*.h "$OUT/cublas/include/"  # -p: no rebuild on a rerun
        ln -sf "$lib"/libcublas.so.* "$OUT/cublas/libcublas.so"
        ln -sf "$lib"/libcublasLt.so.* "$OUT/cublas/libcublasLt.so"
        # and under their sonames, for the tools' link (ld finds ggml-cuda's needs there)
        ln -sf "$lib"/libcublas.so.* "$lib"/libcublasLt.so.* "$OUT/cublas/"
        flags+=(-DCUDA_cublas_LIBRARY="$OUT/cublas/libcublas.so"
                -DCUDA_cublasLt_LIBRARY="$OUT/cublas/libcublasLt.so"
                -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$OUT/cublas"
                -DCMAKE_CUDA_FLAGS="-I$OUT/cublas/include" -DCMAKE_CXX_FLAGS="-I$OUT/cublas/include")
        echo "cuBLAS from $lib (run with LD_LIBRARY_PATH=$lib)"
    fi
    if ! compgen -G "$tk/lib64/stubs/libcuda.so" >/dev/null \
            && ! compgen -G "$tk/targets/*/lib/stubs/libcuda.so" >/dev/null; then
        drv="$(ldconfig -p | awk '/libcuda\.so\.1 /{print $NF; exit}')"
        [ -n "$drv" ] || drv="$(compgen -G "/usr/local/nvidia/lib*/libcuda.so.1" | head -1 || true)"
        if [ -z "$drv" ]; then  # no driver (a machine without a GPU): a link stub of the
            # driver functions ggml-cuda calls; the GPU host's libcuda.so.1 is loaded at run time
            mkdir -p "$OUT/cuda-stub"
            grep -rhoE '\bcu[A-Z][a-z][A-Za-z0-9_]*\s*\(' "$SRC/ggml/src/ggml-cuda" \
                | sed -E 's/\s*\($//' | sort -u | sed 's/.*/int &(void) { return 999; }/' \
                > "$OUT/cuda-stub/stub.c"
            cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$OUT/cuda-stub/libcuda.so" \
                "$OUT/cuda-stub/stub.c"
            ln -sf libcuda.so "$OUT/cuda-stub/libcuda.so.1"  # the name the tools' link looks for
            drv="$OUT/cuda-stub/libcuda.so"
            echo "libcuda: a link stub of $(grep -c '' "$OUT/cuda-stub/stub.c") driver functions"
        fi
        flags+=(-DCUDA_cuda_driver_LIBRARY="$drv")
    fi
fi
# shellcheck disable=SC2206
[ -n "${EXTRA_CMAKE:-}" ] && flags+=($EXTRA_CMAKE)

start=$(date +%s)
cmake -S "$SRC" -B "$OUT/build" "${flags[@]}" >"$OUT/cmake.log" 2>&1 \
    || { tail -40 "$OUT/cmake.log" >&2; exit 1; }
# shellcheck disable=SC2086
cmake --build "$OUT/build" --target $TARGETS -j "$JOBS" >"$OUT/build.log" 2>&1 \
    || { tail -60 "$OUT/build.log" >&2; exit 1; }
mkdir -p "$OUT/bin"
for t in $TARGETS; do
    cp "$OUT/build/bin/$t" "$OUT/bin/$t"
done
if [ "$SHARED" = ON ]; then
    cp -P "$OUT"/build/bin/lib*.so* "$OUT/bin/"
fi
echo "built $TARGETS (GGML_CUDA=$GGML_CUDA, CUDA archs $CUDA_ARCHS) in $(( $(date +%s) - start )) s: $OUT/bin"
