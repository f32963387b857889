# SPDX-License-Identifier: Apache-2.0
"""Accuracy on the same GGUF: the overlay and llama.cpp against transformers fp32.

    python -m benchmarks.glm5_gguf_accuracy --out DIR --llama-lib DIR [--bindings DIR]
        [--paths portable-fp16 portable-bf16 upstream-bf16 portable-fp16-bi
                 upstream-bf16-gguf-moe portable-fp16-gguf-moe portable-bf16-keys16
                 portable-fp16-keys16]
        [--eager]
        [--json FILE]
        [--rounding bfloat16 float16 fp8-indexer bfloat16-fp8-indexer float16-fp8-indexer]
        [--device cuda] [--llama-gpu-layers N]
        [--max-tokens 32] [--llama-runner ctypes|c] [--llama-src DIR]

The tiny GLM-5 (tests/models/glm5_tiny.py) as llama.cpp writes it: bf16, q8_0
(converter) and Q4_K_M (llama-quantize), made and referenced as
benchmarks/glm5_accuracy_matrix.py does (transformers' GlmMoeDsaForCausalLM in float32 on
each file's weights dequantized by gguf-py). Both engines run the same prompts
(tests/models/glm5_generate.py: token ids, 300-1000 tokens, longer than the model's
index_topk, then 32 greedy tokens):
- the overlay: tests/models/glm5_generate.py (vLLM, CUDA graphs unless --eager) on each
  path of PATHS (`portable-fp16-bi`: under VLLM_BATCH_INVARIANT=1, every GGUF product on
  16-bit activations, where `portable-fp16`'s kernels quantize activations to int8 for dense
  products below 256 tokens and experts below 1024 (Q4_K experts run vLLM's Marlin MoE on
  16-bit activations, except under batch invariance); `-gguf-moe`: VLLM_GGUF_MOE_MARLIN=0,
  those on the GGUF kernels too;
  `-keys16`: VLLM_SPARSE_INDEXER_CACHE=16bit, the indexer's keys cached and its queries
  kept in the model's dtype, where the default rounds both to e4m3);
- llama.cpp: benchmarks/llama_cpp_logits.py on libllama.so of `--llama-lib` (all layers
  on the GPU unless --llama-gpu-layers, prompt in one batch);
- rounding alone: transformers on the same dequantized weights in each dtype of
  `--rounding` (rows `transformers-bf16`, `transformers-fp16`), what any engine computing in
  that dtype starts from, and in float32 with the indexer's q and k rounded to e4m3 as vLLM's
  indexer stores them (`transformers-fp8-indexer`), or in bf16/fp16 with them so rounded
  (`transformers-bf16-fp8-indexer`, `-fp16-`: the overlay's default paths without its kernels).
With no `--paths` and `--device cpu --llama-gpu-layers 0` it runs without a GPU (llama.cpp's
CPU build: its CPU kernels, not its CUDA ones).
One metric, tests/models/glm5_runs.compare(): the mean |delta| of the prompt tokens'
logprobs over the tokens both top-5 lists hold, the prompt token's own included (with its
max, and the greedy agreement up to the first parting; in the JSON also split at the
model's index_topk: `mean_short_context`, `mean_long_context`). The table gives each engine's
error on each file and the overlay's over llama.cpp's (the issue's target: <= 1 on the
quantized files).
"""

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.models.glm5_tiny import TINY_GLM5


SOURCES = ("gguf-bf16", "gguf-q8_0", "gguf-Q4_K_M")
# the tiny GLM-5's index_topk: each row's error also split at it (compare(split_at)),
# positions whose whole context the sparse top-k selects against the others
TOPK = TINY_GLM5["index_topk"]
PATHS = {
    # SM120's path, forced: our attention backend and indexer, float16 (its GGUF default)
    "portable-fp16": {"attention_backend": "TRITON_MLA_SPARSE", "indexer": "triton",
                      "dtype": "float16"},
    "portable-bf16": {"attention_backend": "TRITON_MLA_SPARSE", "indexer": "triton",
                      "dtype": "bfloat16"},
    # vLLM's own choice on the GPU it runs on (FlashMLA/FA sparse + DeepGEMM on the H200)
    "upstream-bf16": {"dtype": "bfloat16"},
    # SM120's path with every GGUF product on 16-bit activations (batch-invariant mode's
    # Triton kernels), where the plugin's MMVQ/MMQ kernels quantize activations to int8
    "portable-fp16-bi": {"attention_backend": "TRITON_MLA_SPARSE", "indexer": "triton",
                         "dtype": "float16"},
    # two paths above with the Q4_K experts on the GGUF kernels instead of Marlin
    "upstream-bf16-gguf-moe": {"dtype": "bfloat16"},
    "portable-fp16-gguf-moe": {"attention_backend": "TRITON_MLA_SPARSE", "indexer": "triton",
                               "dtype": "float16"},
    # the two portable paths with the indexer's keys and queries in 16 bits
    "portable-bf16-keys16": {"attention_backend": "TRITON_MLA_SPARSE", "indexer": "triton",
                             "dtype": "bfloat16"},
    "portable-fp16-keys16": {"attention_backend": "TRITON_MLA_SPARSE", "indexer": "triton",
                             "dtype": "float16"},
}
KEYS16 = {"VLLM_SPARSE_INDEXER_CACHE": "16bit"}
PATH_ENV = {"portable-fp16-bi": {"VLLM_BATCH_INVARIANT": "1"},
            "upstream-bf16-gguf-moe": {"VLLM_GGUF_MOE_MARLIN": "0"},
            "portable-fp16-gguf-moe": {"VLLM_GGUF_MOE_MARLIN": "0"},
            "portable-bf16-keys16": KEYS16, "portable-fp16-keys16": KEYS16}


