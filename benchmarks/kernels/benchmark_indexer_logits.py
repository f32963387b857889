# SPDX-License-Identifier: Apache-2.0
"""Sparse-indexer logits: the portable Triton kernels (fp8 dots, and the 16-bit dots
of GPUs without them) vs DeepGEMM, same inputs.

    python -m benchmarks.kernels.benchmark_indexer_logits [--json out.json]

GLM-5 indexer shape (32 heads x 128, fp8). Prefill: M query rows of one request
whose keys end at N (causal bounds), compute-bound: 2*M*N*32*128 FLOP (upper
bound; causal rows do a little less). Decode: `batch` rows with `ctx` keys in a
paged cache (block 64), bandwidth-bound: batch*ctx*132 bytes read (fp8 key +
fp32 scale), the same bytes for both dot kinds (the 16-bit path reads the fp8
cache as bytes and converts in registers). Median GPU time per call
(triton.testing.do_bench); decode calls are timed from CUDA-graph replays (as
vLLM runs decode) over block tables that rotate through a pool larger than L2,
and the fp8-dot kernel's eager time, Python launch included, is reported beside it.

Each Triton kernel runs with fp8 dots where the GPU has them (SM89+) and with
16-bit dots (upcast=True: what SM80/86 run, forced here) on the same inputs; the
16-bit/fp8 column is their time ratio, checked against the SM80/86 targets (decode
within 1.3x of the fp8-dot path, prefill within 2.5x). Both paths' logits are
compared on every case's inputs before timing. With DISABLE_MMA_V3=1 in the
environment Triton compiles the dots as mma.sync, as it does on SM80/86/89/120 (no
wgmma there); the report records it.

The 16-bit key cache (VLLM_SPARSE_INDEXER_CACHE=16bit) runs beside them: bf16 q and
keys (256 bytes a key), no scales; its column is its time over the fp8-key path the
GPU takes by default (fp8 dots, else 16-bit ones). Its prefill logits are checked
against the fp8 path's on the same values (the keys' scales folded in, bf16-rounded).
"""

import argparse
import json
import math
import os

import torch
from triton.testing import do_bench

from vllm.v1.attention.ops import triton_indexer_logits as il

from benchmarks.kernels.cuda_graph_timing import graph_us

FP8 = torch.float8_e4m3fn
H, D, BS = 32, 128, 64
# 16-bit-dot time over fp8-dot time, at most (the SM80/86 issue's targets)
TARGET_16BIT = {"prefill": 2.5, "decode": 1.3}
DOTS = {"fp8": False, "16bit": True}  # name -> upcast


def check_same(calls: dict, rows: list[tuple[int, int]], rtol: float = 1e-3) -> None:
    """The dot kinds' logits agree on these (row, valid keys) (fp32 sums of the same
    fp8 products, up to fp8 tensor cores' reduced-precision accumulation; `rtol`
    2e-2 for bf16-rounded keys)."""
    if len(calls) < 2:
        return
    a, b = calls["fp8"](), calls["16bit"]()
    for r, n in rows:
        scale = a[r, :n].abs().max().item()
        torch.testing.assert_close(b[r, :n], a[r, :n], rtol=rtol, atol=rtol * scale)


