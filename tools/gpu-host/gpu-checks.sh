#!/usr/bin/env bash
# GPU checks on the offline H200 test host, after the bundle's parts were copied to PARTS_DIR:
#   bash tools/gpu-host/gpu-checks.sh PARTS_DIR OUT_DIR [STAGE ...]
# Stages (default: all, in this order): install (bundle into /tmp/site), tests (GPU-marked tests),
# upstream (upstream's sparse MLA backend test with TRITON_MLA_SPARSE added from our side),
# bench (kernel benchmarks), glm52 (the tiny GLM-5.2 from its GGUFs, needs .llama-cpp/ as gguf),
# sm80 (the engine as on SM80/SM86 with the 16-bit-dot indexer), chat (`vllm serve` of a GGUF
# with GLM-5's reasoning and tool-call parsers), mtp (MTP speculative decoding from a GGUF),
# mtpq (benchmarks/glm5_mtp_matrix.py: MTP from safetensors, bf16, q8_0, Q4_K_M and IQ2_M
# files of the trained tiny GLM-5 and the tiny GLM-5.2, eager, graphs, as on SM120),
# gguf (the tiny GLM-5 from llama.cpp GGUFs in the engine; needs
# .llama-cpp/ carried: the converter tree and a llama-quantize binary, see
# tests/models/quantization/gguf_reference.py), mla (the sparse MLA kernel tests only), sweep
# (launch-parameter sweep of the gather kernel), benchas (the kernel benchmarks as on
# SM80/86/120: their launches, Triton's dots as mma.sync), bisect (tests/models/quantization/gguf_bisect.py),
# sm120 (the engine from a GGUF with the capability reported as 12.0), fp8kv (the same with an
# fp8 KV cache, 64, 16 and 8 heads), throughput
# (benchmarks/glm5_throughput.py), matrix (benchmarks/glm5_accuracy_matrix.py), serve
# (tools/gpu-host/serve-check.sh: `vllm serve` of the GGUF under load), rerun
# (tests/models/glm5_rerun.py: two identical runs per path), tp2 (TP2 against TP1, needs two GPUs),
# bi (batch invariance: prompts alone and batched repeat exactly), ggufops
# (benchmarks/kernels/benchmark_gguf_ops.py; GGUF_OPS_ARGS), gguftests (the GPU tests of the
# GGUF kernels: batch invariance and the benchmark's paths), llamaacc
# (benchmarks/glm5_gguf_accuracy.py: the overlay and llama.cpp against transformers fp32 on
# the tiny GLM-5's GGUFs; LLAMA_LIB: the folder of a CUDA libllama.so; LLAMAACC_ARGS: more
# of its arguments, e.g. --paths and --rounding). Logs and JSON go
# to OUT_DIR. Split the stages over calls when one
# call's time limit is short: /tmp/site stays while the machine does. The device tool
# brings back only a few files: point OUT_DIR at a /tmp folder and copy the JSON
# reports into the tool's $OUT; stages on separate GPUs run side by side with
# CUDA_VISIBLE_DEVICES (and PYTEST_ADDOPTS=--basetemp=... for each pytest stage).
# The bundle comes from (6 parts):
#   python build.py bundle --wheel dist/vllm-0.26*.whl --wheel dist/vllm_gguf_plugin-*.whl \
#     --exclude-from tools/gpu-host/h200-pip-freeze.txt \
#     --only tools/gpu-host/h200-runtime-extras.txt --max-part 56M --out .bundle \
#     --drop vllm/vllm-rs --drop 'vllm/third_party/deep_gemm/_C.cpython-31[01345]-*'
# and upstream's test files from `python build.py sdist` (see tests/v1/attention/
# test_upstream_sparse_mla_backends.py; VLLM_OVERLAY_UPSTREAM_TESTS points at them).
# FA2 stays (2 of the 6 parts): SM90 prefills MLA with FA3, but with another capability reported
# (sm120, fp8kv, the SM80 checks) vLLM 0.26 runs sparse MLA's dense-MHA prefill (taken when a
# batch's prefills all fit in index_topk) on FA2. --drop 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so'
# makes 4 parts for runs that report no other capability.
set -uo pipefail
parts="${1:?parts dir}"; out="${2:?out dir}"; shift 2
stages="${*:-install tests upstream bench}"
here="$(cd "$(dirname "$0")/../.." && pwd)"
mkdir -p "$out"
cd "$here"
rc=0
for stage in $stages; do
  case "$stage" in
    install) bash "$parts/install.sh" "$parts" /tmp/site || exit 1 ;;
  esac
