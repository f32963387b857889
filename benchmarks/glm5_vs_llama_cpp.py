# SPDX-License-Identifier: Apache-2.0
"""GGUF prefill and decode speed: the overlay against llama.cpp, same file, same GPU.

    python -m benchmarks.glm5_vs_llama_cpp --gguf FILE.gguf --llama-bench BIN
        [--llama-batched-bench BIN2] [--json out.json] [--md out.md]
        [--paths portable upstream sm120 portable-gguf-moe portable-keys16
                 upstream-keys16]
        [--prompts 512 8192] [--depths 0 8192] [--batches 1 8 32] [--gen 128] [--profile]
        [--profile-batch 1 [32 ...]] [--llama-profile NCU]
    python -m benchmarks.glm5_vs_llama_cpp --per-layer SHALLOW.json DEEP.json [--md out.md]
    python -m benchmarks.glm5_vs_llama_cpp --depth-model A.json B.json [C.json ...]
        [--project 78] [--md out.md]

FILE is a GLM-5-shaped GGUF from benchmarks/glm5_llama_cpp_model.py; BIN is
llama-bench from tools/gpu-host/build-llama-cpp-cuda.sh (CUDA, the pinned sdist).
- llama.cpp: `llama-bench -o json`, all layers on the GPU, twice: prompt processing
  `-p 512,8192 -n 0` (ubatch 512 and 2048, the faster counts) and token generation
  `-p 0 -n GEN -d 0,8192` (batch 1: llama-bench decodes one sequence), `-r 3`;
  avg_ts is tokens/s.
- the overlay: offline `vllm.LLM` on the same file, CUDA graphs up to 512 tokens (as
  `vllm serve` captures by default), one
  subprocess per path as benchmarks/glm5_throughput.py runs them:
  `portable`: TRITON_MLA_SPARSE + the portable (Triton) indexer, fp16 (the SM120 path,
  forced); `upstream`: vLLM's own choice on the H200 (FLASH_ATTN_MLA_SPARSE + DeepGEMM
  at bf16); `sm120`: capability 12.0 reported (tests/plugins/vllm_report_capability,
  installed with `pip install --no-deps`), dtype auto, nothing forced; `portable-gguf-moe`:
  `portable` with VLLM_GGUF_MOE_MARLIN=0 (every MoE layer on the GGUF kernels, where
  Q4_K experts run vLLM's Marlin MoE by default);
  `portable-keys16`: `portable` with VLLM_SPARSE_INDEXER_CACHE=16bit (the indexer's keys and
  queries in 16 bits: twice the indexer cache's bytes read at depth); `upstream-keys16`:
  `upstream` with it (the indexer's logits then on the Triton kernels, not DeepGEMM).
  Prefill: one new PROMPT-token request, max_tokens 1, best of three: PROMPT / TTFT.
  Decode at DEPTH and batch B: B requests of max(DEPTH, 1) tokens, their prompts first
  put in the prefix cache, then 1 + GEN tokens each, REPS times (the same prompts); the
  step time is glm5_throughput.decode_step_s (each request's token timestamps), the
  fastest of the REPS runs (the first pays what a batch size does once: a Triton
  kernel compiled for a new count, as the eager output head's), decode tokens/s =
  B / step (aggregate over the batch).
- llama.cpp's aggregate decode: `llama-batched-bench` (--llama-batched-bench) with 8 and
  32 sequences of max(DEPTH, 1) prompt tokens each, GEN tokens decoded together;
  speed_tg is the aggregate tokens/s.
Issue 69's targets (ratios in the report, overlay / llama.cpp; `TARGETS`): decode at
batch 1 >= 1x llama.cpp's tg at depth 0, >= 1.2x at 8192; 32 sequences >= 3x llama.cpp's
best aggregate at the depth (its fastest of tg and llama-batched-bench's batches); prefill
>= 1x llama.cpp's pp at 512 tokens, >= 1.5x at 8192. `--profile` profiles, after
the timed rows, 17 steps at batch 1 (`--profile-batch B [B ...]`: at each B) and the
shallowest depth (a 1-token prompt at depth 0: every step decodes one token a sequence) and
one prefill of the shortest prompt per path, through
vLLM's own torch profiler (`profiler_config`, so the engine keeps its separate process, as
in the timed rows) and reports GPU time per step and its shares: MoE, the other quantized
products, 16-bit GEMMs, attention and the indexer by kernel name (the kernel table is kept
to check the classification). `--llama-profile NCU` does the same for llama.cpp with Nsight
Compute (kernel durations, warm caches, clocks left alone) over llama-bench: a tg run (one
warm-up token and 8 decoded at depth 0: 9 steps; at B > 1 llama-batched-bench: a 16-token
warm-up pass, the B 1-token prompts' pass and 8 decoded: 10 steps) and a pp run of the
shortest prompt.
`--llama-from REPORT` takes llama.cpp's figures from an earlier report of the same file
(more paths in another call, against the same llama.cpp run).

The whole model (`--depth-model 2L.json 3L.json 10L.json [--project 78]`): each engine's
step time of each case fitted as a fixed cost plus a cost per layer over files of several
depths, projected to GLM-5's 78 layers, with each file's distance from the line.

Per layer (`--per-layer SHALLOW.json DEEP.json`): llama.cpp runs the last layer's FFN
only for the tokens whose logits are asked for (src/models/glm-dsa.cpp, `inp_out_ids`),
so in a prefill its last layer's MoE sees one token where vLLM's sees them all; on a
2-layer file (dense + MoE) that skips llama.cpp's only MoE layer. Two reports of files
that differ by MoE layers (glm5_llama_cpp_model.py --layers 2 and 3) give each engine's
time per added MoE layer (DEEP - SHALLOW, per layer), which that skip and the fixed costs
of a step (the 154880-row head, sampling, scheduling) leave out.
"""

import argparse
import gzip
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.plugins.vllm_report_capability import vllm_report_capability as hook