def prefill_case(M, N, dg, dots):
    q = torch.randn(M, H, D, device="cuda").to(FP8)
    k = torch.randn(N, D, device="cuda").to(FP8)
    ks_ = torch.rand(N, device="cuda") * 0.02
    w = torch.randn(M, H, device="cuda") * 0.1
    lo = torch.zeros(M, dtype=torch.int32, device="cuda")
    hi = torch.arange(N - M + 1, N + 1, dtype=torch.int32, device="cuda")
    row = {"kind": "prefill", "M": M, "N": N, "flop": 2 * M * N * H * D}
    calls = {name: (lambda up=DOTS[name]: il.triton_mqa_logits(q, k, ks_, w, lo, hi, upcast=up))
             for name in dots}
    check_same(calls, [(m, int(hi[m])) for m in range(0, M, max(1, M // 16))])
    for name, call in calls.items():
        key = "triton_us" if name == "fp8" else "triton_16bit_us"
        row[key] = 1e3 * do_bench(call, warmup=10, rep=50, return_mode="median")
    q16, k16 = q.to(torch.bfloat16), (k.float() * ks_[:, None]).to(torch.bfloat16)
    keys16 = lambda: il.triton_mqa_logits(q16, k16, None, w, lo, hi)  # noqa: E731
    check_same({"fp8": calls[dots[0]], "16bit": keys16},
               [(m, int(hi[m])) for m in range(0, M, max(1, M // 16))], rtol=2e-2)
    row["triton_keys16_us"] = 1e3 * do_bench(keys16, warmup=10, rep=50, return_mode="median")
    if dg is not None:
        row["deepgemm_us"] = 1e3 * do_bench(
            lambda: dg.fp8_fp4_mqa_logits((q, None), (k, ks_), w, lo, hi, clean_logits=False),
            warmup=10, rep=50, return_mode="median")
    return row


def decode_case(batch, ctx, dg, max_model_len, dots):
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

    def triton_call(table, upcast):
        return lambda: il.triton_paged_mqa_logits(q, cache, w, seq, table, max_model_len,
                                                  upcast=upcast)

    check_same({name: triton_call(tables[0], DOTS[name]) for name in dots},
               [(b, ctx) for b in range(batch)])
    for name in dots:
        key = "triton_us" if name == "fp8" else "triton_16bit_us"
        row[key] = graph_us([triton_call(t, DOTS[name]) for t in tables])
    cache16 = torch.randn(nb, BS, D, device="cuda").to(torch.bfloat16)
    q16 = torch.randn(batch, 1, H, D, device="cuda").to(torch.bfloat16)
    row["triton_keys16_us"] = graph_us([
        (lambda t=t: il.triton_paged_mqa_logits(q16, cache16, w, seq, t, max_model_len))
        for t in tables])
    # eager, Python launch included (what do_bench alone reports at small sizes)
    first = dots[0]
    row["triton_eager_us" if first == "fp8" else "triton_16bit_eager_us"] = 1e3 * do_bench(
        triton_call(tables[0], DOTS[first]), warmup=10, rep=50, return_mode="median")
    if dg is not None:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        meta = dg.get_paged_mqa_logits_metadata(seq, BS, sms)

        def dg_call(table):
            return lambda: dg.fp8_fp4_paged_mqa_logits(
                (q, None), cache.unsqueeze(-2), w, seq, table, meta,
                max_model_len=max_model_len, clean_logits=False)

        row["deepgemm_us"] = graph_us([dg_call(t) for t in tables])
    return row


def with_ratios(row: dict) -> dict:
    """The row with the 16-bit/fp8 time ratio and whether it meets its target, and
    the 16-bit key cache's time over the default fp8-key path's."""
    row = dict(row)
    default = row.get("triton_us", row.get("triton_16bit_us"))
    if "triton_keys16_us" in row and default is not None:
        row["ratio_keys16"] = row["triton_keys16_us"] / default
    if "triton_us" in row and "triton_16bit_us" in row:
        row["ratio_16bit_fp8"] = row["triton_16bit_us"] / row["triton_us"]
        row["target_16bit_fp8"] = TARGET_16BIT[row["kind"]]
        row["target_met"] = row["ratio_16bit_fp8"] <= row["target_16bit_fp8"]
    return row


def table(rows: list[dict]) -> list[str]:
    """The rows as a markdown table (times in us; '-' where a path did not run)."""
    def us(v):
        return "-" if v is None else f"{v:.1f}"

    def rate(r, t):
        if t is None:
            return "-"
        return (f"{r['flop'] / t / 1e6:.0f}" if r["kind"] == "prefill"
                else f"{r['bytes'] / t / 1e6:.2f}")

    out = ["| case | fp8-dot us | 16-bit-dot us | 16-bit/fp8 (target) | DeepGEMM us "
           "| fp8-dot/DeepGEMM | rate fp8 / 16-bit | eager us | 16-bit keys us (/ fp8 keys) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["kind"] == "prefill":
            name, unit = f"prefill M={r['M']} N={r['N']}", "TFLOP/s"
        else:
            name, unit = f"decode batch={r['batch']} ctx={r['ctx']}", "TB/s"
        fp8, b16, dgt = r.get("triton_us"), r.get("triton_16bit_us"), r.get("deepgemm_us")
        ratio = "-"
        if "ratio_16bit_fp8" in r:
            verdict = "met" if r["target_met"] else "NOT met"
            ratio = f"{r['ratio_16bit_fp8']:.2f} (<= {r['target_16bit_fp8']}: {verdict})"
        vs_dg = "-" if fp8 is None or dgt is None else f"{fp8 / dgt:.2f}"
        eager = us(r.get("triton_eager_us", r.get("triton_16bit_eager_us")))
        keys16 = us(r.get("triton_keys16_us"))
        if "ratio_keys16" in r:
            keys16 += f" ({r['ratio_keys16']:.2f})"
        out.append(f"| {name} | {us(fp8)} | {us(b16)} | {ratio} | {us(dgt)} | {vs_dg} "
                   f"| {rate(r, fp8)} / {rate(r, b16)} {unit} | {eager} | {keys16} |")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from vllm.platforms import current_platform
    from vllm.utils import deep_gemm

    dg = deep_gemm if deep_gemm.has_deep_gemm() and current_platform.support_deep_gemm() else None
    # fp8 dots (and e4m3 in Triton) from SM89 on: the device itself, not a reported one
    dots = ["fp8", "16bit"] if torch.cuda.get_device_capability() >= (8, 9) else ["16bit"]
    rows = []
    for M, N in ((4096, 4096), (4096, 16384), (4096, 65536)):
        rows.append(with_ratios(prefill_case(M, N, dg, dots)))
    for ctx in (8192, 65536):
        for batch in (1, 8, 64, 256):
            rows.append(with_ratios(decode_case(batch, ctx, dg, 65536 + 64, dots)))
            torch.cuda.empty_cache()
    mma = "mma.sync (DISABLE_MMA_V3=1)" if os.environ.get("DISABLE_MMA_V3") == "1" else "default"
    print(f"device: {torch.cuda.get_device_name(0)}; DeepGEMM: {'yes' if dg else 'no'}; "
          f"dots: {', '.join(dots)}; Triton's tensor-core instructions: {mma}")
    print("\n".join(table(rows)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "dots": dots, "mma": mma,
                       "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
