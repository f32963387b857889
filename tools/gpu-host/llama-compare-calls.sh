#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The comparison with llama.cpp on the GPU host in a few device calls (docs/gpu-host.md, step 4),
# as the GPU runs made it. Here, once:
#   python build.py wheel; the bundle (the command at the top of gpu-checks.sh, into .bundle);
#   bash tools/gpu-host/llama-compare-calls.sh prepare
#     .llama-src/llama-cpp-src.tar.xz (llama-cpp-source.sh) and .llama-bin/llama-cpp.tar.xz (the
#     converter tree and a CPU llama-quantize with its libraries, from gguf_reference.py).
#   bash tools/gpu-host/llama-compare-calls.sh prepare-cuda   (optional; needs nvcc here)
#     .llama-cuda/llama-cpp-cuda.tar.xz: llama.cpp's CUDA tools (CUDA_ARCHS, default 90),
#     built here for /tmp/llama-cpp-cuda; carried by `first`, it replaces the host's build.
# Then one device call each, back to back (the machine goes 30 s after a call returns):
#   first       carry .bundle/part-05 .bundle/SHA256SUMS .bundle/install.sh .llama-src .llama-bin
#               (.llama-cuda in place of .llama-src, if made: 41 MiB, the call's 64 MiB allow
#               only one of the two beside part-05, and barely: docs/gpu-host.md; where they
#               do not fit, leave part-05 out and send `part 5` in a call of its own):
#               unpacks them outside the checkout, starts llama-side.sh (CUDA build; the 2- and
#               3-layer Q4_K_M files; SETS=2L: the 2-layer one alone)
#   part N      carry .bundle/part-0N, for N in 0 1 2 3 4 (and 5 where `first` left it out)
#   stages      gpu-checks.sh's stages: install; the Marlin MoE GPU tests (or the files in
#               MARLIN_TESTS; MARLIN_S seconds; MARLIN_S=0 skips them); ggufops, the
#               MoE kernel benchmark (MOE_TYPES, MOE_TOKENS, MOE_BM, MOE_S seconds; MOE_S=0
#               skips it; OPS_ARGS: the benchmark's arguments instead) while llama.cpp
#               builds; then llamaacc, the accuracy stage (ACC_PATHS, ACC_ROUND; ACC_S
#               seconds, ACC_S=0 skips it and `compare` starts at once), detached so that
#               the call's end does not cut it
#   compare 2L  (then compare 3L, compare 3Lq6) waits for the accuracy stage and the file,
#               runs glm5_vs_llama_cpp.py (PATHS_VS, REPS, BATCHES; PROFILE=1: both sides profiled
#               (the overlay with the CPU us of vLLM's host sections a step),
#               NCU, the decode steps at each of PROFILE_BATCH's sequences, default 1;
#               PROMPTS and DEPTHS: the benchmark's, default "512 8192" and "0 8192"), and
#               --per-layer for 2L against each 3-layer report present (3L adds a Q4_K
#               MoE layer, 3Lq6 a Q4_K/Q6_K one, as the 2-layer file's); with
#               MORE=1, PATHS_VS against the llama.cpp figures of the call before
#               (--llama-from; reports $which-more.*), where one call's time ran out;
#               QUIET=1 waits for the whole llama side first (with SETS=2L, no wait): the
#               3-layer file's conversion loads every CPU core, and vLLM's host work a step
#               with them (each row's load average is in the report)
#   long tiny   (then long selfcheck, long whole) the crash matrix on the tiny GLM-5's
#               files, the 2-layer file with vLLM's defaults (see the case below)
#   deep        (issue 69) starts writing synthetic GLM-5-shaped Q4_K_M files of DEEP_LAYERS
#               layers (default "2 10"; 10: 51 GiB; vllm_gguf_plugin.gguf_model.synthetic)
#               where syn_file puts them, detached; then `compare syn2`, `compare syn10` (as 2L,
#               once every file is written), and after the last one --depth-model over
#               every synN report (the whole GLM-5 projected from them)
# Reports go to the device tool's $OUT; CALL_S bounds a call (default 585 s).
set -uo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
keep=/tmp/keep
cd "$here"

