# SPDX-License-Identifier: Apache-2.0
"""Accuracy matrix of the tiny GLM-5 and GLM-5.2 in vLLM against transformers fp32.

    python -m benchmarks.glm5_accuracy_matrix --out DIR [--parallel 6] [--modes eager graphs]
        [--models glm5 glm52] [--paths PATH...]

Rows: model {the tiny GLM-5 (tests/models/glm5_tiny.make_tiny_glm5), the tiny GLM-5.2
(make_tiny_glm52: IndexShare)} x source {safetensors, GGUF bf16, GGUF q8_0, GGUF
Q4_K_M} x path {FLASHMLA_SPARSE + DeepGEMM (upstream), TRITON_MLA_SPARSE + DeepGEMM,
TRITON_MLA_SPARSE + portable indexer, the same as on an A100 (SM80's path: the indexer's
16-bit dots; capability 8.0 and its shared memory reported by
tests/plugins/vllm_report_capability)} x {eager, CUDA graphs} x dtype {bf16, fp16}.
Each row runs tests/models/glm5_generate.py (prompts of 300-1000 tokens, longer
than the model's index_topk of 128; 32 greedy tokens) and is compared with
transformers' GlmMoeDsaForCausalLM in fp32 on the same weights (for a GGUF: the
file's weights dequantized by gguf-py). Rows run as parallel processes sharing the
GPU (the models are tiny).

Tolerance, and why: this random model amplifies rounding (one bf16 kernel swap
already moves prompt logprobs by ~0.15 nats), so an absolute bound would be
arbitrary. A row passes when its mean |delta logprob| against fp32 is at most
2x that of the upstream path (FLASHMLA_SPARSE + DeepGEMM) for the same model, source,
mode and dtype, plus 0.05 nats; where the upstream row did not run (for
instance a dtype its kernels do not take), the bound comes from the upstream bf16
row. Greedy agreement with fp32 is reported, not bounded. A row that fails to run
is reported with its error, and a row whose indexer ran other dots than its path
names fails: no row is left out. Exit status 1 when a row of ours fails or did not
run.
"""

import argparse
import concurrent.futures
import itertools
import json
import os
import sys
from pathlib import Path


MODELS = ("glm5", "glm52")
SOURCES = ("safetensors", "gguf-bf16", "gguf-q8_0", "gguf-Q4_K_M")
PATHS = {
    "upstream": {"attention_backend": "FLASHMLA_SPARSE", "indexer": "deepgemm"},
    "triton-attn": {"attention_backend": "TRITON_MLA_SPARSE", "indexer": "deepgemm"},
    "portable": {"attention_backend": "TRITON_MLA_SPARSE", "indexer": "triton"},
    "portable-16bit": {"attention_backend": "TRITON_MLA_SPARSE", "indexer": "triton"},
}
# the GPU a path runs as (the test hook's report; glm5_generate applies it in its own
# process, no install needed) and the indexer dots that must be seen to run there
PATH_ENV = {"portable-16bit": {"VLLM_TEST_REPORT_CAPABILITY": "8.0",
                               "VLLM_TEST_REPORT_SHARED_MEM": str(163 * 1024)}}
PATH_DOTS = {"portable-16bit": "16bit"}
MODES = ("eager", "graphs")
DTYPES = ("bfloat16", "float16")


def rows(modes=MODES, models=MODELS, paths=tuple(PATHS)):
    """The rows of these modes, models and paths; the upstream path's always (the bound)."""
    paths = ["upstream"] + [p for p in PATHS if p in paths and p != "upstream"]
    return [dict(model=mo, source=s, path=p, mode=m, dtype=d)
            for mo, s, p, m, d in itertools.product(models, SOURCES, paths, modes, DTYPES)]


def bound(row: dict, results: dict) -> float | None:
    """The row's bound on mean |delta| against fp32 (None: no upstream reference ran)."""
    def upstream(dtype):
        r = results.get((row["model"], row["source"], "upstream", row["mode"], dtype))
        return r["vs_fp32"]["mean"] if r and "vs_fp32" in r else None

    ref = upstream(row["dtype"])
    if ref is None:
        ref = upstream("bfloat16")
    return None if ref is None else 2 * ref + 0.05


def status(res: dict, bound_: float | None) -> dict:
    """A row's status: upstream rows are the reference; ours pass or FAIL on the bound."""
    res = dict(res, bound=bound_)
    if res["path"] == "upstream":
        res["status"] = "reference" if "vs_fp32" in res else "reference did not run"
    elif "vs_fp32" not in res:
        res["status"] = "did not run"
    elif res["path"] in PATH_DOTS and res.get("indexer_dots") != PATH_DOTS[res["path"]]:
        res["status"] = f"FAIL (indexer dots {res.get('indexer_dots')})"
    elif bound_ is None:
        res["status"] = "FAIL (no reference)"
    else:
        res["status"] = "pass" if res["vs_fp32"]["mean"] <= bound_ else "FAIL"
    return res


