# SPDX-License-Identifier: Apache-2.0
"""Time from `vllm serve FILE` (and `llama-server -m FILE`) to a healthy server.

    python -m benchmarks.serve_cold_start --gguf 2L.gguf 3L.gguf \
        [--llama-server BIN] [--as-capability 12.0:101376] --json cold.json --md cold.md

For each file, in turn: vLLM cold (fresh vLLM, Triton, Inductor, DeepGEMM and CUDA driver
JIT caches), vLLM warm (the caches the cold start filled), and with --llama-server llama.cpp's
server, cold and warm. "Cold" also evicts the file from the page cache first
(posix_fadvise DONTNEED, no root needed; a page another process maps stays); "warm"
reads it from the page cache the start before filled. Each start is timed until
/health answers 200, with the peak resident memory of the server's process tree
sampled all along, then stopped. From vLLM's log: the model's load time (vLLM's
"Model loading took ... seconds") and with it the GGUF bytes read a second, torch.compile
and CUDA graph capture.
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.serve_soak import process_tree

# vLLM's log lines of a start, each as (name, pattern of its seconds)
VLLM_PHASES = {
    "load_s": r"Model loading took .*? and ([\d.]+) seconds",
    "compile_s": r"torch\.compile took ([\d.]+) s in total",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",
    "engine_init_s": r"init engine \(.*?\) took ([\d.]+) s",
    "profile_run_s": r"Initial profiling/warmup run took ([\d.]+) s",
    "mla_prefill_warmup_s": r"Warmed up the MLA prefill kernels \(.*?\) in ([\d.]+) s",
}


def evict(path: Path) -> bool:
    """Drop the file's pages from the page cache; False where the OS does not offer it."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    finally:
        os.close(fd)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def time_to_healthy(cmd: list[str], env: dict, health_url: str, log: Path,
                    timeout: float) -> dict:
    """Start `cmd`, wait for `health_url`, stop it; seconds to healthy (None if it died or
    timed out), the peak RSS of its process tree, and how it ended."""
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    peak, took, why = 0.0, None, "timeout"
    try:
        while time.monotonic() - t0 < timeout:
            tree = process_tree(proc.pid)
            peak = max(peak, sum(tree.values()) * os.sysconf("SC_PAGE_SIZE") / 2**20)
            if proc.poll() is not None:
                why = f"exited with {proc.returncode}"
                break
            if healthy(health_url):
                took, why = time.monotonic() - t0, "healthy"
                break
            time.sleep(0.25)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return {"healthy_s": None if took is None else round(took, 2), "end": why,
            "peak_rss_mib": round(peak, 1)}


def vllm_phases(log_text: str) -> dict:
    out = {}
    for name, pattern in VLLM_PHASES.items():
        m = re.findall(pattern, log_text)
        out[name] = float(m[-1]) if m else None
    return out


def fresh_caches(root: Path) -> dict:
    """Environment variables pointing every compile and JIT cache into `root`, the CUDA
    driver's too (its PTX compilations, tens of seconds on a new machine: FA2's prefill
    kernels on SM120, vLLM's Marlin MoE on SM90)."""
    root.mkdir(parents=True, exist_ok=True)
    return {"VLLM_CACHE_ROOT": str(root / "vllm"), "TRITON_CACHE_DIR": str(root / "triton"),
            "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
            "DG_JIT_CACHE_DIR": str(root / "deep_gemm"), "FLASHINFER_WORKSPACE_BASE": str(root),
            "CUDA_CACHE_PATH": str(root / "nv")}


def run(args) -> dict:
    work = Path(args.work or tempfile.mkdtemp(prefix="cold-start-"))
    base_env = dict(os.environ)
    if args.as_capability:
        cap, smem = args.as_capability.split(":")
        base_env.update(VLLM_TEST_REPORT_CAPABILITY=cap, VLLM_TEST_REPORT_SHARED_MEM=smem)
    rows = []
    for gguf in map(Path, args.gguf):
        size = gguf.stat().st_size
        caches = work / f"caches-{gguf.stem}"
        shutil.rmtree(caches, ignore_errors=True)
        env = {**base_env, **fresh_caches(caches)}
        sides = [("vllm", [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve",
                           str(gguf), "--port", str(args.port), *args.vllm_args])]
        if args.llama_server:
            sides.append(("llama.cpp", [args.llama_server, "-m", str(gguf), "--port",
                                        str(args.port), *args.llama_args]))
        for side, cmd in sides:
            for state in ("cold", "warm"):
                evicted = evict(gguf) if state == "cold" else None
                log = work / f"{gguf.stem}-{side}-{state}.log"
                r = time_to_healthy(cmd, env, f"http://127.0.0.1:{args.port}/health", log,
                                    args.timeout)
                row = {"file": gguf.name, "file_bytes": size, "side": side, "state": state,
                       "page_cache_evicted": evicted, **r, "command": cmd, "log": str(log)}
                if side == "vllm":
                    row.update(vllm_phases(log.read_text(errors="replace")))
                    row["read_gb_s"] = (round(size / 1e9 / row["load_s"], 2)
                                        if row["load_s"] else None)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
    return {"rows": rows, "as_capability": args.as_capability}


def markdown(rep: dict) -> str:
    out = ["| file | side | start | healthy (s) | model load (s) | GB/s | compile (s) "
           "| graphs (s) | peak RSS (GiB) |", "|---|---|---|---|---|---|---|---|---|"]

    def f(v, d=1):
        return "-" if v is None else f"{v:.{d}f}"

    for r in rep["rows"]:
        out.append(f"| {r['file']} ({r['file_bytes'] / 1e9:.1f} GB) | {r['side']} | {r['state']} "
                   f"| {f(r['healthy_s'])} | {f(r.get('load_s'))} | {f(r.get('read_gb_s'), 2)} "
                   f"| {f(r.get('compile_s'))} | {f(r.get('graph_capture_s'))} "
                   f"| {r['peak_rss_mib'] / 1024:.1f} |")
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", nargs="+", required=True)
    p.add_argument("--llama-server", default=None, help="llama-server's binary")
    p.add_argument("--as-capability", default=None,
                   help="CAP:SHARED_MEM, reported by tests/plugins/vllm_report_capability")
    p.add_argument("--vllm-args", nargs=argparse.REMAINDER, default=[],
                   help="the rest of the command line goes to `vllm serve`")
    p.add_argument("--llama-args", nargs="*", default=["-ngl", "999"])
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--work", default=None, help="caches and logs (default: a new temp dir)")
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    args = p.parse_args()
    rep = run(args)
    text = markdown(rep)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1))
    if args.md:
        Path(args.md).write_text(text)
    ok = all(r["end"] == "healthy" for r in rep["rows"])
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