done
# shellcheck disable=SC1091
[ -f /tmp/site/env.sh ] && source /tmp/site/env.sh
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  DO_NOT_TRACK=1 TVM_FFI_DISABLE_TORCH_C_DLPACK=1 VLLM_USE_FLASHINFER_SAMPLER=0
export VLLM_OVERLAY_UPSTREAM_TESTS="${VLLM_OVERLAY_UPSTREAM_TESTS:-$here/.upstream-tests}"
export VLLM_OVERLAY_LLAMA_CPP="${VLLM_OVERLAY_LLAMA_CPP:-$here/.llama-cpp}"
export VLLM_OVERLAY_LLAMA_QUANTIZE="${VLLM_OVERLAY_LLAMA_QUANTIZE:-$here/.llama-cpp/bin/llama-quantize}"
export VLLM_OVERLAY_LLAMA_IMATRIX="${VLLM_OVERLAY_LLAMA_IMATRIX:-$here/.llama-cpp/bin/llama-imatrix}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.txt"
for stage in $stages; do
  case "$stage" in
    install) ;;
    tests)
      # TESTS_TIMEOUT: 184 tests, 104 of them in 540 s alone on the H200, the other 81 in 564 s
      # on an H100 (2026-12-06): detached, give it 1500; TESTS_PATHS: test files or ids instead
      # of all of tests/; -v: a run cut by the call's time still names each test's result (-q
      # kept only characters)
      # shellcheck disable=SC2086
      timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest ${TESTS_PATHS:-tests} -m gpu -v -s -p no:cacheprovider -p no:warnings \
        --ignore=tests/v1/attention/test_upstream_sparse_mla_backends.py \
        --ignore=tests/kernels/attention/test_attention_selector_sparse.py --ignore=tests/overlay \
        --ignore=tests/models/quantization/test_glm5_gguf_engine.py \
        --ignore=tests/models/quantization/test_glm52_gguf_engine.py \
        --ignore=tests/models/quantization/test_glm5_gguf_as_sm120.py \
        --ignore=tests/models/quantization/test_glm5_gguf_tensor_parallel.py \
        --ignore=tests/models/test_glm5_batch_invariant.py \
        --ignore=tests/models/test_glm5_as_sm80.py \
        --ignore=tests/models/quantization/test_glm5_gguf_chat_gpu.py \
        --ignore=tests/models/quantization/test_glm5_gguf_mtp_gpu.py 2>&1 \
        | tee "$out/gpu-tests.log" | grep -E "passed|failed|error|delta|FAILED" || rc=1 ;;
    gguf)
      timeout 550 python3 -m pytest tests/models/quantization/test_glm5_gguf_engine.py -q -s \
        -p no:cacheprovider -p no:warnings 2>&1 | tee "$out/gguf-engine.log" \
        | grep -E "passed|failed|error|REPORT|FAILED|Error" || rc=1 ;;
    sm80)
      # GLM-5 as on SM80/SM86: the 16-bit-dot indexer (kernels, then the engine with the
      # capability reported as 8.0 and 8.6 against transformers fp32)
      pip install -q --no-deps --no-build-isolation --target /tmp/site \
        tests/plugins/vllm_report_capability >/dev/null 2>&1 || rc=1
      timeout 580 python3 -m pytest tests/models/test_glm5_as_sm80.py -q -s \
        -p no:cacheprovider -p no:warnings 2>&1 | tee "$out/sm80.log" \
        | grep -E "passed|failed|REPORT|FAILED|Error" || rc=1 ;;
    glm52)
      # the tiny GLM-5.2 (IndexShare schedule) from safetensors and GGUFs against transformers fp32
      timeout 550 python3 -m pytest tests/models/quantization/test_glm52_gguf_engine.py -q -s \
        -p no:cacheprovider -p no:warnings 2>&1 | tee "$out/glm52-engine.log" \
        | grep -E "passed|failed|error|REPORT|FAILED|Error" || rc=1 ;;
    chat)
      # `vllm serve` of a scripted tiny GLM-5 GGUF with GLM-5's reasoning and tool parsers
      # (the portable indexer: the capability test hook reports no DeepGEMM)
      pip install -q --no-deps --no-build-isolation --target /tmp/site \
        tests/plugins/vllm_report_capability >/dev/null 2>&1 || rc=1
      timeout 420 python3 -m pytest tests/models/quantization/test_glm5_gguf_chat_gpu.py -q -s \
        -p no:cacheprovider -p no:warnings 2>&1 | tee "$out/chat.log" \
        | grep -E "passed|failed|error|REPORT|FAILED|Error" || rc=1 ;;
    mtp)
      # MTP from the trained tiny GLM-5's GGUF: lossless greedy, acceptance for N = 1..5,
      # decode tokens/s; .glm5-trained/ carried (python3 -m tests.models.glm5_trained --out), else
      # the host trains it first
      [ -d .glm5-trained ] && export VLLM_OVERLAY_GLM5_TRAINED="$here/.glm5-trained"
      VLLM_OVERLAY_REPORT_DIR="$out" timeout "${MTP_TIMEOUT:-580}" python3 -m pytest \
        tests/models/quantization/test_glm5_gguf_mtp_gpu.py -q -s -p no:cacheprovider \
        -p no:warnings 2>&1 | tee "$out/mtp.log" \
        | grep -E "passed|failed|error|REPORT|FAILED|Error" || rc=1 ;;
    mtpq)
      # MTP by file type: lossless up to near-ties, acceptance against the bf16 file's,
      # TRITON_MLA_SPARSE for target and draft (one engine per row, MTPQ_PARALLEL at once)
      pip install -q --no-deps --no-build-isolation --target /tmp/site \
        tests/plugins/vllm_report_capability >/dev/null 2>&1 || rc=1
      [ -d .glm5-trained ] && export VLLM_OVERLAY_GLM5_TRAINED="$here/.glm5-trained"
      timeout "${MTPQ_TIMEOUT:-580}" python3 -m benchmarks.glm5_mtp_matrix --out /tmp/mtpq \
        --parallel "${MTPQ_PARALLEL:-8}" ${MTPQ_ARGS:-} --json "$out/mtp-matrix.json" 2>&1 \
        | tee "$out/mtp-matrix.log" | grep -E "^\||Error" || rc=1 ;;
    upstream)
      timeout 300 python3 -m pytest tests/v1/attention/test_upstream_sparse_mla_backends.py -q \
        -p no:cacheprovider -p no:warnings 2>&1 | tee "$out/upstream-tests.log" | tail -3 || rc=1 ;;
    bench)
      # OPS_FILE: time a copy of the kernel file (e.g. the working tree's) instead;
      # BENCH_ARGS: more options (e.g. --q-dtype fp16 --heads 8 32 64)
      timeout 300 python3 -m benchmarks.kernels.benchmark_triton_mla_sparse \
        --compile-workers 8 ${OPS_FILE:+--ops-file "$OPS_FILE"} ${BENCH_ARGS:-} --json "$out/bench-mla.json" \
        2>&1 | tee "$out/bench-mla.log" | tail -34 || rc=1
      timeout 300 python3 -m benchmarks.kernels.benchmark_indexer_logits \
        --json "$out/bench-indexer.json" 2>&1 | tee "$out/bench-indexer.log" | tail -14 || rc=1 ;;
    benchas)
      # the sparse MLA launches of SM80, SM86 (bf16) and SM120 (fp16 queries, a 16-bit
      # and an fp8 cache, with the sweep) timed here, their dots as mma.sync; then the
      # indexer's fp8- and 16-bit-dot kernels with mma.sync dots (BENCHAS_ARGS,
      # BENCHAS_SM120_ARGS: shapes)
      for gpu in sm80 sm86; do
        timeout "${BENCHAS_TIMEOUT:-240}" python3 -m benchmarks.kernels.benchmark_triton_mla_sparse \
          --as-gpu $gpu --kv bf16 --compile-workers 8 ${BENCHAS_ARGS:---tokens 1 8 64 4096 --heads 16 32 64} \
          --json "$out/bench-mla-$gpu.json" 2>&1 | tee "$out/bench-mla-$gpu.log" | grep -E "^\||^launches" || rc=1
      done
      timeout "${BENCHAS_TIMEOUT:-240}" python3 -m benchmarks.kernels.benchmark_triton_mla_sparse \
        --as-gpu sm120 --q-dtype fp16 --kv fp16 fp8 --sweep --compile-workers 12 \
        ${BENCHAS_SM120_ARGS:---tokens 1 4096 --heads 16 64} --json "$out/bench-mla-sm120.json" 2>&1 \
        | tee "$out/bench-mla-sm120.log" | grep -E "^\||^launches|best" || rc=1
      DISABLE_MMA_V3=1 timeout 300 python3 -m benchmarks.kernels.benchmark_indexer_logits \
        --json "$out/bench-indexer-mma-sync.json" 2>&1 | tee "$out/bench-indexer-mma-sync.log" \
        | tail -14 || rc=1 ;;
    sweep)
      # the shapes short of the kernel issue's targets (bf16 at 64 heads, fp8 KV),
      # 32 heads (GLM-5 at TP2) and 8 heads (the 16-head tile)
      timeout "${SWEEP_TIMEOUT:-400}" python3 -m benchmarks.kernels.benchmark_triton_mla_sparse \
        --sweep --compile-workers 12 --tokens 8 64 4096 --heads 8 32 64 --kv bf16 --json "$out/sweep-mla.json" 2>&1 \
        | tee "$out/sweep-mla.log" | tail -22 || rc=1
      timeout "${SWEEP_TIMEOUT:-400}" python3 -m benchmarks.kernels.benchmark_triton_mla_sparse \
        --sweep --compile-workers 12 --tokens 64 4096 --heads 8 32 64 --kv fp8 --json "$out/sweep-mla-fp8.json" 2>&1 \
        | tee "$out/sweep-mla-fp8.log" | tail -22 || rc=1 ;;
    mla)
      timeout 300 python3 -m pytest tests/v1/attention/test_triton_mla_sparse.py -m gpu -q \
        -p no:cacheprovider -p no:warnings 2>&1 | tee "$out/mla-tests.log" | tail -5 || rc=1
      # every launch-sweep candidate against the table's configuration, on the GPU
      timeout 300 python3 -m pytest tests/benchmarks/test_sparse_mla_sweep.py -q \
        -p no:cacheprovider -p no:warnings 2>&1 | tee "$out/mla-sweep-tests.log" | tail -3 || rc=1 ;;
    bisect)
      timeout "${BISECT_TIMEOUT:-420}" python3 -m tests.models.quantization.gguf_bisect /tmp/bisect 2>&1 \
        | tee "$out/bisect.log" | grep -E "^[a-z_]+ \{|Error" || rc=1 ;;
    sm120)
      # the engine "as on SM120": the capability hook, then the no-flags GGUF test
      pip install -q --no-deps --no-build-isolation --target /tmp/site \
        tests/plugins/vllm_report_capability >/dev/null 2>&1 || rc=1
      timeout 540 python3 -m pytest tests/models/quantization/test_glm5_gguf_as_sm120.py -q -s \
        -k "not fp8" -p no:cacheprovider -p no:warnings 2>&1 | tee "$out/sm120.log" | tail -5 || rc=1 ;;
    fp8kv)
      # an fp8 KV cache in the engine: SM120's Triton fp8 tiles against the H200's
      # (64, 16 and 8 heads)
      pip install -q --no-deps --no-build-isolation --target /tmp/site \
        tests/plugins/vllm_report_capability >/dev/null 2>&1 || rc=1
      timeout 580 python3 -m pytest tests/models/quantization/test_glm5_gguf_as_sm120.py -q -s \
        -k fp8 -p no:cacheprovider -p no:warnings 2>&1 | tee "$out/fp8kv.log" \
        | grep -E "passed|failed|skipped|FP8_KV(_FEW_HEADS)?_REPORT|Error" || rc=1 ;;
    tp2)
      timeout 540 python3 -m pytest tests/models/quantization/test_glm5_gguf_tensor_parallel.py -q -s \
        -p no:cacheprovider -p no:warnings 2>&1 | tee "$out/tp2.log" \
        | grep -E "passed|failed|skipped|TP2_REPORT|Error" || rc=1 ;;
    bi)
      timeout 420 python3 -m pytest tests/models/test_glm5_batch_invariant.py -q -s \
        -p no:cacheprovider -p no:warnings 2>&1 | tee "$out/bi.log" \
        | grep -E "passed|failed|REPORT|Error" || rc=1 ;;
    rerun)
      timeout 300 python3 -m tests.models.glm5_rerun --out /tmp/rerun --mem "${RERUN_MEM:-0.05}" \
        --json "$out/rerun.json" > "$out/rerun.log" 2>&1; tail -n 6 "$out/rerun.log" ;;
    serve)
      timeout 420 bash tools/gpu-host/serve-check.sh "$out" 2>&1 | tee "$out/serve-check.log" \
        | tail -20 || rc=1 ;;
    throughput)
      # THROUGHPUT_ARGS: e.g. --profile (kernels of 16 decode steps per path); the portable
      # path's indexer on Triton: the capability test hook reports no DeepGEMM
      pip install -q --no-deps --no-build-isolation --target /tmp/site \
        tests/plugins/vllm_report_capability >/dev/null 2>&1 || rc=1
      timeout 500 python3 -m benchmarks.glm5_throughput ${THROUGHPUT_ARGS:-} \
        --json "$out/glm5-throughput.json" 2>&1 \
        | tee "$out/glm5-throughput.log" | tail -8 || rc=1 ;;
    matrix)
      # MATRIX_MODES="eager" or "graphs", MATRIX_MODELS="glm5" or "glm52" and MATRIX_PATHS
      # (upstream's always runs) run a part of the rows (a quarter a call)
      timeout "${MATRIX_TIMEOUT:-580}" python3 -m benchmarks.glm5_accuracy_matrix --out /tmp/matrix \
        --parallel "${MATRIX_PARALLEL:-8}" --mem-total "${MATRIX_MEM:-0.85}" \
        --modes ${MATRIX_MODES:-eager graphs} --models ${MATRIX_MODELS:-glm5 glm52} \
        ${MATRIX_PATHS:+--paths $MATRIX_PATHS} 2>&1 \
        | tee "$out/matrix.log" | grep -E "^\|" || rc=1
      models="${MATRIX_MODELS:-glm5 glm52}"; modes="${MATRIX_MODES:-eager graphs}"
      cp /tmp/matrix/matrix.json "$out/matrix-${models// /-}-${modes// /-}.json" 2>/dev/null || true ;;
    ggufops)
      timeout "${GGUF_OPS_TIMEOUT:-400}" python3 -m benchmarks.kernels.benchmark_gguf_ops \
        ${GGUF_OPS_ARGS:-} --json "$out/gguf-ops.json" --md "$out/gguf-ops.md" \
        > "$out/gguf-ops.log" 2>&1 || rc=1
      cat "$out/gguf-ops.md" 2>/dev/null || tail -20 "$out/gguf-ops.log" ;;
    gguftests)
      timeout 400 python3 -m pytest tests/models/quantization/test_gguf_batch_invariant.py \
        tests/benchmarks/test_benchmark_gguf_ops.py -m gpu -v -p no:cacheprovider \
        -p no:warnings 2>&1 | tee "$out/gguf-tests.log" | grep -E "passed|failed|Error" || rc=1 ;;
    llamaacc)
      timeout "${LLAMAACC_TIMEOUT:-540}" python3 -m benchmarks.glm5_gguf_accuracy \
        --out /tmp/llamaacc --llama-lib "${LLAMA_LIB:?LLAMA_LIB}" \
        ${LLAMA_BINDINGS:+--bindings "$LLAMA_BINDINGS"} --json "$out/gguf-accuracy.json" \
        ${LLAMA_RUNNER:+--llama-runner "$LLAMA_RUNNER"} ${LLAMA_SRC:+--llama-src "$LLAMA_SRC"} \
        ${LLAMAACC_ARGS:-} 2>&1 \
        | tee "$out/gguf-accuracy.log" | grep -E "^\||Error" || rc=1 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
exit $rc
