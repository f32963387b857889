#!/usr/bin/env bash
# `vllm serve` of the tiny GLM-5 GGUF under load, on the GPU host (after gpu-checks.sh's install):
#   bash tools/gpu-host/serve-check.sh OUT_DIR
# Makes the tiny model and its bf16 GGUF (or takes SERVE_GGUF), runs the offline greedy
# reference, starts
# `vllm serve FILE.gguf` with nothing else, waits for /health, runs benchmarks/serve_load.py
# (64 clients, 3 rounds, completions + chat), stops the server. Batch-invariant mode on both sides,
# so that a request's greedy text does not depend on what it was batched with. SERVE_MEM (default
# 0.9) is the GPU memory fraction of each engine; SERVE_KV_BYTES, if set, fixes the KV cache size
# (--kv-cache-memory-bytes), which skips vLLM's memory profiling: for sharing the GPU with other
# checks, whose engines starting and exiting would break that profiling. Both engines get the
# same --max-num-batched-tokens (SERVE_MAX_BATCHED, default 8192): vLLM's default for it
# differs between vllm.LLM and `vllm serve` (16384 and 8192 on an H200), and with it the
# engine's compiled size ranges; the 2026-11-30 run with the defaults differed from the offline
# text at a 1-ulp (bf16 logit) near tie in 2 of 128 prompts, also when the prompt was sent alone.
set -uo pipefail
out="${1:?out dir}"; here="$(cd "$(dirname "$0")/../.." && pwd)"; work=/tmp/serve-check
mkdir -p "$out" "$work"; cd "$here"
export VLLM_BATCH_INVARIANT="${VLLM_BATCH_INVARIANT:-1}"
gguf="${SERVE_GGUF:-$work/tiny-bf16.gguf}"; len="${SERVE_MAX_LEN:-2048}"
[ -n "${SERVE_GGUF:-}" ] || python3 - "$work" <<'PY' || exit 1
import sys
from pathlib import Path
from tests.models.glm5_tiny import make_tiny_glm5
from tests.models.quantization import gguf_reference as gr
work = Path(sys.argv[1])
model = make_tiny_glm5(work / "tiny")
gr.write_tokenizer(model, gr.config(model)["vocab_size"])
llama_cpp = gr.llama_cpp_dir(work / "llama-cpp")
gr.convert(llama_cpp, model, work / "tiny-bf16.gguf", "bf16")
PY
mem="${SERVE_MEM:-0.9}"
engine=(); [ -n "${SERVE_KV_BYTES:-}" ] && engine=(--kv-cache-memory-bytes "$SERVE_KV_BYTES")
engine+=(--max-num-batched-tokens "${SERVE_MAX_BATCHED:-8192}")
python3 -m benchmarks.serve_load offline --model "$gguf" --out "$work/ref.json" \
  --max-model-len "$len" --gpu-memory-utilization "$mem" "${engine[@]}" \
  > "$out/serve-offline.log" 2>&1 || {
    grep -v "it/s\]" "$out/serve-offline.log" | grep -A45 -m1 "Traceback"
    grep -E "Error|error:" "$out/serve-offline.log" | tail -n 5
    exit 1; }
vllm serve "$gguf" --port 8000 --max-model-len "$len" --gpu-memory-utilization "$mem" "${engine[@]}" \
  > "$out/serve.log" 2>&1 &
pid=$!
healthy() { python3 -c 'import urllib.request as u; u.urlopen("http://127.0.0.1:8000/health", timeout=2)' 2>/dev/null; }
for _ in $(seq 150); do healthy && break; kill -0 "$pid" 2>/dev/null || break; sleep 2; done
healthy || { echo "vllm serve did not become healthy"; tail -40 "$out/serve.log"; kill "$pid" 2>/dev/null; exit 1; }
python3 -m benchmarks.serve_load load --model "$gguf" --reference "$work/ref.json" \
  --concurrency 64 --rounds 3 --json "$out/serve-load.json" | tail -20
rc=${PIPESTATUS[0]}
kill "$pid"; wait "$pid" 2>/dev/null
exit "$rc"
