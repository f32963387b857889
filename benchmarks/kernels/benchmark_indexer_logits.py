# SPDX-License-Identifier: Apache-2.0
"""Sparse-indexer logits: the portable Triton kernels vs DeepGEMM, same inputs.

    python benchmarks/kernels/benchmark_indexer_logits.py [--json out.json]

GLM-5 indexer shape (32 heads x 128, fp8). Prefill: M query rows of one request
whose keys end at N (causal bounds), compute-bound: 2*M*N*32*128 FLOP (upper
bound; causal rows do a little less). Decode: `batch` rows with `ctx` keys in a
paged cache (block 64), bandwidth-bound: batch*ctx*132 bytes read (fp8 key +
fp32 scale). Median GPU time per call (triton.testing.do_bench); decode calls
are timed from CUDA-graph replays (as vLLM runs decode) over block tables that
rotate through a pool larger than L2, and the Triton kernel's eager time, Python
launch included, is reported beside it.
"""

import argparse
import json
import math

import torch
from triton.testing import do_bench

from vllm.v1.attention.ops import triton_indexer_logits as il

from cuda_graph_timing import graph_us  # this folder

FP8 = torch.float8_e4m3fn
H, D, BS = 32, 128, 64


def prefill_case(M, N, dg):
    q = torch.randn(M, H, D, device="cuda").to(FP8)
    k = torch.randn(N, D, device="cuda").to(FP8)
    ks_ = torch.rand(N, device="cuda") * 0.02
    w = torch.randn(M, H, device="cuda") * 0.1
    lo = torch.zeros(M, dtype=torch.int32, device="cuda")
    hi = torch.arange(N - M + 1, N + 1, dtype=torch.int32, device="cuda")
    row = {"kind": "prefill", "M": M, "N": N, "flop": 2 * M * N * H * D}
    row["triton_us"] = 1e3 * do_bench(lambda: il.triton_mqa_logits(q, k, ks_, w, lo, hi),
                                      warmup=10, rep=50, return_mode="median")
    if dg is not None:
        row["deepgemm_us"] = 1e3 * do_bench(
            lambda: dg.fp8_fp4_mqa_logits((q, None), (k, ks_), w, lo, hi, clean_logits=False),
            warmup=10, rep=50, return_mode="median")
    return row


def decode_case(batch, ctx, dg, max_model_len):
    # Several block tables over a pool larger than L2, so that calls in a row
    # do not find their keys in L2 (one set when a set alone exceeds it).
    per_set = batch * math.ceil(ctx / BS)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    sets = max(1, min(16, math.ceil(4 * l2 / (per_set * BS * (D + 4)))))
    nb = per_set * sets + 1
    cache = torch.randint(0, 120, (nb, BS, D + 4), dtype=torch.uint8, device="cuda")
    cache.view(nb, -1)[:, BS * D:] = 0
    cache.view(nb, -1)[:, BS * D:].view(torch.float32).uniform_(0.01, 0.02)
    perm = torch.randperm(nb - 1, device="cuda", dtype=torch.int32)
    tables = [torch.nn.functional.pad(perm[i * per_set:(i + 1) * per_set].view(batch, -1),
                                      (0, math.ceil(max_model_len / BS) - per_set // batch))
              for i in range(sets)]
    q = torch.randn(batch, 1, H, D, device="cuda").to(FP8)
    w = torch.randn(batch, H, device="cuda") * 0.1
    seq = torch.full((batch, 1), ctx, dtype=torch.int32, device="cuda")
    row = {"kind": "decode", "batch": batch, "ctx": ctx, "bytes": batch * ctx * (D + 4)}

    def triton_call(table):
        return lambda: il.triton_paged_mqa_logits(q, cache, w, seq, table, max_model_len)

    row["triton_us"] = graph_us([triton_call(t) for t in tables])
    # eager, Python launch included (what do_bench alone reports at small sizes)
    row["triton_eager_us"] = 1e3 * do_bench(triton_call(tables[0]), warmup=10, rep=50,
                                            return_mode="median")
    if dg is not None:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        meta = dg.get_paged_mqa_logits_metadata(seq, BS, sms)

        def dg_call(table):
            return lambda: dg.fp8_fp4_paged_mqa_logits(
                (q, None), cache.unsqueeze(-2), w, seq, table, meta,
                max_model_len=max_model_len, clean_logits=False)

        row["deepgemm_us"] = graph_us([dg_call(t) for t in tables])
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from vllm.platforms import current_platform
    from vllm.utils import deep_gemm

    dg = deep_gemm if deep_gemm.has_deep_gemm() and current_platform.support_deep_gemm() else None
    rows = []
    for M, N in ((4096, 4096), (4096, 16384), (4096, 65536)):
        rows.append(prefill_case(M, N, dg))
    for ctx in (8192, 65536):
        for batch in (1, 8, 64, 256):
            rows.append(decode_case(batch, ctx, dg, 65536 + 64))
            torch.cuda.empty_cache()
    print(f"device: {torch.cuda.get_device_name(0)}; DeepGEMM: {'yes' if dg else 'no'}")
    print("| case | triton us | deepgemm us | triton/deepgemm | triton rate | triton eager us |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        name = (f"prefill M={r['M']} N={r['N']}" if r["kind"] == "prefill"
                else f"decode batch={r['batch']} ctx={r['ctx']}")
        rate = (f"{r['flop'] / r['triton_us'] / 1e6:.0f} TFLOP/s" if r["kind"] == "prefill"
                else f"{r['bytes'] / r['triton_us'] / 1e6:.2f} TB/s")
        dgt = r.get("deepgemm_us")
        dg_text = "-" if dgt is None else f"{dgt:.1f}"
        ratio = "-" if dgt is None else f"{r['triton_us'] / dgt:.2f}"
        eager = f"{r['triton_eager_us']:.1f}" if "triton_eager_us" in r else "-"
        print(f"| {name} | {r['triton_us']:.1f} | {dg_text} | {ratio} | {rate} | {eager} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