PATHS = {
    "portable": {"backend": "TRITON_MLA_SPARSE", "indexer": "triton", "dtype": "float16",
                 "env": {}},
    "upstream": {"backend": None, "indexer": "auto", "dtype": "bfloat16", "env": {}},
    "sm120": {"backend": None, "indexer": "auto", "dtype": "auto",
              "env": {"VLLM_TEST_REPORT_CAPABILITY": "12.0",
                      "VLLM_TEST_REPORT_SHARED_MEM": "101376"}},
    # portable, with the Q4_K experts on the GGUF kernels instead of Marlin
    "portable-gguf-moe": {"backend": "TRITON_MLA_SPARSE", "indexer": "triton",
                          "dtype": "float16", "env": {"VLLM_GGUF_MOE_MARLIN": "0"}},
    # portable, with the indexer's 16-bit key cache (off by default)
    "portable-keys16": {"backend": "TRITON_MLA_SPARSE", "indexer": "triton",
                        "dtype": "float16", "env": {"VLLM_SPARSE_INDEXER_CACHE": "16bit"}},
    # upstream, with the 16-bit key cache (its logits on the Triton kernels)
    "upstream-keys16": {"backend": None, "indexer": "auto", "dtype": "bfloat16",
                        "env": {"VLLM_SPARSE_INDEXER_CACHE": "16bit"}},
}
# Issue 69's targets, ours / llama.cpp: batch 1 by depth; 32 sequences against
# llama.cpp's best aggregate at the depth (its fastest of batch 1 and its batches);
# prefill by prompt length. A case not named here has none.
TARGETS = {"decode_b1": {0: 1.0, 8192: 1.2}, "decode_b32_vs_best": 3.0,
           "prefill": {512: 1.0, 8192: 1.5}}
LLAMA_PROFILE_GEN = 8  # tokens decoded in llama.cpp's profiled tg run


# ---------------------------------------------------------------------------------------------
# llama.cpp: llama-bench
# ---------------------------------------------------------------------------------------------
def llama_bench_cmds(binary: str, gguf: str, prompts, depths, gen: int, reps: int = 3,
                     extra=()) -> list[list[str]]:
    """The two llama-bench runs: prompt processing at depth 0, generation at each depth."""
    common = [str(binary), "-m", str(gguf), "-o", "json", "-r", str(reps), "-ngl", "999",
              *extra]
    return [
        common + ["-p", ",".join(map(str, prompts)), "-n", "0", "-d", "0",
                  "-b", str(max(2048, *prompts)), "-ub", "512,2048"],
        common + ["-p", "0", "-n", str(gen), "-d", ",".join(map(str, depths))],
    ]


def parse_llama_bench(text: str) -> list[dict]:
    """llama-bench's `-o json` (a list of tests, one object each) as rows: kind "pp"
    (n_prompt > 0, n_gen 0) or "tg" (n_gen > 0, n_prompt 0), the test's sizes, tokens/s
    (avg_ts, stddev_ts) and how it ran. Anything printed before the list is skipped;
    tests that mix prompt and generation (-pg) are left out."""
    start = text.find("[")
    if start < 0:
        raise ValueError("no JSON list in llama-bench's output")
    tests = json.loads(text[start:])
    rows = []
    for t in tests:
        if t["n_prompt"] > 0 and t["n_gen"] == 0:
            kind = "pp"
        elif t["n_gen"] > 0 and t["n_prompt"] == 0:
            kind = "tg"
        else:
            continue
        rows.append({"kind": kind, "n_prompt": t["n_prompt"], "n_gen": t["n_gen"],
                     "n_depth": t.get("n_depth", 0), "avg_ts": float(t["avg_ts"]),
                     "stddev_ts": float(t["stddev_ts"]), "n_batch": t.get("n_batch"),
                     "n_ubatch": t.get("n_ubatch"), "flash_attn": t.get("flash_attn"),
                     "n_gpu_layers": t.get("n_gpu_layers"), "backends": t.get("backends"),
                     "gpu_info": t.get("gpu_info"), "model_type": t.get("model_type"),
                     "build_commit": t.get("build_commit")})
    return rows


def llama_figures(rows: list[dict]) -> dict:
    """{"prefill": {prompt: tok/s at depth 0}, "decode": {depth: tok/s}}: the fastest
    row of each (over ubatch sizes)."""
    out = {"prefill": {}, "decode": {}}
    for r in rows:
        if r["kind"] == "pp" and r["n_depth"] == 0:
            key, table = r["n_prompt"], out["prefill"]
        elif r["kind"] == "tg":
            key, table = r["n_depth"], out["decode"]
        else:
            continue
        table[key] = max(table.get(key, 0.0), r["avg_ts"])
    return out


def batched_bench_cmd(binary: str, gguf: str, depths, batches, gen: int,
                      extra=()) -> list[str]:
    """llama-batched-bench: B sequences of max(depth, 1) prompt tokens each (not shared),
    then `gen` tokens each, decoded together; jsonl, one line per (prompt, batch)."""
    prompts = sorted({max(d, 1) for d in depths})
    ctx = max(batches) * (max(prompts) + gen + 16)
    return [str(binary), "-m", str(gguf), "-ngl", "999", "-c", str(ctx), "-b", "2048",
            "-ub", "512", "-npp", ",".join(map(str, prompts)), "-ntg", str(gen),
            "-npl", ",".join(map(str, batches)), "-kvu", "--output-format", "jsonl", *extra]


