# SPDX-License-Identifier: Apache-2.0
"""GGUF matrix products at GLM-5's shapes: each kernel path of vllm-gguf-plugin by token
count, against the 16-bit tensor-core bound, same weights.

    python -m benchmarks.kernels.benchmark_gguf_ops [--json out.json] [--md out.md]
        [--types Q4_K Q6_K Q8_0 IQ2_S Q4_K/Q6_K] [--tokens 1 8 64 512 8192] [--ops dense moe]
        [--triton-block-m 4 16 64] [--paths plugin marlin ...]

Why: the overlay's prefill of a GGUF runs 3-4x slower than llama.cpp's on the same file
(docs/results.md#2-speed-against-llamacpp); this finds which products hold that time and
what each of the plugin's kernels costs at each token count.

Ops (GLM-5 at TP 1, float16 activations):
- dense: x [M, K] times a quantized [N, K] weight, for GLM-5's larger linear layers
  (DENSE_SHAPES);
- moe: 256 routed experts of 2048, hidden 6144, top-8 (uniform random routing), both
  products and the activation (gate_up [256, 4096, 6144], down [256, 6144, 2048]); a
  type A/B quantizes gate_up as A and down as B (Q4_K/Q6_K: half of a Q4_K_M file's
  MoE layers, whose down projections llama.cpp keeps at Q6_K).
Paths (a path a type has no kernel for is left out):
- dense: `plugin` (the plugin's own choice by M, torch.ops.vllm._fused_mul_mat_gguf),
  `mmvq` (CUDA, int8 activations, a row at a time), `mmq` (CUDA, int8 activations,
  tiled), `triton` (the plugin's Triton GEMM, 16-bit activations),
  `dequant` (dequantize to 16 bits as the engine does, Q4_K and Q6_K on Triton,
  linear.dequantize; then torch.mm), `dequant-cuda` (the same on the plugin's CUDA
  dequantization, where it differs), and `mm16` (torch.mm on the weights dequantized
  beforehand: the 16-bit tensor-core bound, not a path);
- moe: `plugin` (torch.ops.vllm._fused_moe_gguf), `vec` (CUDA ggml_moe_a8_vec), `mmq`
  (CUDA ggml_moe_a8), `triton-bm<B>` (the plugin's Triton MoE kernel with BLOCK_M B
  tokens per tile; the plugin runs B = 4), `marlin` (Q4_K gate_up: the overlay's moe_marlin,
  the file's values on vLLM's Marlin MoE plus their b-part, a down product of another
  type on the GGUF kernels: what the engine runs for such layers unless
  VLLM_GGUF_MOE_MARLIN=0), `dequant` (all experts
  dequantized as the engine does from 1024 tokens, then vLLM's fused_experts), `fused16`
  (vLLM's fused_experts on weights dequantized beforehand: the 16-bit bound) and `marlin4`
  (vLLM's Marlin MoE, a tensor-core int4 kernel, on the dequantized experts quantized
  again to GPTQ's symmetric int4 with a scale per group of 32: the speed an int4 kernel
  reaches at these shapes, on as many bytes as Q4_K's; other codes than the file's, so its
  error is that requantization's, and like fused16 it is a bound, not a path). `mmq` and
  `triton-bm<B>` run as the overlay runs them: in expert groups whose bytes fit the
  kernels' 32-bit offsets (vllm_gguf_plugin/quantization/moe_expert_groups.py; GLM-5's
  gate_up passes 2^31 bytes from Q3_K up).
Each path's output is compared with float32 products of the dequantized weights (rel =
max |error| / max |reference|) before it is timed; a path off by more than 5% is marked
and not counted as fastest. Time: median GPU time of one call replayed in a CUDA graph
(cuda_graph_timing.graph_us), eager do_bench where a path cannot be captured.

The weights are random blocks: random bytes with bits 4 to 6 of every byte cleared, so
that every float16 scale field is finite and below 2^-11 (no NaN, and no float16 overflow
at these shapes with activations of unit norm); the kernels' speed does not depend on
the values. Bytes = the quantized weights a call
reads (for MoE the experts its tokens hit), flop = 2 x multiply-adds.
"""

import argparse
import functools
import json
import os
import sys

import torch

