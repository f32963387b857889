#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Serving for a long time on the GPU host (issue 70), after llama-compare-calls.sh's `first`
# (SETS=none: llama.cpp's build alone), parts and `stages` (the bundle installed in /tmp/site),
# or, with no llama-server wanted, after the parts in /tmp/parts and gpu-checks.sh's install.
# The files are GLM-5-shaped 2- and 3-layer Q4_K_M GGUFs written by
# vllm_gguf_plugin.gguf_model.synthetic (llama.cpp's tensor types, random valid blocks: in a
# minute, where llama.cpp's converter takes several), the 2-layer one twice: the soak's server
# maps one, and a mapped page cannot be evicted for a cold start (SYN=2: the 2-layer file
# alone, for a soak with no cold start; SOAK_GGUF=FILE: the soak serves that written file and
# none is written, e.g. `deep`'s 2-layer file in /dev/shm while its 10-layer one fills the
# disk). One device call each:
#   start   starts, detached: the files; `vllm serve` of the 2-layer one as on SM120 (SOAK_UTIL of the GPU) and
#           benchmarks/serve_soak.py against it for SOAK_S seconds (0: no server, the lanes
#           run at once with the GPU to themselves, e.g. JOBS=cold alone); beside the soak, in two
#           lanes (JOBS, default "bi cold", and JOBS2, default "selfcheck tiny tests", each one
#           job after the other; "none": no job): serve-check.sh on the file
#           as on SM120 under VLLM_BATCH_INVARIANT=1; benchmarks/serve_cold_start.py on the
#           synthetic files (vLLM as on SM120 at COLD_UTIL, llama-server); the self-check as
#           itself and as on SM120, SM89 and SM80 (SELFCHECK_AS); the tiny GLM-5 of context
#           4096 stretched to 131136 (TINY_PATHS; the rope tables' fix); memcheck: `vllm
#           serve` refused before loading (weights at 80% of the utilization's share, then a
#           100 MB KV cache for the file's whole context); gpu-checks.sh's tests
#           and gguftests stages; AFTER (default none): jobs run one after the other once the
#           soak has ended, with the GPU to themselves; BEFORE (default none): the same before
#           the soak's server starts (beside the files' writing)
#   wait    one line of progress every 30 s until everything ended or the call's time is up
#           (CALL_S, default 585 s), then the reports to the device tool's $OUT
set -uo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
keep=/tmp/keep; work=$keep/serve; out="${OUT:-/tmp/out}"; call_s="${CALL_S:-585}"
cd "$here"
export VLLM_OVERLAY_LLAMA_CPP=/tmp/llama-cpp VLLM_OVERLAY_LLAMA_QUANTIZE=/tmp/llama-cpp/bin/llama-quantize
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  DO_NOT_TRACK=1 TVM_FFI_DISABLE_TORCH_C_DLPACK=1 VLLM_USE_FLASHINFER_SAMPLER=0
# shellcheck disable=SC1091
source /tmp/site/env.sh || { echo "no /tmp/site: install the bundle first" >&2; exit 3; }
as120=(VLLM_TEST_REPORT_CAPABILITY=12.0 VLLM_TEST_REPORT_SHARED_MEM=101376)
shaped=${SOAK_GGUF:-/tmp/syn/glm5-synthetic-2L.gguf}
syn=${SYN:-2 3}; [ -n "${SOAK_GGUF:-}" ] && syn=none
soak_s=${SOAK_S:-1200}

soak() {  # the server and the soak against it; the server's time to healthy in its log
  while [ ! -f $work/syn-2.done ] || [ ! -f $work/lane-1.done ]; do sleep 2; done
  [ "$soak_s" = 0 ] && { echo "no soak" > $work/soak.done; return; }
  local t0=$SECONDS
  # at a stall the client records the server's processes and has its Python stacks printed
  # (stackdump, SIGUSR2); DeepGEMM prints each JIT build's compiler command, line-buffered
  env "${as120[@]}" PYTHONPATH="$here/tools/gpu-host/stackdump${PYTHONPATH:+:$PYTHONPATH}" \
    DG_JIT_PRINT_COMPILER_COMMAND=1 stdbuf -oL -eL vllm serve "$shaped" --port 8100 --served-model-name glm5 \
    --gpu-memory-utilization "${SOAK_UTIL:-0.35}" --enable-prompt-tokens-details \
    --jit-monitor-verbose --disable-uvicorn-access-log > $work/soak-server.log 2>&1 < /dev/null &
  local pid=$!
  until python3 -c 'import urllib.request as u; u.urlopen("http://127.0.0.1:8100/health", timeout=2)' 2> /dev/null; do
    kill -0 $pid 2> /dev/null || { echo "soak server exited" > $work/soak.done; return; }
    sleep 1
  done
  echo "soak server healthy after $((SECONDS - t0)) s" >> $work/progress
  python3 -m benchmarks.serve_soak --base-url http://127.0.0.1:8100 --model glm5 \
    --duration-s "$soak_s" --timeout 120 --server-pid $pid --stall-signal SIGUSR2 \
    --json $work/soak.json --md $work/soak.md \
    > $work/soak.log 2>&1
  echo "soak rc=$?" >> $work/progress
  kill $pid; wait $pid
  echo "soak rc" > $work/soak.done
}