def parse_batched_bench(text: str) -> list[dict]:
    """The jsonl lines of llama-batched-bench (batched-bench.cpp): per prompt length
    `pp` and batch `pl`, speed_tg = pl * tg / t_tg is the aggregate decode tokens/s."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            r = json.loads(line)
            rows.append({"pp": r["pp"], "tg": r["tg"], "pl": r["pl"], "n_kv": r["n_kv"],
                         "speed_pp": r["speed_pp"], "speed_tg": r["speed_tg"],
                         "t_tg": r["t_tg"], "flash_attn": r["flash_attn"]})
    if not rows:
        raise ValueError("no jsonl rows in llama-batched-bench's output")
    return rows


def batched_figures(rows: list[dict]) -> dict:
    """{depth: {batch: aggregate decode tok/s}} (a prompt of 1 token is depth 0)."""
    out = {}
    for r in rows:
        depth = 0 if r["pp"] == 1 else r["pp"]
        out.setdefault(depth, {})[r["pl"]] = r["speed_tg"]
    return out


def ncu_kernels(text: str) -> list[tuple[str, float]]:
    """(kernel name, microseconds) per launch from `ncu --csv` output with the metric
    gpu__time_duration.sum (its unit column: nsecond, usecond, msecond or second, or
    ns, us, ms, s as ncu 2025 writes them)."""
    import csv

    scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6,
             "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}
    lines = [line for line in text.splitlines() if line.startswith('"')]
    out = []
    for row in csv.DictReader(lines):
        if row.get("Metric Name") == "gpu__time_duration.sum":
            value = float(row["Metric Value"].replace(",", ""))
            out.append((row["Kernel Name"], value * scale[row["Metric Unit"]]))
    if not out:
        raise ValueError("no gpu__time_duration.sum rows in ncu's output")
    return out


def summed(kernels: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """Launches of the same kernel added up, the longest first."""
    total: dict[str, float] = {}
    for name, t in kernels:
        total[name] = total.get(name, 0.0) + t
    return sorted(total.items(), key=lambda k: -k[1])


def llama_profile_runs(binary: str, gguf: str, prompt: int, batch: int = 1,
                       batched: str | None = None, extra=()) -> dict:
    """{kind: (command, forward passes)} of the profiled llama.cpp runs: llama-bench's
    decode at depth 0 (one warm-up token, then LLAMA_PROFILE_GEN) or, at batch > 1,
    llama-batched-bench's (a 16-token warm-up pass, the batch's 1-token prompts, then
    LLAMA_PROFILE_GEN passes of one token a sequence), and llama-bench's prefill."""
    gen = LLAMA_PROFILE_GEN
    bench = [str(binary), "-m", str(gguf), "-ngl", "999", "-r", "1"]
    decode = ([*bench, "-p", "0", "-n", str(gen), "-d", "0", *extra], gen + 1)
    if batch > 1:
        decode = (batched_bench_cmd(batched, gguf, [0], [batch], gen, extra), gen + 2)
    return {"decode": decode,
            "prefill": ([*bench, "-p", str(prompt), "-n", "0", "-ub", "512", *extra], 1)}


def llama_profiles(ncu: str, runs: dict) -> dict:
    """Nsight Compute over llama_profile_runs' runs: {kind: ...}, each with the command,
    its kernels (summed by name, top 40), shares by class and total GPU us."""
    import tempfile

    out = {}
    for kind, (run, steps) in runs.items():
        with tempfile.NamedTemporaryFile(suffix=".csv") as log:
            cmd = [ncu, "--csv", "--log-file", log.name, "--metrics", "gpu__time_duration.sum",
                   "--clock-control", "none", "--cache-control", "none", *run]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                out[kind] = {"command": " ".join(cmd), "error": res.stderr[-2000:]}
                continue
            kernels = ncu_kernels(Path(log.name).read_text())
        out[kind] = {"command": " ".join(cmd), "launches": len(kernels),
                     **profile_summary(kernels, steps)}
    return out


def profile_summary(kernels: list[tuple[str, float]], steps: int) -> dict:
    """Kernels summed by name (top 40), shares by class, total GPU us and GPU us per
    step, from (kernel name, us) per launch over `steps` forward passes."""
    total = sum(t for _, t in kernels)
    return {"kernels": summed(kernels)[:40], "shares": kernel_shares(kernels),
            "gpu_us": total, "steps": steps, "gpu_us_per_step": total / steps}


def trace_events(trace_dir: Path, before: set) -> list[dict]:
    """The events of the torch profiler traces that appeared in trace_dir since `before`
    (vLLM's profiler_config writes one `*.pt.trace.json[.gz]` per stop_profile)."""
    new = sorted(set(trace_dir.glob("*.pt.trace.json*")) - before)
    if not new:
        raise RuntimeError(f"no new profiler trace in {trace_dir}")
    events = []
    for f in new:
        with (gzip.open(f, "rt") if f.suffix == ".gz" else open(f)) as fh:
            events += json.load(fh).get("traceEvents", [])
    return events