# the overlay's switches: (on unless 0, the default; else only with 1), and glm5_generate's
# count of what each runs, which the Q4_K_M file's row must show where it is on
SWITCHES = {"VLLM_GGUF_MOE_MARLIN": (True, "marlin_moe_calls")}  # Q4_K experts on Marlin


def runs(path: str, switch: str) -> bool:
    """Whether a path's engine runs what `switch` turns on (as the module reads it; never
    under batch invariance)."""
    env = path_env(path) or os.environ
    on_by_default = SWITCHES[switch][0]
    value = env.get(switch, "1" if on_by_default else "0").strip()
    on = value != "0" if on_by_default else value == "1"
    return on and env.get("VLLM_BATCH_INVARIANT", "0") != "1"


def switch_counts(source: str, path: str, res: dict) -> dict:
    """The counts of the switches' kernels in a path's glm5_generate result, checked:
    on the Q4_K_M file each switch the path turns on must have run, and on every file
    the 16-bit indexer key cache must have been written exactly where the path asks
    for it (VLLM_SPARSE_INDEXER_CACHE=16bit)."""
    counts = {key: res.get(key) for _, key in SWITCHES.values()}
    for switch, (_, key) in SWITCHES.items():
        if source == "gguf-Q4_K_M" and runs(path, switch) and not counts[key]:
            raise RuntimeError(f"{path}: {switch} is on but {key} is {counts[key]!r}")
    env = path_env(path) or os.environ
    keys16 = env.get("VLLM_SPARSE_INDEXER_CACHE", "fp8").strip().lower() == "16bit"
    counts["keys16_writes"] = res["keys16_cache_calls"]["write"]
    if keys16 != (counts["keys16_writes"] > 0):
        raise RuntimeError(f"{path}: the 16-bit indexer key cache {'is' if keys16 else 'is not'}"
                           f" asked for but was written {counts['keys16_writes']} times")
    return counts


def path_env(path: str) -> dict | None:
    """The environment of a path's engine process (None: this process's own)."""
    return {**os.environ, **PATH_ENV[path]} if path in PATH_ENV else None


# rounding alone: --rounding choice -> (row, glm5_hf_reference's options). The last two
# are the overlay's default paths' roundings without its kernels: the model's dtype with
# vLLM's fp8 indexer q and k (the overlay's float16 layers scale the residual stream, with
# the RMSNorm eps matched: the same function, so no scale here).
ROUNDING = {
    "bfloat16": ("transformers-bf16", {"dtype": "bfloat16"}),
    "float16": ("transformers-fp16", {"dtype": "float16"}),
    "fp8-indexer": ("transformers-fp8-indexer", {"indexer_fp8": True}),
    "bfloat16-fp8-indexer": ("transformers-bf16-fp8-indexer",
                             {"dtype": "bfloat16", "indexer_fp8": True}),
    "float16-fp8-indexer": ("transformers-fp16-fp8-indexer",
                            {"dtype": "float16", "indexer_fp8": True}),
}


def llama_cpp_run(gguf: Path, out: Path, lib: str, bindings: str | None,
                  gpu_layers: int | None = None, max_tokens: int = 32,
                  runner: str = "ctypes", llama_src: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.llama_cpp_logits", "--gguf",
           str(gguf), "--lib", lib, "--out", str(out), "--max-tokens", str(max_tokens),
           "--runner", runner, *(["--llama-src", llama_src] if llama_src else []),
           *(["--bindings", bindings] if bindings else []),
           *(["--n-gpu-layers", str(gpu_layers)] if gpu_layers is not None else [])]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    out.with_suffix(".log").write_text(res.stdout + res.stderr)
    if res.returncode != 0:
        raise RuntimeError(f"llama_cpp_logits.py failed ({res.returncode}): "
                           f"{res.stderr[-1500:]}")
    return json.loads(out.read_text())


