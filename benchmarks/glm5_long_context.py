# SPDX-License-Identifier: Apache-2.0
"""GLM-5's whole context from a GGUF: start, prefill and decode at depth, per path.

    python -m benchmarks.glm5_long_context --gguf FILE --paths upstream sm120 \
        --prompts 131072 200000 --batch 8 --depth 32768 --json OUT.json --md OUT.md

Each path runs in a process of its own with vLLM's defaults for everything the
arguments leave out: `max_model_len` is the file's context length (GLM-5: 202752)
unless `--max-model-len` names one, and so are the chunk (`max_num_batched_tokens`),
the memory share, CUDA graphs and the KV cache. A row records whether the engine
started, the KV capacity vLLM reports (tokens, GiB) against the GPU memory in use
(nvidia-smi), each prompt's time to first token and its decode step at that depth,
and `--batch` sequences decoding at `--depth`. A process that dies keeps the rows it
wrote and its error lines; `--launch-blocking` runs it with CUDA_LAUNCH_BLOCKING=1 so
that a CUDA error names the kernel that faulted.

`--llama-bench FILE` adds llama.cpp's decode at the same depths, from `llama-bench -m
FILE -p 0 -n 16 -d 131072,200000 -o json` run on the same machine, and each prompt
row's ratio to it (ours over llama.cpp's tokens/s); with `--from REPORT` it adds them
to a report already written, running no engine.

`--make-tiny DIR` writes the tiny GLM-5 (tests/models/glm5_tiny.py, GLM-5's top-k of
2048) as llama.cpp's Q4_K_M GGUF, once with the tiny model's context (4096) and once
with GLM-5's (202752): the long-context matrix's files (needs llama.cpp's converter and
llama-quantize: tests/models/quantization/gguf_reference.py).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.glm5_vs_llama_cpp import PATHS as VS_PATHS
from benchmarks.glm5_vs_llama_cpp import write_report
from tests.plugins.vllm_report_capability import vllm_report_capability as hook

PATHS = {
    "upstream": VS_PATHS["upstream"],
    "sm120": VS_PATHS["sm120"],
    # vLLM's choice as on an A100 (its 163 KiB of opt-in shared memory)
    "sm80": {"backend": None, "indexer": "auto", "dtype": "auto",
             "env": {"VLLM_TEST_REPORT_CAPABILITY": "8.0",
                     "VLLM_TEST_REPORT_SHARED_MEM": "166912"}},
}
# what the engine's log says of its memory (vLLM 0.26's wording)
LOG_FIGURES = {
    "kv_cache_tokens": (r"GPU KV cache size: ([\d,]+) tokens", int),
    "kv_cache_gib": (r"Available KV cache memory: ([\d.]+) GiB", float),
    "weights_gib": (r"Model loading took ([\d.]+) GiB", float),
    "max_concurrency": (r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x",
                        float),
}
TINY_CONTEXTS = (4096, 202752)
# the engine arguments that take vLLM's defaults unless given
ENGINE_OVERRIDES = ("max_model_len", "max_num_batched_tokens", "gpu_memory_utilization")


def overrides(args) -> dict:
    """The ENGINE_OVERRIDES given on the command line."""
    return {k: getattr(args, k) for k in ENGINE_OVERRIDES if getattr(args, k) is not None}


def gpu_memory_used_mib() -> int | None:
    """The GPU's memory in use (every process), as nvidia-smi reports it."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                              "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def log_figures(log: str) -> dict:
    """The engine's own figures of its memory, from its log (the last of each)."""
    found = {}
    for key, (pattern, kind) in LOG_FIGURES.items():
        values = re.findall(pattern, log)
        if values:
            found[key] = kind(values[-1].replace(",", ""))
    return found


def error_lines(log: str, keep: int = 12) -> list[str]:
    """The lines of a failed run that say what failed: errors, CUDA's, and the frames
    naming a kernel or an op (with CUDA_LAUNCH_BLOCKING, the one that faulted)."""
    pattern = re.compile(r"Error|error:|CUDA|illegal|out of memory|Traceback|torch\.ops|"
                         r"triton|deep_gemm|flash|_C\.|\.py\", line")
    lines = [ln.strip() for ln in log.splitlines() if pattern.search(ln)]
    # the first exceptions raised (the root cause; an engine core's comes before the
    # client's), then the last lines
    raised = [ln for ln in lines if re.search(r"\b\w+(Error|Exception):", ln)]
    return list(dict.fromkeys(raised[:3] + lines[-keep:]))