def gpu_activities(events: list[dict]) -> list[tuple[str, float]]:
    """(kernel name, us) per GPU activity of a trace: kernels, copies and sets."""
    out = [(e["name"], float(e["dur"])) for e in events
           if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not out:
        raise RuntimeError("no GPU activity in the profiler trace")
    return out


# vLLM's host sections (record_function_or_nullcontext, with VLLM_CUSTOM_SCOPES_FOR_PROFILING)
HOST_SECTIONS = ("gpu_model_runner: ", "schedule: ")


def host_sections(events: list[dict], steps: int) -> dict:
    """CPU us a step in each of vLLM's annotated host sections (the model runner's
    preprocess with the attention metadata, forward, sample, ...; the scheduler's), summed
    over a trace of `steps` forward passes, largest first."""
    total: dict[str, float] = {}
    for e in events:
        name = e.get("name", "")
        if e.get("cat") == "user_annotation" and name.startswith(HOST_SECTIONS) and "dur" in e:
            total[name] = total.get(name, 0.0) + float(e["dur"])
    return dict(sorted(((k, v / steps) for k, v in total.items()), key=lambda kv: -kv[1]))


def run_llama_bench(args) -> tuple[list[dict], list[str]]:
    rows, cmds = [], llama_bench_cmds(args.llama_bench, args.gguf, args.prompts, args.depths,
                                      args.gen, args.reps, shlex.split(args.llama_bench_args))
    for cmd in cmds:
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"llama-bench failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
        rows += parse_llama_bench(res.stdout)
    return rows, [" ".join(c) for c in cmds]


# ---------------------------------------------------------------------------------------------
# the overlay: vllm.LLM, one subprocess per path
# ---------------------------------------------------------------------------------------------
def vllm_figures(rows: list[dict]) -> dict:
    """{"prefill": {prompt: tok/s}, "decode": {depth: {batch: aggregate tok/s}}}."""
    out = {"prefill": {}, "decode": {}}
    for r in rows:
        if r["kind"] == "prefill":
            out["prefill"][r["prompt"]] = r["tok_s"]
        else:
            out["decode"].setdefault(r["depth"], {})[r["batch"]] = r["tok_s"]
    return out


def ratios(llama: dict, vllm: dict) -> dict:
    """The issue's ratios, overlay / llama.cpp, where both sides measured the case:
    decode at batch 1 against llama-bench's tg at the same depth; the aggregate decode
    at batch 8 and 32 against llama-batched-bench's at the same batch and depth, and
    at 32 against llama.cpp's best aggregate at the depth (its fastest of tg and its
    batches); prefill against pp at the same prompt length; with the target and
    whether it is met."""
    out = []
    for depth, tg in sorted(llama["decode"].items()):
        ours = vllm["decode"].get(depth, {}).get(1)
        if ours is not None and tg:
            out.append(_ratio("decode_b1", {"depth": depth, "batch": 1}, ours, tg))
    for depth, per_batch in sorted(llama.get("aggregate", {}).items()):
        for batch, theirs in sorted(per_batch.items()):
            ours = vllm["decode"].get(depth, {}).get(batch)
            if ours is not None and theirs:
                out.append(_ratio(f"decode_b{batch}_aggregate", {"depth": depth, "batch": batch},
                                  ours, theirs))
    for depth in sorted(set(llama["decode"]) | set(llama.get("aggregate", {}))):
        ours = vllm["decode"].get(depth, {}).get(32)
        theirs = {b: t for b, t in llama.get("aggregate", {}).get(depth, {}).items() if t}
        if llama["decode"].get(depth):
            theirs[1] = llama["decode"][depth]
        if ours is not None and theirs:
            best = max(theirs, key=theirs.__getitem__)
            out.append(_ratio("decode_b32_vs_best",
                              {"depth": depth, "batch": 32, "llama_batch": best},
                              ours, theirs[best]))
    for prompt, pp in sorted(llama["prefill"].items()):
        ours = vllm["prefill"].get(prompt)
        if ours is not None and pp:
            out.append(_ratio("prefill", {"prompt": prompt}, ours, pp))
    return out


def _ratio(name: str, case: dict, ours: float, theirs: float) -> dict:
    r = ours / theirs
    target = TARGETS.get(name)
    if isinstance(target, dict):  # by depth (decode) or prompt length (prefill)
        target = target.get(case.get("depth", case.get("prompt")))
    return {"name": name, **case, "vllm_tok_s": ours, "llama_tok_s": theirs, "ratio": r,
            "target": target, "meets_target": None if target is None else r >= target}


def markdown(results: dict) -> str:
    """One table per path: case, overlay tok/s, llama.cpp tok/s, ratio, target."""
    lines = []
    for path, res in results["paths"].items():
        if "error" in res:
            lines += [f"**{path}**: failed, see the JSON report", ""]
            continue
        lines += [f"**{path}** ({res.get('settings', '')})", "",
                  "| case | overlay tok/s | llama.cpp tok/s | overlay / llama.cpp | target |",
                  "|---|---:|---:|---:|---|"]
        compared = set()
        for r in res["ratios"]:
            case = (f"prefill {r['prompt']}" if r["name"] == "prefill" else
                    f"decode batch {r['batch']} at depth {r['depth']}")
            compared.add(case)
            if r["name"] == "decode_b32_vs_best":
                case += f", llama.cpp's best (batch {r['llama_batch']})"
            target = ("-" if r["target"] is None else
                      f">= {r['target']:g}x: {'met' if r['meets_target'] else 'not met'}")
            lines.append(f"| {case} | {r['vllm_tok_s']:.1f} | {r['llama_tok_s']:.1f} | "
                         f"{r['ratio']:.2f} | {target} |")
        # the cases llama.cpp did not measure (or a run without it): the overlay's alone
        figures = res.get("figures", {})
        cases = [(f"prefill {p}", t) for p, t in figures.get("prefill", {}).items()]
        cases += [(f"decode batch {b} at depth {d}", t)
                  for d, per_batch in figures.get("decode", {}).items()
                  for b, t in per_batch.items()]
        lines += [f"| {case} | {t:.1f} | - | - | - |" for case, t in cases
                  if case not in compared]
        loads = [r["load_1m"] for r in res.get("rows", []) if "load_1m" in r]
        if loads:
            lines.append(f"\nThe host's load (1-minute average) over the rows: "
                         f"{min(loads):.1f}-{max(loads):.1f}")
        # one profiled batch a report before --profile-batch took several
        decodes = res.get("profile_decodes") or ([res["profile_decode"]]
                                                 if res.get("profile_decode") else [])
        for k, pd in enumerate(decodes):
            gap = "" if k else "\n"
            lines.append(f"{gap}GPU time of a decode step (batch {pd.get('batch', 1)}, "
                         f"depth {pd['depth']}), "
                         f"{pd['gpu_us_per_step']:.0f} us: {_shares(pd['shares'])}")
            if pd.get("host_us_per_step"):
                lines.append("Host work of a decode step (CPU us in vLLM's sections): " + ", ".join(
                    f"{k} {v:.0f}" for k, v in list(pd["host_us_per_step"].items())[:6]))
        if res.get("profile_prefill"):
            pf = res["profile_prefill"]
            lines.append(f"GPU time of a {pf['prompt']}-token prefill, "
                         f"{pf['gpu_us'] / 1e3:.1f} ms: {_shares(pf['shares'])}")
        if res.get("profile_error"):
            lines.append(f"\nprofile failed: {res['profile_error'][-300:]}")
        lines.append("")
    for kind, prof in results.get("llama_cpp", {}).get("profiles", {}).items():
        if "error" in prof:
            lines.append(f"llama.cpp {kind} profile: failed, see the JSON report")
        else:
            at = f" at batch {prof['batch']}" if prof.get("batch", 1) > 1 else ""
            lines.append(f"llama.cpp {kind.split()[0]}{at} (ncu, {prof['launches']} launches over "
                         f"{prof['steps']} steps, {prof['gpu_us_per_step']:.0f} us a step): "
                         f"{_shares(prof['shares'])}")
    return "\n".join(lines)


def _shares(shares: dict) -> str:
    return ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares.items())


