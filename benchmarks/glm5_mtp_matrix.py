# SPDX-License-Identifier: Apache-2.0
"""MTP speculative decoding in vLLM from the files people serve: lossless greedy
output and acceptance, by file type.

    python -m benchmarks.glm5_mtp_matrix --out DIR [--parallel 8] [--models glm5 glm52]
        [--json FILE]

Models: the trained tiny GLM-5 (tests/models/glm5_trained.py, whose MTP head
predicts its corpus) and the tiny GLM-5.2 (tests/models/glm5_tiny.py: IndexShare,
`index_share_for_mtp_iteration`; random weights, so its drafts are rarely
accepted). Sources: the safetensors checkpoint, and the GGUFs llama.cpp writes of
it: bf16, f16 and q8_0 (converter), Q4_K_M, Q2_K and IQ2_M (llama-quantize; IQ2_M
with an importance matrix from llama-imatrix), which quantize the embedding and the
nextn tensors too. Each row is one engine (tests/models/glm5_mtp_generate.py:
greedy, 8 corpus prompts of 40-320 tokens, 64 new tokens) with N = 0 (no MTP) or
N = 1..3 draft tokens; TRITON_MLA_SPARSE named for target and draft, the portable
indexer, float16, eager; plus CUDA graphs for the GLM-5's bf16 and Q4_K_M at N = 0
and 3, Q4_K_M as on SM120 (capability 12.0 and its shared memory reported, nothing forced,
dtype auto) at N = 0 and 3, mode `bi`: the quantized files under VLLM_BATCH_INVARIANT=1
(eager), where every token count runs the same GGUF kernels, so that a verification step
of N + 1 tokens computes what a decode step computes, and mode `upstream`: the GLM-5's
safetensors, bf16 and Q4_K_M at N = 0..3 on vLLM's own choice of backend and indexer
(bfloat16, eager; nothing named). Rows run as parallel processes on one GPU; `--modes`
and `--sources` take a subset.

Checks (exit status 1 when one fails or a row did not run):
- greedy output with MTP is the output without it (same model, source, mode),
  except at near-ties: at the first token where they part, the top-2 logprob gap
  of the run without MTP is under NEAR_TIE nats; the first parting is reported
  with its gap, and the prompts that part by length; under batch invariance
  (mode `bi`) with no parting at all;
- the acceptance length of each GGUF row within 10% of the bf16 file's at the same
  N and mode (eager where bf16 has no row in that mode), safetensors' reported beside;
  in mode `upstream` the bf16 file's, the same weights, within 5% of safetensors';
- target and draft ran TRITON_MLA_SPARSE; in mode `upstream`, one backend not ours.
"""

import argparse
import concurrent.futures
import json
import os
import sys
from pathlib import Path


NEAR_TIE = 0.05  # nats
ACCEPTANCE_TOLERANCE = 0.10  # relative to the bf16 file's
MODELS = ("glm5", "glm52")
SOURCES = ("safetensors", "bf16", "f16", "q8_0", "Q4_K_M", "Q2_K", "IQ2_M")
CONVERTED = ("bf16", "f16", "q8_0")  # llama.cpp's converter writes these
MODES = ("eager", "graphs", "sm120", "bi", "upstream")
DRAFT_TOKENS = (1, 2, 3)
FORCED = {"attention_backend": "TRITON_MLA_SPARSE", "indexer": "triton", "dtype": "float16"}
SM120_ENV = {"VLLM_TEST_REPORT_CAPABILITY": "12.0", "VLLM_TEST_REPORT_SHARED_MEM": "101376"}
BI_ENV = {"VLLM_BATCH_INVARIANT": "1"}
BI_SOURCES = ("bf16", "q8_0", "Q4_K_M", "Q2_K", "IQ2_M")
UPSTREAM_SOURCES = ("safetensors", "bf16", "Q4_K_M")
SAME_WEIGHTS_TOLERANCE = 0.05  # upstream mode: the bf16 file's against safetensors'
OURS = "TRITON_MLA_SPARSE"


def rows(models=MODELS, modes=MODES, sources=SOURCES) -> list[dict]:
    out = []
    if "eager" in modes:
        out += [dict(model=m, source=s, mode="eager", n=n)
                for m in models for s in sources for n in (0, *DRAFT_TOKENS)]
    if "graphs" in modes and "glm5" in models:  # the model whose drafts are accepted
        out += [dict(model="glm5", source=s, mode="graphs", n=n)
                for s in ("bf16", "Q4_K_M") if s in sources for n in (0, 3)]
    if "sm120" in modes and "Q4_K_M" in sources:
        out += [dict(model=m, source="Q4_K_M", mode="sm120", n=n) for m in models
                for n in (0, 3)]
    if "bi" in modes:
        out += [dict(model=m, source=s, mode="bi", n=n) for m in models
                for s in BI_SOURCES if s in sources for n in (0, *DRAFT_TOKENS)]
    if "upstream" in modes and "glm5" in models:
        out += [dict(model="glm5", source=s, mode="upstream", n=n)
                for s in UPSTREAM_SOURCES if s in sources for n in (0, *DRAFT_TOKENS)]
    return out