env_() {  # the trees `first` unpacked, and the installed bundle
  export VLLM_OVERLAY_LLAMA_CPP=/tmp/llama-cpp VLLM_OVERLAY_LLAMA_QUANTIZE=/tmp/llama-cpp/bin/llama-quantize
  export VLLM_OVERLAY_LLAMA_IMATRIX=$keep/llama/llama-imatrix
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 TVM_FFI_DISABLE_TORCH_C_DLPACK=1 VLLM_USE_FLASHINFER_SAMPLER=0
  # shellcheck disable=SC1091
  [ -f /tmp/site/env.sh ] && source /tmp/site/env.sh
  return 0
}
report_plugin() {  # the capability test hook: the as-on-SM120/SM80 paths, and the portable
  # ones (no DeepGEMM reported, so that the indexer takes its Triton kernels)
  python3 -c "import vllm_report_capability" 2> /dev/null || pip install -q --no-deps \
    --no-build-isolation --target /tmp/site tests/plugins/vllm_report_capability \
    > /dev/null 2>&1 || echo "no capability plugin" >&2
}
where() {  # one line on the llama.cpp side's progress
  echo "== $(date +%T) build: $(tail -1 $keep/llama/build.log 2>/dev/null)" \
    "| files: $(grep -E 'rc=' $keep/llama/model.log 2>/dev/null | tr '\n' ' ')"
  ls -la /tmp/shaped /tmp/shaped3 2>/dev/null | grep gguf; df -h /tmp /dev/shm | tail -2
}
need_side() {  # a machine given back between calls comes back bare: stop, do not wait
  [ -f $keep/llama/model.log ] && return 0
  echo "no llama.cpp side on this machine ($keep/llama): it was given back since \`first\`;" \
    "start again from \`first\` and the parts" >&2
  exit 3
}
syn_file() {  # `deep`'s file of $1 layers: the disk (64 GB) holds the 10-layer one (55 GB) alone
  if [ "$1" -le 3 ]; then echo /dev/shm/syn/glm5-synthetic-$1L.gguf; else echo /tmp/syn/glm5-synthetic-$1L.gguf; fi
}
out="${OUT:-/tmp/out}"
call_s="${CALL_S:-585}"

case "${1:?prepare|prepare-cuda|first|part N|stages|compare 2L|3L|3Lq6|synN|long tiny|whole|deep}" in
  prepare)
    mkdir -p .llama-src .llama-bin
    bash tools/gpu-host/llama-cpp-source.sh .llama-src/llama-cpp-src.tar.xz || exit 1
    tree="$(mktemp -d)"
    python3 - "$tree" <<'EOF' || exit 1
import shutil, sys
from pathlib import Path
from tests.models.quantization import gguf_reference as g
tree = Path(sys.argv[1])
shutil.copytree(g.llama_cpp_dir(tree / "src"), tree / "llama-cpp")
bins = g.llama_quantize().parent
(tree / "llama-cpp" / "bin").mkdir()
for f in [bins / "llama-quantize", *bins.glob("lib*.so*")]:
    shutil.copy2(f, tree / "llama-cpp" / "bin", follow_symlinks=False)