# kernel-name classes for the profiles, both engines (first match wins): llama.cpp's MoE
# runs its quantized-product kernels with expert ids, so there "quantized" holds its MoE
KERNEL_CLASSES = (
    ("indexer", re.compile(r"indexer|mqa_logits|fp8_paged_mqa|top_?k_per_row|topk_per_row",
                           re.I)),
    ("attention", re.compile(r"sparse_mla|flash_?mla|mla_|attn|attention|flash_fwd", re.I)),
    ("moe", re.compile(r"moe|expert|grouped_topk|topk_softmax|topk_sigmoid|ggml.*_id|"
                       r"mul_mat_vec_q_moe|marlin_moe", re.I)),
    # _q4_k_kernel, _q6_k_kernel: the plugin's Triton dequantization before a 16-bit GEMM
    ("quantized", re.compile(r"mul_mat_vec_q|mul_mat_q|mmvq|mmq|dequantize|quantize_q8_1|"
                             r"quantize_mmq|gemm_q|_gemm_iq|^_q\d_k_kernel", re.I)),
    ("gemm16", re.compile(r"gemm|cutlass|cublas|xmma|nvjet|matmul", re.I)),
)


def kernel_shares(kernels: list[tuple[str, float]]) -> dict:
    """Shares of GPU time per class (KERNEL_CLASSES, else "other") from
    (kernel name, GPU time) pairs."""
    total = sum(t for _, t in kernels) or 1.0
    shares = {name: 0.0 for name, _ in KERNEL_CLASSES}
    shares["other"] = 0.0
    for name, t in kernels:
        cls = next((c for c, pat in KERNEL_CLASSES if pat.search(name)), "other")
        shares[cls] += t / total
    return shares


def path_env(path: str) -> dict[str, str]:
    """The variables a path runs with: its own, and the test hook's that put its indexer
    on the portable kernels (`indexer`: triton, where the platform would take DeepGEMM)."""
    return {**hook.indexer_env(PATHS[path]["indexer"]), **PATHS[path]["env"]}


def capability_plugin_missing(path: str) -> bool:
    """Whether the path has the test plugin report another GPU's capability or no DeepGEMM
    and the plugin is not installed; the paths that only set the overlay's own variables
    need nothing more."""
    return hook.missing(path_env(path))


def distinct_tokens(outputs) -> float:
    """Distinct token ids across the batch, averaged over the decoded positions: the greedy
    tokens pick the routed experts, so a step's MoE work follows them."""
    seqs = [o.outputs[0].token_ids for o in outputs]
    positions = min(len(s) for s in seqs)
    return sum(len({s[i] for s in seqs}) for i in range(positions)) / max(positions, 1)


def decode_row(depth: int, batch: int, gen: int, n: int, reps: list) -> dict:
    """A decode case's row from its runs [(wall s, outputs)]: the fastest run's step
    (glm5_throughput.decode_step_s), with every run's."""
    from benchmarks.glm5_throughput import decode_step_s

    steps = [decode_step_s(outs) for _, outs in reps]
    best = min(range(len(reps)), key=steps.__getitem__)
    wall, outs = reps[best]
    return {"kind": "decode", "depth": depth, "batch": batch, "gen": gen,
            "step_ms": 1e3 * steps[best], "tok_s": batch / steps[best], "wall_s": wall,
            "step_ms_reps": [1e3 * t for t in steps],
            "distinct_tokens_reps": [distinct_tokens(outs) for _, outs in reps],
            "cached_prompt_tokens": sum(o.num_cached_tokens or 0 for o in outs),
            "prompt_tokens": batch * n}


