# SPDX-License-Identifier: Apache-2.0
"""GLM-5-shaped serving throughput: TRITON_MLA_SPARSE + portable indexer against
FLASHMLA_SPARSE + DeepGEMM, in the same run.

    python -m benchmarks.glm5_throughput --json out.json [--contexts 8192 32768]
        [--batch 8] [--gen 64] [--layers 4] [--experts 16]

The model has GLM-5's real per-layer dimensions (transformers' GlmMoeDsaConfig
defaults: hidden 6144, 64 heads, q_lora 2048, kv_lora 512, nope 192 + rope 64,
v 256, a 32 x 128 indexer with top-k 2048, MoE intermediate 2048, 8 experts per
token) with fewer layers and routed experts so that it fits one GPU, and random
weights (`load_format="dummy"`). Each path runs in its own process:
- TTFT: one request with a new CONTEXT-token prompt, max_tokens 1 (prefill + first
  token), best of three;
- decode: BATCH requests of CONTEXT tokens whose prompts are already in the prefix
  cache (a 1-token run first), so that the (1 + GEN)-token run prefills at most one
  block per request in one step and then decodes the whole batch together. The step
  time is each request's time between its first and last token (vLLM's engine-core
  timestamps) over its GEN - 1 later tokens, median over the batch; decode tokens/s
  = BATCH / step time. The report also gives the cached prompt tokens, so a missed
  prefix cache (decode overlapping prefill) shows.
CUDA graphs on (vLLM's default). The report gives the ratio Triton / upstream.
`--profile` also profiles 16 decode steps of the batch at the last context per path
(torch.profiler; the engine then runs in the worker's process, which the timings
share) and prints the kernels with the most GPU time and the CUDA-graph launches.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PATHS = {
    "upstream": {"backend": "FLASHMLA_SPARSE", "indexer": "deepgemm"},
    "portable": {"backend": "TRITON_MLA_SPARSE", "indexer": "triton"},
}


def glm5_config(layers: int, experts: int, vocab: int) -> dict:
    """GLM-5's per-layer shape (GlmMoeDsaConfig defaults), fewer layers/experts."""
    from transformers import GlmMoeDsaConfig

    cfg = GlmMoeDsaConfig(num_hidden_layers=layers, n_routed_experts=experts,
                          first_k_dense_replace=1, vocab_size=vocab)
    d = cfg.to_dict()
    d.update({
        "architectures": ["GlmMoeDsaForCausalLM"],
        "mlp_layer_types": ["dense"] + ["sparse"] * (layers - 1),
        "indexer_types": ["full"] * layers,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "indexer_rope_interleave": True,
        "num_nextn_predict_layers": 0,
        "dtype": "bfloat16",
    })
    return d