# name: (N, K) of GLM-5's dense products (hidden 6144, 64 heads, q_lora 2048, kv_lora 512)
DENSE_SHAPES = {
    "qkv_a": (2048 + 576, 6144),  # fused q_a + kv_a
    "q_b": (64 * 256, 2048),
    "o_proj": (6144, 64 * 256),
    "mlp_gate_up": (2 * 12288, 6144),  # the dense layers' MLP
    "mlp_down": (6144, 12288),
    "lm_head": (154880, 6144),
}
MOE_SHAPE = {"experts": 256, "hidden": 6144, "intermediate": 2048, "top_k": 8}
TYPES = ("Q4_K", "Q6_K", "Q8_0", "IQ2_S")
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 512, 2048, 8192)
TRITON_MOE_BLOCK_M = (4, 16, 64)
WRONG = 0.05
BOUNDS = ("mm16", "fused16", "marlin4")  # timed beside the paths, never the fastest path
# bounds run on other codes than the file's (requantized): their error is not a kernel's
REQUANTIZED = ("marlin4",)
MARLIN_GROUP = 32  # values a scale of marlin4 (Q4_K's sub-block)
VEC_MAX_TOKENS = 512  # the one-pair-at-a-time MoE kernel is timed up to here (slow beyond)


def random_blocks(qtype: str, rows: int, cols: int, generator=None) -> torch.Tensor:
    """[rows, cols / block * type_size] uint8 of random blocks whose float16 fields are
    finite and small (bits 4 to 6 of each byte cleared: exponent <= 3), on the CPU."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    if cols % block:
        raise ValueError(f"{qtype}: {cols} columns are not whole blocks of {block}")
    raw = torch.randint(0, 256, (rows, cols // block * size), dtype=torch.uint8,
                        generator=generator)
    return raw & 0x8F


def dense_flop_bytes(m: int, n: int, k: int, qtype: str) -> tuple[int, int]:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    return 2 * m * n * k, n * k // block * size + 2 * m * (n + k)


def moe_types(qtype: str) -> tuple[str, str]:
    """The gate_up and down types of a MoE case's type ("Q4_K", or "Q4_K/Q6_K")."""
    gate_up, _, down = qtype.partition("/")
    return gate_up, down or gate_up


def moe_flop_bytes(m: int, qtype: str, shape=None) -> tuple[int, int]:
    """flop of both products; bytes of the experts M tokens can hit (all once M * top_k
    reaches the expert count) plus activations."""
    import gguf

    s = shape or MOE_SHAPE
    (b1, s1), (b2, s2) = (gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]]
                          for t in moe_types(qtype))
    e, h, i, k = s["experts"], s["hidden"], s["intermediate"], s["top_k"]
    per_expert = 2 * i * h // b1 * s1 + h * i // b2 * s2
    hit = min(e, m * k)
    return 2 * m * k * 3 * h * i, hit * per_expert + 2 * m * h * 2


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def fastest(row_paths: dict) -> str | None:
    """The fastest path whose output was right (BOUNDS are bounds, not paths)."""
    ok = {p: r["us"] for p, r in row_paths.items()
          if "us" in r and r.get("rel", 0.0) <= WRONG and p not in BOUNDS}
    return min(ok, key=ok.get) if ok else None


def _time_us(fn) -> tuple[float, str]:
    from triton.testing import do_bench

    from benchmarks.kernels.cuda_graph_timing import graph_us

    try:
        return graph_us([fn]), "graph"
    except Exception:  # noqa: BLE001 - a path that cannot be captured is timed eagerly
        torch.cuda.synchronize()
        return do_bench(fn, warmup=5, rep=50, return_mode="median") * 1e3, "eager"


CHOSEN: set[str] | None = None  # --paths: the paths to run (None: all), the bounds always


def kept(paths: dict, chosen: set[str] | None) -> dict:
    """The paths of `chosen` (all of them without a choice) and the bounds."""
    return {n: fn for n, fn in paths.items() if chosen is None or n in chosen or n in BOUNDS}