def worker(args) -> None:
    settings = PATHS[args.path]
    if capability_plugin_missing(args.path):
        sys.exit("pip install --no-deps tests/plugins/vllm_report_capability first")
    os.environ.update(hook.indexer_env(settings["indexer"]))
    if args.profile:  # vLLM's host sections in the trace (the timed rows carry them too)
        os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    from benchmarks import glm5_throughput as throughput  # timed_generate
    from vllm import LLM
    from vllm_gguf_plugin.gguf_model import config_from_gguf

    vocab = config_from_gguf(args.gguf).vocab_size
    longest = max([*args.prompts, *args.depths, 1])
    traces = Path(args.out).with_suffix(".traces")
    profiler = ({"profiler": "torch", "torch_profiler_dir": str(traces),
                 "torch_profiler_with_stack": False,
                 "torch_profiler_dump_cuda_time_total": False} if args.profile else None)
    llm = LLM(model=args.gguf, skip_tokenizer_init=True, dtype=settings["dtype"],
              max_model_len=longest + args.gen + 64, block_size=64,
              enable_prefix_caching=True, disable_log_stats=False,
              max_num_seqs=max(args.batches), max_num_batched_tokens=max(longest, 8192) + 64,
              seed=0, gpu_memory_utilization=0.85,
              # CUDA graphs up to 512 tokens, as `vllm serve`'s defaults capture (max_num_seqs
              # alone would cap them at twice the largest batch: pp512 eager)
              compilation_config={"max_cudagraph_capture_size": 512},
              attention_config={"backend": settings["backend"]} if settings["backend"] else None,
              profiler_config=profiler)

    def run(n, batch, max_tokens, seed):
        return throughput.timed_generate(llm, n, batch, max_tokens, seed, vocab)

    rows, seed = [], 10
    run(16, 1, 2, 0)  # warm-up
    for prompt in args.prompts:
        run(prompt, 1, 1, 1)  # warm up this length
        ttft = min(run(prompt, 1, 1, seed + k)[0] for k in range(3))
        seed += 3
        rows.append({"kind": "prefill", "prompt": prompt, "ttft_s": ttft, "tok_s": prompt / ttft,
                     "load_1m": os.getloadavg()[0]})
    for depth in args.depths:
        for batch in args.batches:
            seed += 1
            n = max(depth, 1)
            if n > 1:
                run(n, batch, 1, seed)  # the prompts into the prefix cache
            reps = [run(n, batch, 1 + args.gen, seed) for _ in range(max(args.reps, 1))]
            # the host's load: vLLM's host work a step slows with busy CPUs
            rows.append({**decode_row(depth, batch, args.gen, n, reps),
                         "load_1m": os.getloadavg()[0]})
    result = {"rows": rows}
    if args.profile:
        def profiled(fn, steps) -> dict:
            traces.mkdir(exist_ok=True)
            before = set(traces.glob("*"))
            llm.start_profile()
            try:
                fn()
            finally:
                llm.stop_profile()
            events = trace_events(traces, before)
            return {**profile_summary(gpu_activities(events), steps),
                    "host_us_per_step": host_sections(events, steps)}

        # depth 0: 1-token prompts, so that every profiled step decodes one token a sequence
        n = max(min(args.depths), 1)
        try:
            result["profile_decodes"] = []
            for batch in args.profile_batch:
                run(n, batch, 1, 999)  # the prompts into the prefix cache
                result["profile_decodes"].append(
                    {"depth": min(args.depths), "batch": batch,
                     **profiled(lambda: run(n, batch, 17, 999), 17)})
            prompt = min(args.prompts)
            result["profile_prefill"] = {"prompt": prompt,  # a new prompt: a whole prefill
                                         **profiled(lambda: run(prompt, 1, 1, 1999), 1)}
        except Exception as e:  # noqa: BLE001 - the timed rows stand without a profile
            result["profile_error"] = repr(e)[-2000:]
    Path(args.out).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------
# per layer: two reports of files that differ by MoE layers
# ---------------------------------------------------------------------------------------------
def case_ms(figures: dict, aggregate: dict | None = None) -> dict:
    """{case: ms} from one engine's tok/s figures (JSON keys are strings): a prefill's
    time, PROMPT / tok/s; a decode step's, BATCH / tok/s (aggregate tok/s). The overlay's
    decode figures are {depth: {batch: tok/s}}, llama.cpp's {depth: tok/s} (batch 1) with
    its batched-bench aggregates {depth: {batch: tok/s}} in `aggregate`."""
    out = {}
    for prompt, tok_s in figures.get("prefill", {}).items():
        out[f"prefill {prompt}"] = 1e3 * int(prompt) / tok_s
    decode = {d: (v if isinstance(v, dict) else {"1": v})
              for d, v in figures.get("decode", {}).items()}
    for depth, per_batch in (aggregate or {}).items():
        decode.setdefault(depth, {}).update(per_batch)
    for depth, per_batch in decode.items():
        for batch, tok_s in per_batch.items():
            out[f"decode batch {batch} at depth {depth}"] = 1e3 * int(batch) / tok_s
    return out


def per_layer(shallow: dict, deep: dict) -> dict:
    """Each engine's ms per added layer, (DEEP - SHALLOW) / added layers, for every case
    both reports measured on both engines, and ratio = llama.cpp's ms / the overlay's
    (> 1: the overlay is faster, as the tok/s ratios read)."""
    for r in (shallow, deep):
        if "layers" not in r or "llama_cpp" not in r:
            raise ValueError("--per-layer needs reports with layers and llama.cpp's figures")
    added = deep["layers"] - shallow["layers"]
    if added <= 0:
        raise ValueError(f"DEEP has {deep['layers']} layers, SHALLOW {shallow['layers']}")

    def llama(r):
        return case_ms(r["llama_cpp"]["figures"], r["llama_cpp"]["figures"].get("aggregate"))

    def diff(a, b):
        return {c: (b[c] - a[c]) / added for c in a if c in b}

    theirs = diff(llama(shallow), llama(deep))
    out = {"layers": [shallow["layers"], deep["layers"]], "llama_cpp_ms": theirs, "paths": {}}
    for path, res in deep["paths"].items():
        if "figures" not in res or "figures" not in shallow["paths"].get(path, {}):
            continue
        ours = diff(case_ms(shallow["paths"][path]["figures"]), case_ms(res["figures"]))
        out["paths"][path] = {c: {"ms": ms, "llama_ms": theirs[c], "ratio": theirs[c] / ms}
                              for c, ms in ours.items() if c in theirs}
    return out


def per_layer_markdown(result: dict) -> str:
    shallow, deep = result["layers"]
    lines = [f"Per added layer ({shallow} -> {deep} layers; ms per layer)", ""]
    for path, cases in result["paths"].items():
        lines += [f"**{path}**", "", "| case | llama.cpp ms | overlay ms | overlay / llama.cpp |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {c} | {v['llama_ms']:.3f} | {v['ms']:.3f} | {v['ratio']:.2f} |"
                  for c, v in cases.items()]
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# the whole model: reports of files of several depths
# ---------------------------------------------------------------------------------------------
def linear_fit(points: dict[int, float]) -> tuple[float, float]:
    """(fixed, per layer) of the least-squares line ms = fixed + per layer x layers."""
    n = len(points)
    mean_x = sum(points) / n
    mean_y = sum(points.values()) / n
    sxx = sum((x - mean_x) ** 2 for x in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points.items()) / sxx
    return mean_y - slope * mean_x, slope


def _depth_line(points: dict[int, float], project: int) -> dict:
    fixed, per_layer = linear_fit(points)
    return {"fixed": fixed, "per_layer": per_layer, "projected": fixed + per_layer * project,
            "residuals": {layers: ms / (fixed + per_layer * layers) - 1
                          for layers, ms in points.items()}}