def decode_step_s(outputs) -> float:
    """Median over requests of (last token - first token) / (tokens after the first),
    from the RequestOutput metrics vLLM keeps with log stats on."""
    steps = sorted((o.metrics.last_token_ts - o.metrics.first_token_ts)
                   / (o.metrics.num_generation_tokens - 1) for o in outputs)
    return steps[len(steps) // 2]


def timed_generate(llm, n: int, batch: int, max_tokens: int, seed: int, vocab: int):
    """(wall seconds, outputs) of greedy generation for `batch` prompts of `n` token
    ids in 10..vocab-1, distinct per (seed, request): no prefix shared across seeds."""
    from vllm import SamplingParams

    ids = [[(seed * 7919 + b * 104729 + i * 13) % (vocab - 10) + 10 for i in range(n)]
           for b in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
    return time.perf_counter() - t0, outs


def worker(args) -> None:
    from tests.plugins.vllm_report_capability import vllm_report_capability as hook

    # the portable path on a GPU with DeepGEMM: the test plugin reports no DeepGEMM
    env = hook.indexer_env(PATHS[args.path]["indexer"])
    if hook.missing(env):
        sys.exit("pip install --no-deps tests/plugins/vllm_report_capability first")
    os.environ.update(env)
    if args.profile:  # the profiler sees only this process's kernels
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    llm = LLM(model=args.model_dir, load_format="dummy", skip_tokenizer_init=True,
              max_model_len=max(args.contexts) + args.gen + 16, block_size=64,
              enable_prefix_caching=True, disable_log_stats=False,
              max_num_seqs=args.batch, seed=0, gpu_memory_utilization=0.85,
              attention_config={"backend": PATHS[args.path]["backend"]})

    def run(ctx, batch, max_tokens, seed):
        # token ids 10..150009, inside GLM-5's vocabulary
        return timed_generate(llm, ctx, batch, max_tokens, seed, vocab=150010)

    rows = []
    for ctx in args.contexts:
        run(ctx, 1, 2, 0)  # warm up this context length
        ttft = min(run(ctx, 1, 1, seed)[0] for seed in (1, 2, 3))
        run(ctx, args.batch, 1, 4)  # the decode prompts into the prefix cache
        wall, outs = run(ctx, args.batch, 1 + args.gen, 4)
        step = decode_step_s(outs)
        rows.append({"context": ctx, "ttft_s": ttft, "batch": args.batch, "gen": args.gen,
                     "decode_step_ms": 1e3 * step, "decode_tok_s": args.batch / step,
                     "decode_run_wall_s": wall,
                     "cached_prompt_tokens": sum(o.num_cached_tokens or 0 for o in outs),
                     "prompt_tokens": args.batch * ctx,
                     "engine_in_process": bool(args.profile)})
    result = {"rows": rows}
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            # the last context's prompts are cached: 16 decode steps of the batch
            run(args.contexts[-1], args.batch, 1 + 16, 4)
        events = prof.key_averages()
        result["profile"] = events.table(sort_by="cuda_time_total", row_limit=25)
        result["cuda_graph_launches"] = sum(e.count for e in events
                                            if e.key == "cudaGraphLaunch")
    Path(args.out).write_text(json.dumps(result))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--contexts", type=int, nargs="*", default=[8192, 32768])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--vocab", type=int, default=154880)
    p.add_argument("--paths", nargs="*", default=list(PATHS))
    p.add_argument("--profile", action="store_true",
                   help="also profile 16 decode steps per path (in-process engine)")
    p.add_argument("--path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.path:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(
            json.dumps(glm5_config(args.layers, args.experts, args.vocab)))
        results = {}
        for path in args.paths:
            out = Path(tmp) / f"{path}.json"
            cmd = [sys.executable, "-m", "benchmarks.glm5_throughput", "--path", path,
                   "--model-dir", tmp, "--out", str(out), "--batch", str(args.batch),
                   "--gen", str(args.gen),
                   "--contexts", *map(str, args.contexts),
                   *(["--profile"] if args.profile else [])]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                sys.exit(f"{path} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
            results[path] = json.loads(out.read_text())
            if args.profile:
                print(f"== {path}: 16 decode steps, {results[path]['cuda_graph_launches']} "
                      f"CUDA-graph launches\n{results[path]['profile']}")
    print(f"GLM-5 per-layer shape, {args.layers} layers, {args.experts} routed experts, "
          f"batch {args.batch}, {args.gen} generated tokens")
    print("| context | path | TTFT ms | decode step ms | decode tok/s | portable/upstream "
          "decode | cached prompt tokens |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for i, ctx in enumerate(args.contexts):
        base = (results["upstream"]["rows"][i] if "upstream" in results else None)
        for path in args.paths:
            r = results[path]["rows"][i]
            ratio = (f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}"
                     if base and path != "upstream" else "-")
            print(f"| {ctx} | {path} | {1e3 * r['ttft_s']:.1f} | {r['decode_step_ms']:.2f} | "
                  f"{r['decode_tok_s']:.1f} | {ratio} | "
                  f"{r['cached_prompt_tokens']}/{r['prompt_tokens']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results},
                                              indent=1))


if __name__ == "__main__":
    main()