EOF
    tar -cJf .llama-bin/llama-cpp.tar.xz.partial -C "$tree/llama-cpp" . \
      && mv .llama-bin/llama-cpp.tar.xz.partial .llama-bin/llama-cpp.tar.xz
    rm -rf "$tree"
    ls -la .llama-src .llama-bin ;;
  prepare-cuda)  # where nvcc is: the CUDA build that `first` would start, done here
    o=/tmp/llama-cpp-cuda  # where the host runs it: the binaries' RUNPATH names its cublas/
    SHARED=ON TARGETS="llama-bench llama-batched-bench llama-imatrix llama-server" \
      bash tools/gpu-host/build-llama-cpp-cuda.sh .llama-src/llama-cpp-src.tar.xz $o || exit 1
    mkdir -p .llama-cuda
    tar -cJf .llama-cuda/llama-cpp-cuda.tar.xz.partial -C $o bin src/include src/ggml/include \
      && mv .llama-cuda/llama-cpp-cuda.tar.xz.partial .llama-cuda/llama-cpp-cuda.tar.xz
    ls -la .llama-cuda ;;
  first)
    mkdir -p /tmp/parts $keep/llama /tmp/llama-cpp
    cp .bundle/SHA256SUMS .bundle/install.sh /tmp/parts/ || exit 1
    [ -f .bundle/part-05 ] && cp .bundle/part-05 /tmp/parts/  # else `part 5` brings it
    tar -xJf .llama-bin/llama-cpp.tar.xz -C /tmp/llama-cpp || exit 1
    built=()  # prepare-cuda's binaries, carried: no build on the host, no source needed
    if [ -f .llama-cuda/llama-cpp-cuda.tar.xz ]; then
      cp .llama-cuda/llama-cpp-cuda.tar.xz $keep/ || exit 1
      built=(BUILT=$keep/llama-cpp-cuda.tar.xz)
    else
      cp .llama-src/llama-cpp-src.tar.xz $keep/ || exit 1
    fi
    env_
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    /tmp/llama-cpp/bin/llama-quantize --help 2>&1 | head -1
    setsid env "${built[@]}" bash tools/gpu-host/llama-side.sh $keep/llama $keep/llama-cpp-src.tar.xz \
      > /dev/null 2>&1 < /dev/null &
    sleep 10; where ;;
  part)
    cp ".bundle/part-0${2:?part number}" /tmp/parts/ && ls /tmp/parts && where ;;
  stages)
    need_side; env_; where
    bash tools/gpu-host/gpu-checks.sh /tmp/parts $keep/checks install > $keep/install.log 2>&1 \
      || { tail -20 $keep/install.log; exit 1; }
    env_; mkdir -p "$out/moe"
    if [ "${MARLIN_S:-150}" != 0 ]; then
      # shellcheck disable=SC2086
      timeout "${MARLIN_S:-150}" python3 -m pytest ${MARLIN_TESTS:-tests/models/quantization/test_gguf_moe_marlin.py} -m gpu -v \
        -p no:cacheprovider -p no:warnings > "$out/moe/marlin-tests.log" 2>&1
      echo "marlin tests rc=$?"; grep -cE "PASSED|FAILED" "$out/moe/marlin-tests.log"; tail -3 "$out/moe/marlin-tests.log"
    fi
    [ "${MOE_S:-200}" = 0 ] || GGUF_OPS_TIMEOUT="${MOE_S:-200}" GGUF_OPS_ARGS="${OPS_ARGS:---ops moe \
--types ${MOE_TYPES:-Q4_K Q4_K/Q6_K} --tokens ${MOE_TOKENS:-8 32 64} --triton-block-m ${MOE_BM:-16}}" \
      bash tools/gpu-host/gpu-checks.sh /tmp/parts "$out/moe" ggufops
    echo "moe rc=$?"
    [ "${ACC_S:-900}" = 0 ] && { where; exit 0; }
    while ! grep -q "^rc=" $keep/llama/build.log; do sleep 5; done; where
    mkdir -p $keep/acc
    cat > $keep/acc/run.sh <<EOF