def depth_model(reports: list[dict], project: int = 78) -> dict:
    """Each engine's ms of every case as fixed + per layer x layers, fitted by least
    squares over reports of GLM-5-shaped files of different depths (a case where every
    report measured it), projected to `project` layers; each file's residual (measured
    over fitted, less 1) says how well a line holds; ratio = llama.cpp's projected ms
    over the overlay's (> 1: the overlay is faster). The layers are taken as alike:
    GLM-5's mix of dense and MoE layers, Q4_K and Q6_K down projections, is the files'
    own."""
    for r in reports:
        if "layers" not in r or "llama_cpp" not in r:
            raise ValueError("--depth-model needs reports with layers and llama.cpp's figures")
    depths = [r["layers"] for r in reports]
    if len(set(depths)) < 2 or len(set(depths)) < len(depths):
        raise ValueError(f"--depth-model needs reports of different depths, got {depths}")

    def fitted(per_report: list[dict]) -> dict:
        cases = set.intersection(*(set(ms) for ms in per_report))
        return {c: _depth_line({L: ms[c] for L, ms in zip(depths, per_report)}, project)
                for c in sorted(cases)}

    theirs = fitted([case_ms(r["llama_cpp"]["figures"], r["llama_cpp"]["figures"].get("aggregate"))
                     for r in reports])
    out = {"layers": depths, "project": project, "llama_cpp": theirs, "paths": {}}
    for path in reports[-1]["paths"]:
        if not all("figures" in r["paths"].get(path, {}) for r in reports):
            continue
        ours = fitted([case_ms(r["paths"][path]["figures"]) for r in reports])
        out["paths"][path] = {c: {**line, "ratio": theirs[c]["projected"] / line["projected"]}
                              for c, line in ours.items() if c in theirs}
    out["vs_best"] = projected_vs_best(theirs, out["paths"])
    return out


def projected_vs_best(theirs: dict, paths: dict) -> dict:
    """Issue 69's 32-sequence target at the projected depth: each path's projected
    tokens/s at 32 sequences over llama.cpp's best projected aggregate at that depth
    (its fastest decode case there), as `ratios` gives it for one file."""
    case = re.compile(r"decode batch (\d+) at depth (\d+)")
    best: dict[int, tuple[int, float]] = {}
    for c, line in theirs.items():
        m = case.fullmatch(c)
        if m and line["projected"] > 0:
            batch, depth = int(m[1]), int(m[2])
            tok_s = 1e3 * batch / line["projected"]
            if tok_s > best.get(depth, (0, 0.0))[1]:
                best[depth] = (batch, tok_s)
    out = {}
    for path, cases in paths.items():
        for depth, (batch, tok_s) in sorted(best.items()):
            ours = cases.get(f"decode batch 32 at depth {depth}")
            if ours is not None and ours["projected"] > 0:
                out.setdefault(path, []).append(_ratio(
                    "decode_b32_vs_best", {"depth": depth, "batch": 32, "llama_batch": batch},
                    32e3 / ours["projected"], tok_s))
    return out


def write_report(result: dict, text: str, json_path: str | None, md_path: str | None) -> None:
    """Print a report's markdown and write it and the report's JSON where asked."""
    print(text)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
    if md_path:
        Path(md_path).write_text(text + "\n")