job() {  # one job beside the soak
  echo "$(date +%T) $1 start" >> $work/progress
  case "$1" in
    none) ;;  # JOBS=none JOBS2=none: the soak alone
    bi)
      SERVE_GGUF=$shaped SERVE_MEM=0.2 SERVE_KV_BYTES=8000000000 SERVE_MAX_LEN=4096 \
        env "${as120[@]}" timeout 900 bash tools/gpu-host/serve-check.sh $work/bi > $work/bi.log 2>&1 ;;
    cold)
      while [ ! -f $work/syn.done ]; do sleep 5; done
      # llama-server beside vLLM where `first` started llama.cpp's side; vLLM alone without it
      while [ -d $keep/llama ] && ! grep -q "^rc=" $keep/llama/build.log 2> /dev/null; do sleep 5; done
      local server=() lib=/tmp/llama-cpp-cuda/bin
      [ -x $lib/llama-server ] && server=(--llama-server $lib/llama-server)
      [ -e /tmp/llama-cpp-cuda/cublas/libcublas.so ] \
        && lib=$lib:$(dirname "$(readlink -f /tmp/llama-cpp-cuda/cublas/libcublas.so)")
      LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
      timeout 1500 python3 -m benchmarks.serve_cold_start --gguf /tmp/syn/cold/glm5-synthetic-2L.gguf \
        /tmp/syn/glm5-synthetic-3L.gguf "${server[@]}" --as-capability 12.0:101376 --work $work/cold --json $work/cold.json --md $work/cold.md \
        --vllm-args --gpu-memory-utilization "${COLD_UTIL:-0.3}" > $work/cold.log 2>&1 ;;
    selfcheck)
      for as_ in ${SELFCHECK_AS:-native:0 12.0:101376 8.9:101376 8.0:166912}; do
        IFS=: read -r cap smem <<< "$as_"
        ( [ "$cap" = native ] || export VLLM_TEST_REPORT_CAPABILITY=$cap VLLM_TEST_REPORT_SHARED_MEM=$smem
          timeout 400 python3 -m vllm_gguf_plugin.selfcheck --gpu-memory-utilization 0.1 \
            --dir $work/selfcheck-$cap --json $work/selfcheck-$cap.json > $work/selfcheck-$cap.log 2>&1
          echo "selfcheck $cap rc=$?" >> $work/progress )
      done ;;
    memcheck)  # the memory check refusing before the load: weights, then the context
      while [ ! -f $work/syn-2.done ]; do sleep 2; done
      local total bytes case name t0
      total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
      bytes=$(stat -c %s "$shaped")
      for case in "weights --gpu-memory-utilization $(python3 -c "print(round(0.8 * $bytes / ($total * 2**20), 4))")" \
                  "context --kv-cache-memory-bytes 100000000"; do
        name=${case%% *}; t0=$SECONDS
        # shellcheck disable=SC2086
        timeout 300 vllm serve "$shaped" --port 8101 ${case#* } > $work/memcheck-$name.log 2>&1 < /dev/null
        echo "memcheck $name (${case#* }) rc=$? in $((SECONDS - t0)) s, tensors loaded:" \
          "$(grep -c 'Loading GGUF tensors' $work/memcheck-$name.log)" >> $work/progress
        grep -m1 -o "cannot fit this GPU's memory.*" $work/memcheck-$name.log >> $work/progress
      done ;;
    tiny)
      python3 -m benchmarks.glm5_long_context --make-tiny $work/tiny > $work/tiny-make.log 2>&1
      for path in ${TINY_PATHS:-sm120 upstream sm80}; do
        VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 timeout 400 python3 -m benchmarks.glm5_long_context \
          --gguf $work/tiny/tiny-glm5-4096-Q4_K_M.gguf --paths $path --prompts 16384 65536 131072 \
          --batch 0 --gen 4 --max-model-len 131136 --max-num-batched-tokens 16384 \
          --gpu-memory-utilization 0.15 --eager --launch-blocking \
          --json $work/tiny-$path-ctx4096.json --md $work/tiny-$path-ctx4096.md > $work/tiny-$path.out 2>&1
        echo "tiny $path rc=$?" >> $work/progress
      done ;;
    tests)
      bash tools/gpu-host/gpu-checks.sh /tmp/parts $work/checks tests gguftests > $work/tests.log 2>&1 ;;
  esac
  echo "$(date +%T) $1 rc=$?" >> $work/progress
}