def rows_table(results: dict, paths) -> list[str]:
    """source | llama.cpp mean (max, greedy) | each path's mean (max, greedy) and its
    ratio to llama.cpp's mean."""
    def cell(r):
        if r is None:
            return "-"
        if "error" in r:
            return "error"
        return f"{r['mean']:.3f} ({r['max']:.2f}, {r['greedy_agreement']:.2f})"

    head = ["source", "llama.cpp"] + [f"{p} | {p} / llama.cpp" for p in paths]
    lines = ["| " + " | ".join(head) + " |",
             "|---|---|" + "---|---:|" * len(paths)]
    for source in SOURCES:
        llama = results.get((source, "llama.cpp"))
        cells = [source, cell(llama)]
        for p in paths:
            r = results.get((source, p))
            ratio = ("-" if not r or "error" in r or not llama or "error" in llama
                     else f"{r['mean'] / llama['mean']:.2f}")
            cells += [cell(r), ratio]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--llama-lib", required=True, help="the folder holding libllama.so")
    p.add_argument("--bindings", default=None,
                   help="the llama-cpp-python sdist folder (llama_cpp_logits.py --bindings)")
    p.add_argument("--paths", nargs="*", choices=list(PATHS), default=list(PATHS))
    p.add_argument("--rounding", nargs="*", choices=list(ROUNDING), default=list(ROUNDING))
    p.add_argument("--device", default="cuda", help="for transformers (references, rounding)")
    p.add_argument("--llama-gpu-layers", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--llama-runner", choices=("ctypes", "c"), default="ctypes",
                   help="llama_cpp_logits.py --runner")
    p.add_argument("--llama-src", default=None, help="llama_cpp_logits.py --llama-src")
    p.add_argument("--eager", action="store_true")
    p.add_argument("--parallel", type=int, default=6)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from benchmarks import glm5_accuracy_matrix
    from tests.models.glm5_runs import compare, generate, hf_reference

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # {source: (file, fp32 reference)}
    sources = glm5_accuracy_matrix.prepare(out, device=args.device, max_tokens=args.max_tokens)

    def overlay(source, path):
        f, ref = sources[source]
        res = generate(f, out / f"{source}-{path}.json", eager=args.eager,
                       env=path_env(path), max_tokens=str(args.max_tokens), **PATHS[path])
        counts = switch_counts(source, path, res)
        return {**compare(ref, res, TOPK), "attention_backend": res.get("attention_backend"),
                "indexer_backend": res["indexer_backend"], "dtype": res["dtype"], **counts}

    def llama(source):
        f, ref = sources[source]
        return compare(ref, llama_cpp_run(f, out / f"{source}-llama.json", args.llama_lib,
                                          args.bindings, args.llama_gpu_layers,
                                          args.max_tokens, args.llama_runner,
                                          args.llama_src), TOPK)

    def rounding(source, choice):
        ckpt = glm5_accuracy_matrix.checkpoint(out, source)
        res = hf_reference(ckpt, out / f"{source}-{choice}.json", device=args.device,
                           max_tokens=args.max_tokens, **ROUNDING[choice][1])
        return compare(sources[source][1], res, TOPK)

    jobs = {(s, "llama.cpp"): (llama, (s,)) for s in SOURCES}
    jobs.update({(s, path): (overlay, (s, path)) for s in SOURCES for path in args.paths})
    jobs.update({(s, ROUNDING[d][0]): (rounding, (s, d)) for s in SOURCES for d in args.rounding})
    results = {}
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        futures = {pool.submit(fn, *a): k for k, (fn, a) in jobs.items()}
        for fut in concurrent.futures.as_completed(futures):
            k = futures[fut]
            try:
                results[k] = fut.result()
            except Exception as e:  # noqa: BLE001 - a failed row is reported, not dropped
                results[k] = {"error": str(e)[-1500:]}  # the end holds the cause
            print("row " + json.dumps({"source": k[0], "engine": k[1], **results[k]}),
                  flush=True)
    columns = [ROUNDING[d][0] for d in args.rounding] + args.paths
    lines = rows_table(results, columns)
    print("\n".join(lines))
    report = [{"source": s, "engine": e, **r} for (s, e), r in sorted(results.items())]
    (Path(args.json) if args.json else out / "accuracy.json").write_text(
        json.dumps({"rows": report, "eager": args.eager, "device": args.device,
                    "llama_gpu_layers": args.llama_gpu_layers,
                    "max_tokens": args.max_tokens}, indent=1) + "\n")


if __name__ == "__main__":
    main()