def key(row: dict) -> tuple:
    return row["model"], row["source"], row["mode"], row["n"]


def parting(base: dict, spec: dict) -> dict | None:
    """Where a run with MTP first parts from the run without it: prompt, step, both
    tokens, and the top-2 logprob gap of the run without MTP there; None if never."""
    for i, (oa, ob) in enumerate(zip(base["outputs"], spec["outputs"])):
        for j, (ta, tb) in enumerate(zip(oa["tokens"], ob["tokens"])):
            if ta != tb:
                top = sorted(oa["logprobs"][j].values(), reverse=True)
                gap = top[0] - top[1] if len(top) > 1 else float("inf")
                return {"prompt": i, "step": j, "without_mtp": ta, "with_mtp": tb, "gap": gap}
    return None


def prompts_parted(base: dict, spec: dict) -> list[int]:
    """The prompt lengths (the index where a run names none) of every prompt whose
    greedy output with MTP parts from the output without it."""
    return [oa.get("prompt_len", i)
            for i, (oa, ob) in enumerate(zip(base["outputs"], spec["outputs"]))
            if oa["tokens"] != ob["tokens"]]


def check(results: dict) -> list[dict]:
    """The rows with their checks: lossless (or a near-tie parting), acceptance
    against the bf16 file's, the backends."""
    table = []
    for k, res in results.items():
        model, source, mode, n = k
        row = dict(res, model=model, source=source, mode=mode, n=n)
        problems = []
        if "error" in res:
            problems.append("did not run")
        else:
            target = res.get("target_attention_backend")
            backends = {target, res.get("draft_attention_backend") if n else target}
            if (backends != {OURS} if mode != "upstream"
                    else len(backends) != 1 or backends & {OURS, None}):
                problems.append("backend")
            base = results.get((model, source, mode, 0))
            if n and base is not None and "error" not in base:
                row["parting"] = p = parting(base, res)
                row["prompts_parted"] = prompts_parted(base, res)
                if p is not None and (mode == "bi" or not p["gap"] < NEAR_TIE):
                    problems.append(f"parts at a gap of {p['gap']:.3f}")
            elif n:
                problems.append("no run without MTP to compare")
            # the bf16 file's row in the same mode, else its eager row (sm120 has none)
            ref = results.get((model, "bf16", mode, n)) or results.get((model, "bf16", "eager", n))
            al = res.get("acceptance", {}).get("acceptance_length")
            if n and source not in ("bf16", "safetensors"):
                ref_al = (ref or {}).get("acceptance", {}).get("acceptance_length")
                row["acceptance_vs_bf16"] = None if not ref_al else al / ref_al
                if ref_al is None or abs(al / ref_al - 1) > ACCEPTANCE_TOLERANCE:
                    problems.append("acceptance")
            if n and mode == "upstream" and source == "bf16":
                st = results.get((model, "safetensors", mode, n)) or {}
                st_al = st.get("acceptance", {}).get("acceptance_length")
                row["acceptance_vs_safetensors"] = None if not st_al else al / st_al
                if st_al is None or abs(al / st_al - 1) > SAME_WEIGHTS_TOLERANCE:
                    problems.append("acceptance against safetensors")
        row["status"] = "pass" if not problems else "FAIL: " + ", ".join(problems)
        table.append(row)
    return table


def prepare(out: Path, models, sources=SOURCES) -> dict:
    """{(model, source): path} of each source (bf16 always: the quantizer's input)."""
    from tests.models import glm5_trained
    from tests.models.glm5_tiny import make_tiny_glm52
    from tests.models.quantization import gguf_reference as gr

    llama_cpp = gr.llama_cpp_dir(out / "llama-cpp")
    checkpoints = {}
    if "glm5" in models:
        checkpoints["glm5"] = glm5_trained.trained_glm5()
    if "glm52" in models:
        checkpoints["glm52"] = make_tiny_glm52(out / "tiny-glm52")
        gr.write_tokenizer(checkpoints["glm52"], gr.config(checkpoints["glm52"])["vocab_size"])
    files = {}
    for model, ckpt in checkpoints.items():
        files[(model, "safetensors")] = ckpt
        for kind in CONVERTED:
            if kind == "bf16" or kind in sources:
                files[(model, kind)] = gr.convert(llama_cpp, ckpt, out / f"{model}-{kind}.gguf",
                                                  kind)
        for kind in SOURCES:
            if kind not in CONVERTED and kind != "safetensors" and kind in sources:
                files[(model, kind)] = gr.quantize(files[(model, "bf16")],
                                                   out / f"{model}-{kind}.gguf", kind)
    return files