def _run_paths(paths: dict, ref: torch.Tensor) -> dict:
    out = {}
    for name, fn in kept(paths, CHOSEN).items():
        try:
            rel = rel_error(fn(), ref)
            us, how = _time_us(fn)
            out[name] = {"us": us, "rel": rel, "timed": how}
        except Exception as e:  # noqa: BLE001 - reported per path, the others still run
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        torch.cuda.synchronize()
    return out


def dense_case(qtype: str, name: str, tokens, dtype=torch.float16, gen=None,
               shape=None) -> list[dict]:
    import gguf
    from vllm_gguf_plugin import ops
    from vllm_gguf_plugin.quantization import fused_mul_mat_gguf  # registers the op
    from vllm_gguf_plugin.quantization import dequant_triton
    from vllm_gguf_plugin.quantization.linear import dequantize
    from vllm_gguf_plugin.quantization.utils import MMQ_QUANT_TYPES, MMVQ_QUANT_TYPES
    from vllm_gguf_plugin.triton.gemm.interface import ggml_mul_mat_a8_triton

    n, k = shape or DENSE_SHAPES[name]
    t = int(gguf.GGMLQuantizationType[qtype])
    w = random_blocks(qtype, n, k, gen).cuda()
    w16 = ops.ggml_dequantize(w, t, n, k, dtype)
    w32 = w16.float()
    rows = []
    for m in tokens:
        x = (torch.randn(m, k, device="cuda") * k ** -0.5).to(dtype)  # outputs of order 1
        ref = x.float() @ w32.T
        paths = {"plugin": lambda: fused_mul_mat_gguf(x, w, t)}
        if t in MMVQ_QUANT_TYPES and m <= 16:
            paths["mmvq"] = lambda: ops.ggml_mul_mat_vec_a8(w, x, t, n)
        if t in MMQ_QUANT_TYPES:
            paths["mmq"] = lambda: ops.ggml_mul_mat_a8(w, x, t, n)
        paths["triton"] = lambda: ggml_mul_mat_a8_triton(w, x, t, n)
        paths["dequant"] = lambda: x @ dequantize(w, t, n, k, dtype).T
        if t in dequant_triton.TYPES:
            paths["dequant-cuda"] = lambda: x @ ops.ggml_dequantize(w, t, n, k, dtype).T
        paths["mm16"] = lambda: x @ w16.T
        flop, nbytes = dense_flop_bytes(m, n, k, qtype)
        row = {"op": "dense", "case": name, "type": qtype, "M": m, "N": n, "K": k,
               "flop": flop, "bytes": nbytes, "paths": _run_paths(paths, ref)}
        row["fastest"] = fastest(row["paths"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    del w, w16, w32
    torch.cuda.empty_cache()
    return rows


def _call_with_block_m(wrapper, block_m, x, w, sorted_ids, expert_ids, padded, rows, top_k,
                       tokens):
    """Call a plugin Triton MoE wrapper (ggml_moe_<type>_triton) with another BLOCK_M: the
    wrappers pass their kernel to run_triton_fused_moe_kernel with the default BLOCK_M,
    so run that function with the block size bound for the duration of the call."""
    module = __import__(wrapper.__module__, fromlist=["run_triton_fused_moe_kernel"])
    original = module.run_triton_fused_moe_kernel
    module.run_triton_fused_moe_kernel = functools.partial(original, block_m=block_m)
    try:
        return wrapper(x, w, sorted_ids, expert_ids, padded, rows, top_k, tokens)
    finally:
        module.run_triton_fused_moe_kernel = original


def moe_case(qtype: str, tokens, dtype=torch.float16, gen=None,
             triton_block_m=TRITON_MOE_BLOCK_M, shape=None) -> list[dict]:
    import gguf
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
    from vllm_gguf_plugin import ops
    from vllm_gguf_plugin.quantization import fused_moe_gguf  # registers the op
    from vllm_gguf_plugin.quantization.utils import MMQ_QUANT_TYPES, MMVQ_QUANT_TYPES
    from vllm_gguf_plugin.quantization.moe_expert_groups import moe_by_expert_group
    from vllm_gguf_plugin.quantization.moe_prefill import dequantize_experts
    from vllm_gguf_plugin.triton.fused_moe.interface import TRITON_MOE_DISPATCH

    s = shape or MOE_SHAPE
    e, h, i, top_k = s["experts"], s["hidden"], s["intermediate"], s["top_k"]
    q1, q2 = moe_types(qtype)
    t1, t2 = (int(gguf.GGMLQuantizationType[q]) for q in (q1, q2))
    w13 = random_blocks(q1, e * 2 * i, h, gen).cuda().view(e, 2 * i, -1)
    w2 = random_blocks(q2, e * h, i, gen).cuda().view(e, h, -1)

    def experts16(w, t, rows, cols):
        # a few experts per call: the plugin's op refuses one output of 3 G values (GLM-5's down)
        out = torch.empty(e, rows, cols, device="cuda", dtype=dtype)
        step = max(1, 2**28 // (rows * cols))
        for j in range(0, e, step):
            n = min(step, e - j)
            out[j:j + n] = dequantize_experts(w, t, j, j + n, dtype)
        return out

    def deq():
        return experts16(w13, t1, 2 * i, h), experts16(w2, t2, h, i)

    w13_16, w2_16 = deq()
    silu = MoEActivation.SILU
    marlin = []  # marlin4's experts, made on first use (both products'), then kept
    marlin_q4k = []  # marlin's, the same way
    rows = []
    for m in tokens:
        x = (torch.randn(m, h, device="cuda") * h ** -0.5).to(dtype)
        topk_ids = torch.rand(m, e, device="cuda").topk(top_k, dim=1).indices.to(torch.int32)
        topk_w = torch.rand(m, top_k, device="cuda").softmax(dim=1)
        ref = _moe_reference(x, w13_16, w2_16, topk_w, topk_ids)

        def triton_path(bm):
            def kernel(wrapper):
                return lambda *a: _call_with_block_m(wrapper, bm, *a)

            def run():
                from vllm.model_executor.layers.fused_moe.fused_moe import moe_align_block_size

                sid, eid, pad = moe_align_block_size(topk_ids, bm, e)
                a = moe_by_expert_group(kernel(TRITON_MOE_DISPATCH[t1]), x, w13, sid, eid, pad,
                                        topk_ids, 2 * i, top_k, m)
                a = _silu_and_mul(a)
                b = moe_by_expert_group(kernel(TRITON_MOE_DISPATCH[t2]), a, w2, sid, eid, pad,
                                        topk_ids, h, 1, m * top_k)
                return (b.view(m, top_k, h) * topk_w.view(m, top_k, 1).to(b.dtype)).sum(1)

            return run

        paths = {"plugin": lambda: fused_moe_gguf(x, w13, w2, topk_w, topk_ids, t1, t2, "silu")}
        both = {t1, t2}
        if both <= MMVQ_QUANT_TYPES and m <= VEC_MAX_TOKENS:
            paths["vec"] = lambda: _cuda_moe(ops, "vec", x, w13, w2, topk_w, topk_ids, t1, t2)
        if both <= MMQ_QUANT_TYPES:
            paths["mmq"] = lambda: _cuda_moe(ops, "mmq", x, w13, w2, topk_w, topk_ids, t1, t2)
        if both <= TRITON_MOE_DISPATCH.keys():
            for bm in triton_block_m:
                paths[f"triton-bm{bm}"] = triton_path(bm)
        if q1 == "Q4_K" and t2 in MMVQ_QUANT_TYPES:
            paths["marlin"] = functools.partial(_marlin_moe, marlin_q4k, w13, w2, x, topk_w,
                                                topk_ids, t2)
        paths["dequant"] = lambda: fused_experts(x, *deq(), topk_w, topk_ids, activation=silu)
        paths["fused16"] = lambda: fused_experts(x, w13_16, w2_16, topk_w, topk_ids,
                                                 activation=silu)
        paths["marlin4"] = functools.partial(_marlin4_moe, marlin, w13_16, w2_16, x, topk_w,
                                             topk_ids)
        flop, nbytes = moe_flop_bytes(m, qtype, s)
        row = {"op": "moe", "case": f"moe-{e}x{i}", "type": qtype, "M": m, "flop": flop,
               "bytes": nbytes, "paths": _run_paths(paths, ref)}
        row["fastest"] = fastest(row["paths"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    del w13, w2, w13_16, w2_16
    torch.cuda.empty_cache()
    return rows


def _silu_and_mul(a: torch.Tensor) -> torch.Tensor:
    d = a.shape[-1] // 2
    return (torch.nn.functional.silu(a[..., :d].float()) * a[..., d:].float()).to(a.dtype)


def _moe_reference(x, w13, w2, topk_w, topk_ids) -> torch.Tensor:
    """float32 MoE on the dequantized experts, expert by expert."""
    out = torch.zeros(x.shape[0], w2.shape[1], device=x.device, dtype=torch.float32)
    xf = x.float()
    for ex in topk_ids.unique().tolist():
        tok, slot = (topk_ids == ex).nonzero(as_tuple=True)
        a = _silu_and_mul(xf[tok] @ w13[ex].float().T)
        out.index_add_(0, tok, (a @ w2[ex].float().T) * topk_w[tok, slot, None])
    return out


def int4_groups(w16: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[experts, n, k] weights as GPTQ's symmetric int4 along k: codes q in 0..15 with
    w ~ (q - 8) x s, one scale s per MARLIN_GROUP values (their max |w| / 7), in w16's
    dtype. Returns q [experts, k, n] (uint8) and s [experts, k / MARLIN_GROUP, n]."""
    e, n, k = w16.shape
    q = torch.empty(e, k, n, dtype=torch.uint8, device=w16.device)
    s = torch.empty(e, k // MARLIN_GROUP, n, dtype=w16.dtype, device=w16.device)
    for j in range(e):  # an expert at a time: GLM-5's gate_up is 13 GB in 16 bits
        g = w16[j].float().T.reshape(k // MARLIN_GROUP, MARLIN_GROUP, n)
        s[j] = (g.abs().amax(1) / 7).clamp_min(2.0 ** -24).to(w16.dtype)
        codes = torch.round(g / s[j].float()[:, None, :]) + 8
        q[j] = codes.clamp_(0, 15).to(torch.uint8).view(k, n)
    return q, s


def marlin4_experts(w16: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[experts, n, k] 16-bit experts as int4_groups' codes and scales in the layout of
    vLLM's Marlin MoE kernel (its CUDA repack; a GPU op): (qweight, scales)."""
    from vllm_gguf_plugin.quantization.moe_marlin import marlin_layout

    # an expert at a time: the packing goes through 64-bit integers
    qweight, scales = zip(*(marlin_layout(*int4_groups(w16[j:j + 1]))
                            for j in range(w16.shape[0])))
    return torch.cat(qweight), torch.cat(scales)


def _marlin4_moe(marlin: list, w13_16, w2_16, x, topk_w, topk_ids) -> torch.Tensor:
    """vLLM's Marlin MoE on marlin4_experts of both products (made into `marlin` once)."""
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
    from vllm.scalar_type import scalar_types

    if not marlin:
        marlin += [*marlin4_experts(w13_16), *marlin4_experts(w2_16)]
    q13, s13, q2, s2 = marlin
    return fused_marlin_moe(x, q13, q2, None, None, s13, s2, topk_w, topk_ids,
                            quant_type_id=scalar_types.uint4b8.id,
                            global_num_experts=w13_16.shape[0])


def _marlin_moe(marlin: list, w13, w2, x, topk_w, topk_ids, t2) -> torch.Tensor:
    """The overlay's Marlin MoE as the engine runs it (moe_marlin: the Q4_K experts in
    Marlin's layout plus their b-part, made into `marlin` once; a down product of another
    type on the GGUF kernels, fused_moe.marlin_fused_moe)."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm_gguf_plugin.quantization import fused_moe, moe_marlin

    if not marlin:
        marlin += [moe_marlin.marlin_experts(w13, x.dtype),
                   moe_marlin.marlin_experts(w2, x.dtype) if t2 == moe_marlin.Q4_K else None]
    return fused_moe.marlin_fused_moe(x, marlin, w2, t2, topk_w, topk_ids, MoEActivation.SILU)


def _cuda_moe(ops, kind, x, w13, w2, topk_w, topk_ids, t1, t2) -> torch.Tensor:
    """The plugin's two CUDA MoE paths, forced (its _fused_moe_gguf picks by M)."""
    from vllm.model_executor.layers.fused_moe.fused_moe import moe_align_block_size
    from vllm_gguf_plugin.quantization.moe_expert_groups import moe_by_expert_group

    m, top_k = topk_ids.shape
    e, n2 = w13.shape[0], w13.shape[1]
    h = w2.shape[1]
    if kind == "vec":
        a = ops.ggml_moe_a8_vec(x, w13, topk_ids, top_k, t1, n2, m)
        a = _silu_and_mul(a)
        b = ops.ggml_moe_a8_vec(a, w2, topk_ids, 1, t2, h, m * top_k)
    else:  # (one alignment for both, by gate_up's type, as the plugin aligns them)
        sid, eid, pad = moe_align_block_size(topk_ids, ops.ggml_moe_get_block_size(t1), e)
        a = moe_by_expert_group(ops.ggml_moe_a8, x, w13, sid, eid, pad, topk_ids, t1, n2, top_k,
                                m)
        a = _silu_and_mul(a)
        b = moe_by_expert_group(ops.ggml_moe_a8, a, w2, sid, eid, pad, topk_ids, t2, h, 1,
                                m * top_k)
    return (b.view(m, top_k, h).float() * topk_w.view(m, top_k, 1)).sum(1)


def table(rows: list[dict]) -> list[str]:
    """One line per (op, case, type, M): each path's us (rel error where it is off),
    the fastest, the plugin's choice over the fastest, and TFLOP/s / TB/s of the
    fastest."""
    names = []
    for r in rows:
        names += [p for p in r["paths"] if p not in names]
    lines = ["| op | type | M | " + " | ".join(names) +
             " | fastest | plugin / fastest | fastest TFLOP/s, TB/s |",
             "|---|---|---:|" + "---:|" * len(names) + "---|---:|---|"]
    for r in rows:
        cells = []
        for p in names:
            v = r["paths"].get(p)
            if v is None:
                cells.append("")
            elif "error" in v:
                cells.append("error")
            else:
                mark = f" (rel {v['rel']:.2f}!)" if v["rel"] > WRONG else ""
                cells.append(f"{v['us']:.1f}{mark}")
        best = r["fastest"]
        plugin = r["paths"].get("plugin", {})
        ratio = (f"{plugin['us'] / r['paths'][best]['us']:.2f}"
                 if best and "us" in plugin else "-")
        rate = "-"
        if best:
            us = r["paths"][best]["us"]
            rate = f"{r['flop'] / us / 1e6:.1f}, {r['bytes'] / us / 1e6:.2f}"
        lines.append(f"| {r['op']} {r['case']} | {r['type']} | {r['M']} | " + " | ".join(cells)
                     + f" | {best or '-'} | {ratio} | {rate} |")
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    p.add_argument("--types", nargs="+", default=list(TYPES))
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--ops", nargs="+", choices=["dense", "moe"], default=["dense", "moe"])
    p.add_argument("--dense", nargs="+", choices=list(DENSE_SHAPES), default=list(DENSE_SHAPES))
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    p.add_argument("--triton-block-m", type=int, nargs="+", default=list(TRITON_MOE_BLOCK_M),
                   help="token rows a tile of the plugin's Triton MoE kernel, one path each")
    p.add_argument("--paths", nargs="+", default=None,
                   help="run only these paths (and the bounds) where a case has them")
    args = p.parse_args()
    global CHOSEN
    CHOSEN = set(args.paths) if args.paths else None
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    rows = []

    def save(complete: bool) -> None:
        """The report so far: a run cut short keeps its finished cases (complete false)."""
        if args.json:
            report = {"device": torch.cuda.get_device_name(0), "dtype": args.dtype,
                      "argv": sys.argv[1:], "complete": complete, "rows": rows}
            with open(args.json + ".partial", "w") as f:
                json.dump(report, f, indent=1)
            os.replace(args.json + ".partial", args.json)

    for qtype in args.types:
        if "dense" in args.ops and "/" not in qtype:
            for name in args.dense:
                rows += dense_case(qtype, name, args.tokens, dtype, gen)
                save(False)
        if "moe" in args.ops:
            rows += moe_case(qtype, args.tokens, dtype, gen, tuple(args.triton_block_m))
            save(False)
    lines = table(rows)
    print("\n".join(lines))
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(lines) + "\n")
    save(True)


if __name__ == "__main__":
    main()
