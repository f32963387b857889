# SPDX-License-Identifier: Apache-2.0
"""The memory bound of a GLM-5 decode step: the bytes it must read, over the bandwidth.

    python -m benchmarks.glm5_step_bound --layers 2 --bandwidth-from OPS.json \
        [--report VS.json] [--batches 1 8 32] [--depths 0 8192] [--project 78] \
        [--json OUT.json] [--md OUT.md]

A decode step of B sequences at depth D reads at least: every weight outside the routed
experts once (of the token embedding only B rows), the routed experts that one of the B
tokens picks (routing taken as uniform: each token picks k of E experts, so a layer
reads E (1 - (1 - k/E)^B) of them), and per layer and sequence the indexer's keys of
all D tokens and the MLA latents of the top-k it selects. The tensors and their types
are llama.cpp's Q4_K_M of a GLM-5-shaped file of `--layers` layers
(`gguf_model.synthetic.plan`: the GLM-5-shaped files' own, one dense layer then MoE
ones); the cache's bytes a token are the overlay's defaults on a 16-bit model (MLA
latents in 16 bits, the indexer's keys in fp8 with a float32 scale).
`--bandwidth-from` takes the bandwidth torch.mm reaches reading 16-bit weights from the
dense rows of `benchmarks/kernels/benchmark_gguf_ops.py` (its `mm16` path) run on the
same GPU: bytes over that is the fastest a step can be there. `--report` sets each
engine's measured decode (a `glm5_vs_llama_cpp.py` report of a file of those layers)
against it: the share of the bound each reaches, and the most a step could gain over
llama.cpp's (llama.cpp's time over the bound). `--project` adds the bound of a file of
that many layers (GLM-5: 78).
"""

import argparse
import json
import math
from pathlib import Path

from benchmarks.glm5_vs_llama_cpp import write_report

MLA_BYTES = (512 + 64) * 2  # kv_lora_rank + rope dims, 16-bit
INDEX_KEY_BYTES = 128 + 4  # index_head_dim in fp8 and its float32 scale
EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def expected_experts(n_experts: int, top_k: int, tokens: int) -> float:
    """The experts of a layer that at least one of `tokens` tokens picks, each token
    picking `top_k` distinct of `n_experts` uniformly."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


def step_bytes(layers: int, batch: int, depth: int, shape: str = "glm5") -> dict:
    """The bytes a decode step of `batch` sequences at `depth` reads at least, by kind,
    on a GLM-5-shaped Q4_K_M file of `layers` layers (`shape`: synthetic.SHAPES)."""
    from vllm_gguf_plugin.gguf_model import synthetic

    shape = synthetic.SHAPES[shape]
    tensors = synthetic.plan(shape, layers)
    touched = expected_experts(shape.n_routed_experts, shape.num_experts_per_tok, batch)
    out = {"weights": 0.0, "experts": 0.0, "embedding": 0.0, "cache": 0.0}
    for t in tensors:
        if t.name == "token_embd.weight":
            out["embedding"] += t.nbytes * batch / shape.vocab_size
        elif t.name.split(".")[-2] in EXPERTS:
            out["experts"] += t.nbytes * touched / shape.n_routed_experts
        else:
            out["weights"] += t.nbytes
    out["cache"] = layers * batch * (min(depth, shape.index_topk) * MLA_BYTES
                                     + depth * INDEX_KEY_BYTES)
    out["total"] = sum(out.values())
    return out


def bandwidth_from(ops_report: dict) -> dict:
    """The highest bandwidth torch.mm reached on 16-bit weights among a benchmark_gguf_ops
    report's dense rows (weights, activations and output over the `mm16` path's time)."""
    best = None
    for row in ops_report["rows"]:
        us = row.get("paths", {}).get("mm16", {}).get("us")
        if row.get("op") != "dense" or not us:
            continue
        m, n, k = row["M"], row["N"], row["K"]
        bytes_per_s = 2 * (n * k + m * k + m * n) / (us * 1e-6)
        if best is None or bytes_per_s > best["bytes_per_s"]:
            best = {"bytes_per_s": bytes_per_s, "case": row["case"], "type": row["type"],
                    "M": m}
    if best is None:
        raise ValueError("no dense row with an mm16 time (benchmark_gguf_ops --ops dense)")
    return {**best, "device": ops_report.get("device")}


def measured_ms(report: dict) -> dict[str, dict[str, float]]:
    """{engine: {case: ms}} of a glm5_vs_llama_cpp report's decode cases."""
    from benchmarks.glm5_vs_llama_cpp import case_ms

    out = {}
    llama = report.get("llama_cpp", {}).get("figures")
    if llama:
        out["llama.cpp"] = case_ms(llama, llama.get("aggregate"))
    for path, r in report.get("paths", {}).items():
        if "figures" in r:
            out[path] = case_ms(r["figures"])
    return {e: {c: ms for c, ms in cases.items() if c.startswith("decode")}
            for e, cases in out.items()}