def run_row(row: dict, model: Path, out: Path) -> dict:
    from tests.models.glm5_runs import _run

    args = ["--model", str(model), "--num-speculative-tokens", str(row["n"]),
            "--speed-tokens", "0"]
    env = {**os.environ, **BI_ENV} if row["mode"] == "bi" else None
    if row["mode"] == "sm120":
        env = {**os.environ, **SM120_ENV}
        args += ["--dtype", "auto", "--eager"]
    elif row["mode"] == "upstream":  # vLLM's own backend and indexer
        args += ["--dtype", "bfloat16", "--eager"]
    else:
        for k, v in FORCED.items():
            args += [f"--{k.replace('_', '-')}", v]
        args += ["--eager"] if row["mode"] in ("eager", "bi") else []
    try:
        res = _run("tests.models.glm5_mtp_generate", row_file(row, out), args, env=env)
    except AssertionError as e:
        return {**row, "error": str(e)[:600]}
    return row_result(row, res)


def row_file(row: dict, out: Path) -> Path:
    return out / ("-".join(map(str, row.values())) + ".json")


def row_result(row: dict, res: dict) -> dict:
    return {**row, **{k: res[k] for k in ("acceptance", "attention_backend",
                                          "target_attention_backend",
                                          "draft_attention_backend", "indexer_backend")},
            "outputs": res["outputs"]}


def saved_row(row: dict, out: Path) -> dict:
    """A row from the file a run left in OUT (--saved-rows); missing: did not run."""
    path = row_file(row, out)
    if not path.exists():
        return {**row, "error": f"no {path.name}"}
    return row_result(row, json.loads(path.read_text()))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--parallel", type=int, default=8,
                   help="engines at a time (each takes 10%% of the GPU's memory)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    p.add_argument("--json", default=None)
    p.add_argument("--saved-rows", action="store_true",
                   help="run nothing: check the row files an earlier run (e.g. one stopped "
                        "by a time limit) left in --out")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    todo = rows(args.models, args.modes, args.sources)
    if args.saved_rows:
        return report(check({key(r): saved_row(r, out) for r in todo}), args.json, out)
    files = prepare(out, args.models, args.sources)
    results = {}
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        futures = [pool.submit(run_row, r, files[(r["model"], r["source"])], out)
                   for r in todo]
        for fut in concurrent.futures.as_completed(futures):
            r = fut.result()
            results[key(r)] = r
            print("row " + json.dumps({k: v for k, v in r.items() if k != "outputs"}),
                  flush=True)
    report(check({key(r): results[key(r)] for r in todo}), args.json, out)


def report(table: list[dict], json_path: str | None, out: Path) -> None:
    """The table (markdown) and its JSON; exits 1 when a row fails."""
    print("| model | source | mode | N | acceptance length | vs bf16 | vs safetensors "
          "| first parting (gap) | prompts parted | draft backend | status |")
    print("|---|---|---|---:|---:|---:|---:|---|---|---|---|")
    for r in table:
        al = r.get("acceptance", {}).get("acceptance_length")
        vs = r.get("acceptance_vs_bf16")
        vs_st = r.get("acceptance_vs_safetensors")
        part = r.get("parting")
        part = "-" if not r["n"] or "error" in r else ("none" if part is None else
                                       f"prompt {part['prompt']} step {part['step']} "
                                       f"({part['gap']:.3f})")
        print(f"| {r['model']} | {r['source']} | {r['mode']} | {r['n']} | "
              f"{'-' if al is None else f'{al:.2f}'} | {'-' if vs is None else f'{vs:.3f}'} | "
              f"{'-' if vs_st is None else f'{vs_st:.3f}'} | {part} | "
              f"{', '.join(map(str, r.get('prompts_parted') or [])) or '-'} | "
              f"{r.get('draft_attention_backend') or '-'} | {r['status']} |")
    summary = [{k: v for k, v in r.items() if k != "outputs"} for r in table]
    (Path(json_path) if json_path else out / "mtp-matrix.json").write_text(
        json.dumps(summary, indent=1))
    sys.exit(0 if all(r["status"] == "pass" for r in table) else 1)


if __name__ == "__main__":
    main()