def worker(args) -> None:
    settings = PATHS[args.path]
    os.environ.update(hook.indexer_env(settings["indexer"]))
    from benchmarks.glm5_throughput import decode_step_s, timed_generate
    from vllm import LLM
    from vllm_gguf_plugin.gguf_model import config_from_gguf

    report = {"rows": [], "started": False}
    out = Path(args.out)

    def save():
        out.write_text(json.dumps(report))

    vocab = config_from_gguf(args.gguf).vocab_size
    engine = {"skip_tokenizer_init": True, "seed": 0, "disable_log_stats": False,
              "enforce_eager": args.eager}
    engine.update(overrides(args))
    if settings["dtype"] != "auto":
        engine["dtype"] = settings["dtype"]
    if settings["backend"]:
        engine["attention_config"] = {"backend": settings["backend"]}
    report["engine_args"] = engine
    save()
    t0 = time.perf_counter()
    llm = LLM(model=args.gguf, **engine)
    config = llm.llm_engine.vllm_config
    report.update(started=True, start_s=time.perf_counter() - t0,
                  max_model_len=config.model_config.max_model_len,
                  max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
                  gpu_memory_utilization=config.cache_config.gpu_memory_utilization,
                  dtype=str(config.model_config.dtype).removeprefix("torch."),
                  gpu_memory_used_mib_start=gpu_memory_used_mib())
    save()
    seed = 100
    for prompt in args.prompts:
        if prompt + args.gen > report["max_model_len"]:
            report["rows"].append({"kind": "prompt", "prompt": prompt,
                                   "skipped": "longer than max_model_len"})
            continue
        seed += 1
        ttft, _ = timed_generate(llm, prompt, 1, 1, seed, vocab)
        # the same prompt again, now in the prefix cache: its decode steps at this depth
        wall, outs = timed_generate(llm, prompt, 1, 1 + args.gen, seed, vocab)
        step = decode_step_s(outs)
        report["rows"].append({"kind": "prompt", "prompt": prompt, "ttft_s": ttft,
                               "prefill_tok_s": prompt / ttft, "decode_step_ms": 1e3 * step,
                               "decode_tok_s": 1 / step,
                               "cached_tokens": outs[0].num_cached_tokens or 0})
        save()
    if args.batch:
        seed += 1
        t1 = time.perf_counter()
        timed_generate(llm, args.depth, args.batch, 1, seed, vocab)  # prefill, cached
        prefill_s = time.perf_counter() - t1
        wall, outs = timed_generate(llm, args.depth, args.batch, 1 + args.gen, seed, vocab)
        step = decode_step_s(outs)
        report["rows"].append({"kind": "batch", "batch": args.batch, "depth": args.depth,
                               "prefill_s": prefill_s, "decode_step_ms": 1e3 * step,
                               "decode_tok_s": args.batch / step})
    report["gpu_memory_used_mib_end"] = gpu_memory_used_mib()
    save()


def run_path(args, path: str, workdir: Path) -> dict:
    """One path in its own process; its report, the engine's log figures, and on a
    failure the return code and error lines."""
    out, log = workdir / f"{path}.json", workdir / f"{path}.log"
    env = {**os.environ, **PATHS[path]["env"], "PYTHONUNBUFFERED": "1"}
    if args.launch_blocking:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    cmd = [sys.executable, "-m", "benchmarks.glm5_long_context", "--path", path,
           "--out", str(out), "--gguf", args.gguf, "--gen", str(args.gen),
           "--batch", str(args.batch), "--depth", str(args.depth),
           "--prompts", *map(str, args.prompts)]
    for key, value in overrides(args).items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    if args.eager:
        cmd.append("--eager")
    t0 = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = log.read_text(errors="replace")
    result = json.loads(out.read_text()) if out.exists() else {"rows": [], "started": False}
    result.update(path=path, rc=rc, wall_s=time.perf_counter() - t0,
                  launch_blocking=args.launch_blocking, **log_figures(text))
    if rc != 0:
        result["error_lines"] = error_lines(text)
    return result


def llama_bench_decode(path: str) -> dict[int, float]:
    """llama.cpp's decode tokens/s by depth from a `llama-bench -o json` report: its rows
    of generated tokens alone (`-p 0 -n N -d DEPTHS`)."""
    records = json.loads(Path(path).read_text())
    rows = {int(r["n_depth"]): float(r["avg_ts"]) for r in records
            if r.get("n_prompt") == 0 and r.get("n_gen", 0) > 0 and "n_depth" in r}
    if not rows:
        raise ValueError(f"{path}: no decode rows (llama-bench -p 0 -n N -d DEPTHS -o json)")
    return rows


def add_llama_cpp(report: dict, path: str) -> dict:
    """llama.cpp's decode at each depth, and each prompt row's ratio at its own depth."""
    decode = llama_bench_decode(path)
    report["llama_cpp"] = {"llama_bench": str(path),
                           "decode_tok_s_by_depth": {str(d): v for d, v in decode.items()}}
    for r in report["paths"].values():
        for row in r["rows"]:
            if row["kind"] == "prompt" and "decode_tok_s" in row and row["prompt"] in decode:
                row["llama_cpp_decode_tok_s"] = decode[row["prompt"]]
                row["x_llama_cpp"] = row["decode_tok_s"] / decode[row["prompt"]]
    return report