def checkpoint(out: Path, source: str) -> Path:
    """Where prepare() writes the checkpoint of a GGUF source's dequantized weights."""
    return out / f"deq-{source}"


def prepare(out: Path, model_name: str = "glm5", *, device: str = "cuda",
            max_tokens: int = 32) -> dict:
    """The tiny model, its GGUFs and the fp32 references; {source: (model, ref json)}."""
    from tests.models.glm5_runs import hf_reference
    from tests.models.glm5_tiny import make_tiny_glm5, make_tiny_glm52
    from tests.models.quantization import gguf_reference as gr

    make = {"glm5": make_tiny_glm5, "glm52": make_tiny_glm52}[model_name]
    model = make(out / f"tiny-{model_name}")
    gr.write_tokenizer(model, gr.config(model)["vocab_size"])
    llama_cpp = gr.llama_cpp_dir(out / "llama-cpp")
    gguf = gr.gguf_module(llama_cpp)
    files = {"safetensors": model}
    bf16 = gr.convert(llama_cpp, model, out / "tiny-bf16.gguf", "bf16")
    files["gguf-bf16"] = bf16
    files["gguf-q8_0"] = gr.convert(llama_cpp, model, out / "tiny-q8_0.gguf", "q8_0")
    files["gguf-Q4_K_M"] = gr.quantize(bf16, out / "tiny-Q4_K_M.gguf", "Q4_K_M")
    refs = {}
    for source, f in files.items():
        ckpt = model if source == "safetensors" else gr.dequantized_checkpoint(
            gguf, f, model, checkpoint(out, source))
        refs[source] = hf_reference(ckpt, out / f"fp32-{source}.json", device=device,
                                    max_tokens=max_tokens)
    return {s: (files[s], refs[s]) for s in files}


def run_row(row: dict, model: Path, ref: dict, out: Path, mem: float) -> dict:
    from tests.models.glm5_runs import compare, generate

    name = "-".join(row.values())
    env = {**os.environ, **PATH_ENV[row["path"]]} if row["path"] in PATH_ENV else None
    try:
        res = generate(model, out / f"{name}.json", eager=row["mode"] == "eager", env=env,
                       dtype=row["dtype"], gpu_memory_utilization=str(mem), **PATHS[row["path"]])
    except AssertionError as e:  # the run failed: keep its error as the row's result
        return {**row, "error": str(e)[:600]}  # glm5_runs puts the error lines first
    return {**row, "vs_fp32": compare(ref, res), "indexer_backend": res["indexer_backend"],
            "indexer_dots": res.get("indexer_dots"),
            "attention_backend": res.get("attention_backend")}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--parallel", type=int, default=6)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="run only these modes (each mode's rows carry their own references)")
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS),
                   help="run only these paths (and upstream's, which bounds them)")
    p.add_argument("--mem-total", type=float, default=0.85,
                   help="GPU memory fraction shared by the parallel rows")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sources = {m: prepare(out / m, m) for m in args.models}
    mem = round(args.mem_total / args.parallel, 3)
    results = {}
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        futures = {pool.submit(run_row, r, *sources[r["model"]][r["source"]], out / r["model"],
                               mem): r
                   for r in rows(args.modes, args.models, args.paths)}
        for fut in concurrent.futures.as_completed(futures):
            r = fut.result()
            results[tuple(r[k] for k in ("model", "source", "path", "mode", "dtype"))] = r
            # progress, so that a run cut short still shows the rows it finished
            print("row " + json.dumps(r), flush=True)
    table = [status(results[tuple(r.values())], bound(r, results))
             for r in rows(args.modes, args.models, args.paths)]
    print("| model | source | path | mode | dtype | mean |d| | max |d| | greedy agree | bound "
          "| status |")
    print("|---|---|---|---|---|---:|---:|---:|---:|---|")
    for r in table:
        v = r.get("vs_fp32")
        cells = (f"{v['mean']:.3f} | {v['max']:.2f} | {v['greedy_agreement']:.2f}" if v
                 else "- | - | -")
        b = "-" if r.get("bound") is None else f"{r['bound']:.3f}"
        why = f": {r['error'].strip().splitlines()[0][-100:]}" if "error" in r else ""
        print(f"| {r['model']} | {r['source']} | {r['path']} | {r['mode']} | {r['dtype']} "
              f"| {cells} | {b} | {r['status']}{why} |")
    (out / "matrix.json").write_text(json.dumps(table, indent=1))
    sys.exit(0 if all(r["status"] in ("pass", "reference", "reference did not run")
                      for r in table) else 1)


if __name__ == "__main__":
    main()