case "${1:?start|wait}" in
  start)
    mkdir -p $work /tmp/syn/cold; : > $work/progress
    python3 -c "import vllm_report_capability" 2> /dev/null || pip install -q --no-deps \
      --no-build-isolation --target /tmp/site tests/plugins/vllm_report_capability > /dev/null 2>&1
    setsid bash -c "for l in ${syn#none}; do
        python3 -m vllm_gguf_plugin.gguf_model.synthetic /tmp/syn/glm5-synthetic-\${l}L.gguf \
          --layers \$l >> $work/syn.log 2>&1; touch $work/syn-\$l.done
      done; case '$syn' in 2) ;; none) touch $work/syn-2.done ;;
        *) cp /tmp/syn/glm5-synthetic-2L.gguf /tmp/syn/cold/ ;; esac
      touch $work/syn.done
      ls -la /tmp/syn /tmp/syn/cold >> $work/syn.log; df -h /tmp >> $work/syn.log" \
      > /dev/null 2>&1 < /dev/null &
    setsid bash -c "$(declare -f soak); $(declare -p here keep work shaped as120 soak_s); soak" \
      > /dev/null 2>&1 < /dev/null &
    n=0
    for lane in "before ${BEFORE:-none}" "${JOBS:-bi cold}" "${JOBS2:-selfcheck tiny tests}" "after ${AFTER:-none}"; do
      n=$((n + 1)); ready="grep -q 'soak server healthy' $work/progress"  # beside the soak, before or after it
      [ "${lane%% *}" = before ] && ready=true lane=${lane#before }
      [ "${lane%% *}" = after ] && ready=false lane=${lane#after }
      setsid bash -c "cd $here; $(declare -f job); $(declare -p keep work shaped as120);
        while ! $ready; do [ -f $work/soak.done ] && break; sleep 5; done
        for j in $lane; do job \$j; done; touch $work/lane-$n.done" \
        > /dev/null 2>&1 < /dev/null &
    done
    sleep 20; cat $work/progress; tail -n 2 $keep/llama/build.log 2> /dev/null ;;
  wait)
    while [ $SECONDS -lt $((call_s - 15)) ]; do
      [ -f $work/soak.done ] && [ "$(ls $work/lane-*.done 2> /dev/null | wc -l)" = 4 ] && break
      echo "$(date +%T) $(tail -1 $work/progress) | soak: $(grep -c '' $work/soak.log 2>/dev/null) lines" \
        "| gpu $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader)"
      sleep 30
    done
    cat $work/progress; cat $work/soak.md $work/cold.md 2>/dev/null
    # kernels compiled while serving (every one: --jit-monitor-verbose), 10-s spans with no
    # token, DeepGEMM's builds and the stack dumps taken at stalls
    grep -E "jit_monitor.py.*during inference|generation throughput: 0.0 |Running NVCC|NVRTC|most recent call first" \
      $work/soak-server.log 2>/dev/null | cut -c1-220 | tail -40
    mkdir -p "$out/serve"
    cp $work/*.json $work/*.md $work/progress $work/soak-server.log "$out/serve/" 2>/dev/null
    for f in $work/*.log $work/tiny-*.out $work/bi/*.log; do [ -f "$f" ] && tail -c 20000 "$f" > "$out/serve/$(basename "$f").tail"; done
    cp $work/bi/*.json $work/checks/*.log "$out/serve/" 2>/dev/null; ls "$out/serve" | head -50 ;;
  *) echo "start or wait" >&2; exit 2 ;;
esac