def bound(layers: int, batches, depths, bandwidth: float, project: int | None = None,
          report: dict | None = None) -> dict:
    result = {"layers": layers, "bandwidth_bytes_per_s": bandwidth, "cases": {}}
    if report is not None and report.get("layers") not in (None, layers):
        raise ValueError(f"--report is of a {report['layers']}-layer file, --layers {layers}")
    engines = measured_ms(report) if report is not None else {}
    for depth in depths:
        for batch in batches:
            case = f"decode batch {batch} at depth {depth}"
            nbytes = step_bytes(layers, batch, depth)
            ms = 1e3 * nbytes["total"] / bandwidth
            row = {"bytes": nbytes, "gb_read": nbytes["total"] / 1e9, "bound_ms": ms,
                   "bound_tok_s": batch / ms * 1e3}
            if project:
                p = step_bytes(project, batch, depth)
                row["projected"] = {"layers": project, "bytes": p["total"],
                                    "bound_ms": 1e3 * p["total"] / bandwidth}
            for engine, cases in engines.items():
                if case in cases:
                    row.setdefault("engines", {})[engine] = {
                        "ms": cases[case], "share_of_bound": ms / cases[case]}
            llama = row.get("engines", {}).get("llama.cpp")
            if llama:
                # the most any engine's step could be faster than llama.cpp's on this GPU
                row["max_x_llama_cpp"] = llama["ms"] / ms
            result["cases"][case] = row
    return result


def markdown(result: dict) -> str:
    engines = sorted({e for r in result["cases"].values() for e in r.get("engines", {})},
                     key=lambda e: (e != "llama.cpp", e))
    head = ["case", "GB read", "bound, ms"] + [f"{e}, ms" for e in engines] + \
        [f"{e}, share of bound" for e in engines] + ["most x llama.cpp"]
    if any("projected" in r for r in result["cases"].values()):
        head.append("bound at %d layers, ms" % next(
            r["projected"]["layers"] for r in result["cases"].values() if "projected" in r))
    lines = [f"{result['layers']}-layer GLM-5-shaped Q4_K_M file, "
             f"{result['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s", "",
             "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for case, r in result["cases"].items():
        cells = [case, f"{r['gb_read']:.2f}", f"{r['bound_ms']:.3f}"]
        for key in ("ms", "share_of_bound"):
            for e in engines:
                v = r.get("engines", {}).get(e, {}).get(key)
                cells.append("-" if v is None else f"{v:.3f}" if key == "ms" else f"{v:.2f}")
        cells.append(f"{r['max_x_llama_cpp']:.1f}" if "max_x_llama_cpp" in r else "-")
        if "projected" in r:
            cells.append(f"{r['projected']['bound_ms']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--bandwidth", type=float, default=None, help="bytes/s")
    p.add_argument("--bandwidth-from", default=None, metavar="OPS.json",
                   help="benchmark_gguf_ops --ops dense report of the same GPU")
    p.add_argument("--report", default=None, metavar="VS.json",
                   help="glm5_vs_llama_cpp report of a file of --layers layers")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--depths", type=int, nargs="+", default=[0, 8192])
    p.add_argument("--project", type=int, default=None, help="layers of a whole model (78)")
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    args = p.parse_args(argv)
    if (args.bandwidth is None) == (args.bandwidth_from is None):
        p.error("give one of --bandwidth and --bandwidth-from")
    source = None
    bandwidth = args.bandwidth
    if args.bandwidth_from:
        source = bandwidth_from(json.loads(Path(args.bandwidth_from).read_text()))
        bandwidth = source["bytes_per_s"]
    if not math.isfinite(bandwidth) or bandwidth <= 0:
        p.error(f"bandwidth {bandwidth}: not a positive number of bytes/s")
    report = json.loads(Path(args.report).read_text()) if args.report else None
    result = bound(args.layers, args.batches, args.depths, bandwidth, args.project, report)
    result["bandwidth_from"] = source
    write_report(result, markdown(result), args.json, args.md)
    return result


if __name__ == "__main__":
    main()