def markdown(report: dict) -> str:
    llama = "llama_cpp" in report
    lines = [f"GGUF `{Path(report['gguf']).name}`; rows per path (vLLM's defaults except "
             f"{report['overrides'] or 'nothing'})", "",
             "| path | rc | max_model_len | chunk | KV tokens | KV GiB | GPU MiB (start/end) "
             "| row | TTFT s | decode tok/s |" + (" llama.cpp tok/s | x |" if llama else ""),
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if llama else "")]
    for r in report["paths"].values():
        head = (f"| {r['path']} | {r['rc']} | {r.get('max_model_len', '-')} | "
                f"{r.get('max_num_batched_tokens', '-')} | {r.get('kv_cache_tokens', '-')} | "
                f"{r.get('kv_cache_gib', '-')} | {r.get('gpu_memory_used_mib_start', '-')}/"
                f"{r.get('gpu_memory_used_mib_end', '-')}")
        rows = r["rows"] or [{"kind": "none"}]
        for row in rows:
            if row["kind"] == "prompt" and "ttft_s" in row:
                what, ttft = f"prompt {row['prompt']}", f"{row['ttft_s']:.2f}"
            elif row["kind"] == "batch":
                what, ttft = f"{row['batch']} x {row['depth']}", "-"
            else:
                what, ttft = row.get("skipped", "no row"), "-"
            tok_s = f"{row['decode_tok_s']:.1f}" if "decode_tok_s" in row else "-"
            line = f"{head} | {what} | {ttft} | {tok_s} |"
            if llama:
                line += (f" {row['llama_cpp_decode_tok_s']:.1f} | {row['x_llama_cpp']:.2f} |"
                         if "x_llama_cpp" in row else " - | - |")
            lines.append(line)
        for err in r.get("error_lines", [])[-3:]:
            lines.append(f"| | | | | | | | `{err[:150]}` | | |" + (" | |" if llama else ""))
    return "\n".join(lines)


def make_tiny(out_dir: Path) -> list[Path]:
    """The tiny GLM-5 with GLM-5's top-k as llama.cpp's Q4_K_M, at each of TINY_CONTEXTS."""
    from tests.models.glm5_tiny import make_tiny_glm5
    from tests.models.quantization import gguf_reference as gr

    out_dir.mkdir(parents=True, exist_ok=True)
    llama_cpp = gr.llama_cpp_dir(out_dir / "llama-cpp")
    files = []
    for context in TINY_CONTEXTS:
        model = make_tiny_glm5(out_dir / f"tiny-glm5-{context}", index_topk=2048,
                               max_position_embeddings=context)
        gr.write_tokenizer(model, gr.config(model)["vocab_size"])
        bf16 = gr.convert(llama_cpp, model, out_dir / f"tiny-glm5-{context}-bf16.gguf", "bf16")
        files.append(gr.quantize(bf16, out_dir / f"tiny-glm5-{context}-Q4_K_M.gguf", "Q4_K_M"))
    return files


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf")
    p.add_argument("--paths", nargs="*", default=["upstream", "sm120"], choices=list(PATHS))
    p.add_argument("--prompts", type=int, nargs="*", default=[131072, 200000])
    p.add_argument("--batch", type=int, default=8, help="sequences decoding at --depth (0: none)")
    p.add_argument("--depth", type=int, default=32768)
    p.add_argument("--gen", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None, help="default: the file's")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--eager", action="store_true", help="enforce_eager (default: CUDA graphs)")
    p.add_argument("--launch-blocking", action="store_true", help="CUDA_LAUNCH_BLOCKING=1")
    p.add_argument("--timeout", type=int, default=1200, help="seconds a path may take")
    p.add_argument("--workdir", default=None, help="logs and partial reports (default: "
                   "beside --json)")
    p.add_argument("--llama-bench", default=None, metavar="FILE",
                   help="llama-bench's -o json report at the prompts' depths (-p 0 -n N -d ...)")
    p.add_argument("--from", dest="from_report", default=None, metavar="REPORT",
                   help="add --llama-bench to this report (no engine run)")
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    p.add_argument("--make-tiny", default=None, metavar="DIR",
                   help="write the tiny GLM-5 Q4_K_M files of the long-context matrix")
    p.add_argument("--path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.make_tiny:
        for f in make_tiny(Path(args.make_tiny)):
            print(f)
        return None
    if args.from_report:
        if not args.llama_bench:
            p.error("--from needs --llama-bench")
        report = add_llama_cpp(json.loads(Path(args.from_report).read_text()), args.llama_bench)
        write_report(report, markdown(report), args.json, args.md)
        return report
    if not args.gguf:
        p.error("--gguf is required")
    if args.path:
        return worker(args)
    workdir = Path(args.workdir or (Path(args.json).with_suffix(".runs") if args.json
                                    else "long-context.runs"))
    workdir.mkdir(parents=True, exist_ok=True)
    given = overrides(args) | ({"enforce_eager": True} if args.eager else {})
    report = {"gguf": args.gguf, "gguf_bytes": Path(args.gguf).stat().st_size,
              "overrides": given, "args": vars(args), "paths": {}}
    for path in args.paths:
        report["paths"][path] = run_path(args, path, workdir)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.llama_bench:
        add_llama_cpp(report, args.llama_bench)
    write_report(report, markdown(report), args.json, args.md)
    return report


if __name__ == "__main__":
    main()