def depth_model_markdown(result: dict) -> str:
    n = result["project"]
    lines = [f"ms = fixed + per layer x layers, fitted over files of {result['layers']} layers; "
             f"at {n} layers; residual: the largest of a file's measured over fitted, less 1",
             ""]
    for path, cases in result["paths"].items():
        lines += [f"**{path}**", "",
                  "| case | llama.cpp fixed + per layer | overlay fixed + per layer | "
                  f"llama.cpp at {n} | overlay at {n} | x | residual |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for c, v in cases.items():
            t = result["llama_cpp"][c]
            worst = max([*v["residuals"].values(), *t["residuals"].values()], key=abs)
            lines.append(f"| {c} | {t['fixed']:.3f} + {t['per_layer']:.3f} | "
                         f"{v['fixed']:.3f} + {v['per_layer']:.3f} | {t['projected']:.2f} | "
                         f"{v['projected']:.2f} | {v['ratio']:.2f} | {worst:+.1%} |")
        for r in result.get("vs_best", {}).get(path, []):
            lines.append(f"\n32 sequences at depth {r['depth']} over llama.cpp's best at {n} "
                         f"layers (its batch {r['llama_batch']}): {r['ratio']:.2f}x, "
                         f"target {r['target']:g}x: {'met' if r['meets_target'] else 'not met'}")
        lines.append("")
    return "\n".join(lines)


def llama_from(report_path: str, gguf: str) -> tuple[dict, dict]:
    """(the llama_cpp part, its figures with integer keys) of an earlier report of the
    same file: more paths in another call against the same llama.cpp run."""
    earlier = json.loads(Path(report_path).read_text())
    part = earlier.get("llama_cpp", {})
    if "figures" not in part:
        sys.exit(f"{report_path}: no llama.cpp figures in this report")
    if earlier["args"].get("gguf") != gguf or earlier.get("gguf_bytes") != Path(
            gguf).stat().st_size:
        sys.exit(f"{report_path} measured {earlier['args'].get('gguf')} "
                 f"({earlier.get('gguf_bytes')} bytes), not {gguf}")

    def int_keys(d):  # JSON wrote the prompt, depth and batch keys as strings
        return {int(k) if k.isdigit() else k: int_keys(v) if isinstance(v, dict) else v
                for k, v in d.items()}
    return {**part, "from": report_path}, int_keys(part["figures"])


def backend_lines(log: str) -> list[str]:
    """vLLM's log lines naming the attention backend or the indexer (what a path ran)."""
    return sorted({m.group(0).strip() for m in re.finditer(
        r"[^\n]*(?:[Uu]sing|[Ss]elected)[^\n]*(?:backend|[Ii]ndexer)[^\n]*", log)})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf")
    p.add_argument("--per-layer", nargs=2, metavar=("SHALLOW", "DEEP"),
                   help="two reports of files that differ by MoE layers: per-layer figures")
    p.add_argument("--depth-model", nargs="+", metavar="REPORT",
                   help="reports of files of different depths: fixed and per-layer cost, "
                        "projected to --project layers")
    p.add_argument("--project", type=int, default=78)
    p.add_argument("--llama-bench", default=None, help="llama-bench (omit: overlay only)")
    p.add_argument("--llama-batched-bench", default=None,
                   help="llama-batched-bench (omit: no aggregate decode of llama.cpp)")
    p.add_argument("--llama-bench-args", default="",
                   help="more llama-bench flags, one string: --llama-bench-args='-fa on'")
    p.add_argument("--llama-from", default=None, metavar="REPORT",
                   help="llama.cpp's figures from an earlier report of the same file "
                        "(instead of --llama-bench and --llama-batched-bench)")
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    p.add_argument("--paths", nargs="*", default=list(PATHS), choices=list(PATHS))
    p.add_argument("--prompts", type=int, nargs="*", default=[512, 8192])
    p.add_argument("--depths", type=int, nargs="*", default=[0, 8192])
    p.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32])
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-batch", type=int, nargs="+", default=[1],
                   help="sequences of the profiled decode steps, one profile each "
                        "(llama.cpp's: llama-batched-bench's from 2)")
    p.add_argument("--llama-profile", default=None, metavar="NCU",
                   help="Nsight Compute (ncu) to profile llama-bench's decode and prefill")
    p.add_argument("--path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.path:
        return worker(args)
    if args.per_layer or args.depth_model:
        if args.per_layer:
            result = per_layer(*(json.loads(Path(f).read_text()) for f in args.per_layer))
            text = per_layer_markdown(result)
        else:
            result = depth_model([json.loads(Path(f).read_text()) for f in args.depth_model],
                                 args.project)
            text = depth_model_markdown(result)
        write_report(result, text, args.json, args.md)
        return result
    if not args.gguf:
        p.error("--gguf is required")
    if args.llama_from and (args.llama_bench or args.llama_batched_bench):
        p.error("--llama-from takes llama.cpp's figures instead of running llama.cpp")
    if max(args.profile_batch) > max(args.batches, default=1):
        p.error("--profile-batch above the largest of --batches (the engine's max_num_seqs)")
    if args.llama_profile and max(args.profile_batch) > 1 and not args.llama_batched_bench:
        p.error("--profile-batch above 1 profiles llama.cpp through --llama-batched-bench")
    from vllm_gguf_plugin.gguf_model import config_from_gguf

    report = {"args": vars(args), "gguf_bytes": Path(args.gguf).stat().st_size,
              "layers": config_from_gguf(args.gguf).num_hidden_layers,  # MTP blocks aside
              "paths": {}, "complete": False}
    llama = {"prefill": {}, "decode": {}}

    def save():
        # after every part, so that a run stopped by a time limit still reports what it measured
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    if args.llama_from:
        report["llama_cpp"], llama = llama_from(args.llama_from, args.gguf)
        save()
    if args.llama_bench:
        rows, cmds = run_llama_bench(args)
        llama = llama_figures(rows)
        report["llama_cpp"] = {"commands": cmds, "rows": rows, "figures": llama}
        save()
    if args.llama_profile and args.llama_bench:
        def profile_runs(batch):
            return llama_profile_runs(args.llama_bench, args.gguf, min(args.prompts), batch,
                                      args.llama_batched_bench, shlex.split(args.llama_bench_args))

        # "decode", or "decode bB" a batch where several; the prefill's run has no batch
        kinds = {("decode" if len(args.profile_batch) == 1 else f"decode b{batch}"): batch
                 for batch in args.profile_batch}
        runs = {kind: profile_runs(batch)["decode"] for kind, batch in kinds.items()}
        runs["prefill"] = profile_runs(1)["prefill"]
        profiles = llama_profiles(args.llama_profile, runs)
        for kind, batch in kinds.items():
            profiles[kind]["batch"] = batch
        report.setdefault("llama_cpp", {})["profiles"] = profiles
        save()
    if args.llama_batched_bench:
        cmd = batched_bench_cmd(args.llama_batched_bench, args.gguf, args.depths,
                                [b for b in args.batches if b > 1], args.gen,
                                shlex.split(args.llama_bench_args))
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"llama-batched-bench failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
        rows = parse_batched_bench(res.stdout + res.stderr)
        llama["aggregate"] = batched_figures(rows)
        report.setdefault("llama_cpp", {})["batched"] = {"command": " ".join(cmd), "rows": rows}
        save()
    with tempfile.TemporaryDirectory() as tmp:
        for path in args.paths:
            out = Path(tmp) / f"{path}.json"
            cmd = [sys.executable, "-m", "benchmarks.glm5_vs_llama_cpp", "--gguf", args.gguf,
                   "--path", path, "--out", str(out), "--gen", str(args.gen),
                   "--reps", str(args.reps),
                   "--prompts", *map(str, args.prompts),
                   "--depths", *map(str, args.depths), "--batches", *map(str, args.batches),
                   *(["--profile", "--profile-batch", *map(str, args.profile_batch)]
                     if args.profile else [])]
            env = dict(os.environ, **path_env(path))
            res = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if res.returncode != 0:
                report["paths"][path] = {"error": res.stderr[-4000:], "ratios": []}
                save()
                continue
            result = json.loads(out.read_text())
            figures = vllm_figures(result["rows"])
            settings = {k: v for k, v in PATHS[path].items() if v}
            report["paths"][path] = {**result, "figures": figures, "settings": settings,
                                     "log_backends": backend_lines(res.stdout + res.stderr),
                                     "ratios": ratios(llama, figures)}
            save()
    report["complete"] = True
    save()
    text = markdown(report)
    print(text)
    if args.md:
        Path(args.md).write_text(text)
    return report


if __name__ == "__main__":
    main()