LLAMA_LIB=/tmp/llama-cpp-cuda/bin LLAMA_RUNNER=c LLAMA_SRC=/tmp/llama-cpp-cuda/src \\
LLAMAACC_TIMEOUT=${ACC_S:-900} LLAMAACC_ARGS="--paths ${ACC_PATHS:-upstream-bf16 portable-fp16 portable-bf16} \\
--rounding ${ACC_ROUND:-fp8-indexer}" bash $here/tools/gpu-host/gpu-checks.sh /tmp/parts $keep/acc \\
  llamaacc > $keep/acc/log 2>&1
echo "rc=\$?" > $keep/acc/done
EOF
    setsid bash $keep/acc/run.sh > /dev/null 2>&1 < /dev/null &
    while [ ! -f $keep/acc/done ] && [ $SECONDS -lt "$call_s" ]; do sleep 5; done
    cat $keep/acc/done 2>/dev/null; grep -E '^\|' $keep/acc/log
    mkdir -p "$out/acc"; cp $keep/acc/* "$out/acc/" 2>/dev/null; where ;;
  compare)
    which="${2:?2L|3L|3Lq6|synN}"; need_side; env_; report_plugin; where
    if [ -d $keep/acc ]; then  # benchmarks run alone on the GPU
      while [ ! -f $keep/acc/done ]; do sleep 5; done
      mkdir -p "$out/acc"; cp $keep/acc/* "$out/acc/"; grep -E '^\|' $keep/acc/log
    fi
    case "$which" in 2L) f=/tmp/shaped/glm5-shaped-2L-Q4_K_M.gguf n=1 ;;
      3L) f=/tmp/shaped3/glm5-shaped-3L-Q4_K_M.gguf n=2 ;;
      3Lq6) f=/tmp/shaped3/glm5-shaped-3L-Q4_K_M-q6down.gguf n=2 ;;
      syn[0-9]*) f=$(syn_file ${which#syn}) n=syn
        [ -f $keep/deep/files ] || { echo "no \`deep\` call on this machine" >&2; exit 3; }
        # every file written first: the writer takes the CPUs that vLLM's host work needs
        until [ "$(wc -l < $keep/deep/progress)" = "$(wc -l < $keep/deep/files)" ]; do
          [ $SECONDS -lt "$call_s" ] || { echo "the synthetic files are still being written" >&2; exit 3; }
          sleep 5
        done
        grep -q "^syn ${which#syn} rc=0" $keep/deep/progress || { echo "no $which file:" \
          "$(grep "^syn ${which#syn} " $keep/deep/progress || echo "not in DEEP_LAYERS")" >&2
          tail -5 $keep/deep/syn-${which#syn}.log 2> /dev/null >&2; exit 3; } ;;
      *) echo "compare 2L, 3L, 3Lq6 or synN (after \`deep\`)" >&2; exit 2 ;; esac
    while [ $n != syn ] && ! grep -q "^set $n rc=" $keep/llama/model.log; do
      grep -q "^rc=" $keep/llama/model.log && { echo "no $which file on this machine" \
        "(\`first\` made $(grep -c '^set ' $keep/llama/model.log) set(s): SETS)" >&2; exit 3; }
      sleep 5
    done
    if [ -n "${QUIET:-}" ]; then
      while ! grep -q "^rc=" $keep/llama/model.log; do sleep 5; done; where
    fi
    grep "rc=" $keep/llama/model.log; mkdir -p $keep/vs "$out/vs"
    name=$which llama=(--llama-bench /tmp/llama-cpp-cuda/bin/llama-bench
      --llama-batched-bench /tmp/llama-cpp-cuda/bin/llama-batched-bench
      ${PROFILE:+--llama-profile "${NCU:-/usr/local/cuda/bin/ncu}"})
    # shellcheck disable=SC2206
    profile=(${PROFILE:+--profile --profile-batch ${PROFILE_BATCH:-1}})
    if [ -n "${MORE:-}" ]; then  # more paths against the first call's llama.cpp run
      [ -f $keep/vs/$which.json ] || { echo "no compare $which on this machine yet" >&2; exit 3; }
      name=$which-more llama=(--llama-from $keep/vs/$which.json)
    fi
    # shellcheck disable=SC2086
    timeout $((call_s - SECONDS)) python3 -m benchmarks.glm5_vs_llama_cpp --gguf "$f" \
      "${llama[@]}" --paths ${PATHS_VS:-portable} --reps "${REPS:-2}" "${profile[@]}" \
      --batches ${BATCHES:-1 8 32} --prompts ${PROMPTS:-512 8192} --depths ${DEPTHS:-0 8192} \
      --json $keep/vs/$name.json --md $keep/vs/$name.md > $keep/vs/$name.log 2>&1
    echo "compare rc=$?"; cp $keep/vs/$name.* "$out/vs/"
    cat $keep/vs/$name.md 2>/dev/null || tail -30 $keep/vs/$name.log
    for deep in 3L 3Lq6; do
      [ -f $keep/vs/2L.json ] && [ -f $keep/vs/$deep.json ] || continue
      python3 -m benchmarks.glm5_vs_llama_cpp --per-layer $keep/vs/2L.json $keep/vs/$deep.json \
        --json "$out/vs/per-layer-$deep.json" --md $keep/vs/per-layer-$deep.md \
        && cat $keep/vs/per-layer-$deep.md
    done
    syn=($(ls $keep/vs/syn[0-9]*.json 2> /dev/null | grep -v more))
    if [ "${#syn[@]}" -ge 2 ]; then
      python3 -m benchmarks.glm5_vs_llama_cpp --depth-model "${syn[@]}" --project 78 \
        --json "$out/vs/depth-model.json" --md $keep/vs/depth-model.md && cat $keep/vs/depth-model.md
    fi ;;
  deep)
    env_; mkdir -p /tmp/syn /dev/shm/syn $keep/deep; : > $keep/deep/progress
    for l in ${DEEP_LAYERS:-2 10}; do echo "$l $(syn_file $l)"; done > $keep/deep/files
    # shellcheck disable=SC2016
    setsid bash -c 'while read -r l f; do
        python3 -m vllm_gguf_plugin.gguf_model.synthetic $f --layers $l > $2/syn-$l.log 2>&1
        echo "syn $l rc=$?" >> $2/progress
      done < $1' _ $keep/deep/files $keep/deep > /dev/null 2>&1 < /dev/null &
    sleep 5; cat $keep/deep/progress; df -h /tmp | tail -1 ;;
  long)  # GLM-5's whole context (benchmarks/glm5_long_context.py): `long tiny`, the crash
    # matrix on the tiny GLM-5 (its context 4096, with VLLM_ALLOW_LONG_MAX_MODEL_LEN, and
    # GLM-5's 202752) with CUDA_LAUNCH_BLOCKING, engines side by side (LONG_UTIL each);
    # `long selfcheck`, vllm_gguf_plugin.selfcheck as itself and as on SM120, SM89, SM80;
    # `long whole`, the 2-layer file with vLLM's defaults (LONG_PATHS), then llama-bench at
    # the same depths (LONG_LLAMA_S seconds; 0 skips it), added to the report as ratios
    which="${2:?tiny|whole}"; env_; report_plugin; mkdir -p $keep/long "$out/long"
    case "$which" in
      tiny)
        python3 -m benchmarks.glm5_long_context --make-tiny $keep/long/tiny > $keep/long/make.log 2>&1 \
          || { tail -20 $keep/long/make.log; exit 1; }
        for ctx in ${LONG_CTX:-4096 202752}; do
          f=$keep/long/tiny/tiny-glm5-$ctx-Q4_K_M.gguf
          for case_ in ${LONG_CASES:-upstream:131136:16384:16384,65536,131072 \
              sm120:131136:16384:16384,65536,131072 sm80:131136:16384:16384,65536,131072 \
              upstream:200064:8192:98304}; do
            IFS=: read -r path len chunk prompts <<< "$case_"
            name=$path-$len-$chunk-ctx$ctx
            VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 timeout $((call_s - SECONDS - 20)) \
              python3 -m benchmarks.glm5_long_context --gguf "$f" --paths "$path" \
              --prompts ${prompts//,/ } --batch 0 --gen 4 --max-model-len "$len" \
              --max-num-batched-tokens "$chunk" --gpu-memory-utilization "${LONG_UTIL:-0.1}" \
              --eager --launch-blocking --json $keep/long/$name.json \
              --md $keep/long/$name.md > $keep/long/$name.out 2>&1 &
          done
        done
        wait; cat $keep/long/*-ctx*.md; cp $keep/long/*-ctx*.json "$out/long/"
        for runs in $keep/long/*-ctx*.runs; do  # a case cut by its timeout: the rows it wrote
          [ -d "$runs" ] && [ ! -f "${runs%.runs}.json" ] || continue
          cp "$runs"/*.json "$out/long/$(basename "${runs%.runs}")-partial.json"
          tail -5 "$runs"/*.log
        done ;;
      selfcheck)  # the self-check as itself and as on SM120, SM89 and SM80, side by side
        for as_ in ${LONG_AS:-native 12.0:101376 8.9:101376 8.0:166912}; do
          IFS=: read -r cap smem <<< "$as_"
          ( [ "$as_" = native ] || export VLLM_TEST_REPORT_CAPABILITY=$cap VLLM_TEST_REPORT_SHARED_MEM=$smem
            timeout $((call_s - SECONDS - 20)) python3 -m vllm_gguf_plugin.selfcheck \
              --gpu-memory-utilization "${LONG_UTIL:-0.2}" --dir $keep/long/selfcheck-$cap \
              --json $keep/long/selfcheck-$cap.json > $keep/long/selfcheck-$cap.log 2>&1
            echo "selfcheck $cap rc=$?" ) &
        done
        wait; tail -n 12 $keep/long/selfcheck-*.log; cp $keep/long/selfcheck-*.json "$out/long/" ;;
      whole)
        f=/tmp/shaped/glm5-shaped-2L-Q4_K_M.gguf
        while ! grep -q "^set 1 rc=" $keep/llama/model.log 2>/dev/null; do
          [ $SECONDS -lt "$call_s" ] || { echo "no 2-layer file yet" >&2; exit 3; }; sleep 5
        done
        # shellcheck disable=SC2086
        timeout $((call_s - SECONDS - ${LONG_LLAMA_S:-150})) python3 -m benchmarks.glm5_long_context \
          --gguf "$f" --paths ${LONG_PATHS:-sm120 upstream} --timeout "${LONG_PATH_S:-400}" \
          --json $keep/long/whole.json --md $keep/long/whole.md > $keep/long/whole.out 2>&1
        echo "long whole rc=$?"; cat $keep/long/whole.md; cp $keep/long/whole.json "$out/long/"
        if [ "${LONG_LLAMA_S:-150}" != 0 ] && grep -q "^rc=0" $keep/llama/build.log; then
          timeout "${LONG_LLAMA_S:-150}" /tmp/llama-cpp-cuda/bin/llama-bench -m "$f" -ngl 99 \
            -fa on -p 0 -n 16 -d ${LONG_DEPTHS:-131072,200000} -r 1 -o json \
            > "$out/long/llama-bench-depths.json" 2> $keep/long/llama.err
          echo "llama-bench rc=$?"; tail -3 $keep/long/llama.err
          python3 -m benchmarks.glm5_long_context --from $keep/long/whole.json \
            --llama-bench "$out/long/llama-bench-depths.json" --json "$out/long/whole.json"
        fi ;;
      *) echo "long tiny, long selfcheck or long whole" >&2; exit 2 ;;
    esac ;;
  *) echo "unknown call $1" >&2; exit 2 ;;
esac
