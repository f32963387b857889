# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sparse MLA attention (DeepSeek-V3.2 / GLM-5 DSA) over each token's top-k KV slots.

Each query token attends to its own top-k KV-cache slots (global slot ids, -1
padding after the valid ones). `sparse_mla_attention` runs the tile that
`sparse_mla_launch` chooses: on Hopper one of two Gluon tiles
(`gluon_sparse_mla`, `gluon_sparse_mla_fp8`), else this module's Triton kernel,
which, unlike a paged decode kernel with a page size of 1,

- reads every selected KV row once for a block of up to 64 local heads: the heads
  are the M dimension of the tensor-core dots (QK^T over 512 + 64, PV over 512);
- gathers the rows by slot directly (no block-table indirection);
- splits a token's top-k over several programs when there are few tokens, and
  merges the partial results by their log-sum-exp in a second small kernel (as
  the Gluon tiles do);
- reads an fp8 cache as is and dequantizes on load (the per-tensor scale is
  applied to the scores and the output, so the dots stay in 16 bits).
"""

import torch

from vllm.triton_utils import tl, triton
from vllm.v1.attention.ops import gluon_sparse_mla, gluon_sparse_mla_fp8
from vllm.v1.attention.ops.sparse_mla_launch import (
    FP8_DTYPES,
    SparseMLALaunch,
    SparseMLATile,
    sparse_mla_device,
    sparse_mla_launch,
)


@triton.jit
def _sparse_mla_kernel(
    Q,
    KV,
    Slots,
    Counts,
    KScale,
    O,
    Lse,
    sm_scale,
    stride_qt,
    stride_qh,
    stride_kv,
    stride_st,
    stride_ot,
    stride_oh,
    stride_os,
    stride_lt,
    stride_lh,
    num_heads,
    split_len,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_V: tl.constexpr,
    D_R: tl.constexpr,
    KV_FP8: tl.constexpr,
    PARTIAL: tl.constexpr,
    V_RELOAD: tl.constexpr,
):
    # heads fastest: the programs of one token run together and share its rows in L2
    hb = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    s = tl.program_id(2)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_v = tl.arange(0, D_V)
    offs_r = tl.arange(0, D_R)
    q_row = Q + t * stride_qt + offs_h[:, None] * stride_qh
    q_nope = tl.load(q_row + offs_v[None, :], mask=mask_h[:, None], other=0.0)
    q_rope = tl.load(q_row + D_V + offs_r[None, :], mask=mask_h[:, None], other=0.0)

    count = tl.load(Counts + t)
    start = s * split_len
    end = tl.minimum(start + split_len, count)
    qk_scale = sm_scale * 1.4426950408889634  # log2(e): softmax in base 2
    if KV_FP8:
        k_scale = tl.load(KScale)
        qk_scale = qk_scale * k_scale

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D_V], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slot = tl.load(Slots + t * stride_st + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_row = KV + slot[:, None] * stride_kv
        k_nope = tl.load(kv_row + offs_v[None, :], mask=mask_n[:, None], other=0.0)
        k_rope = tl.load(kv_row + D_V + offs_r[None, :], mask=mask_n[:, None], other=0.0)
        if KV_FP8:
            k_nope = k_nope.to(q_nope.dtype)
            k_rope = k_rope.to(q_nope.dtype)
        qk = tl.dot(q_nope, tl.trans(k_nope))
        qk = tl.dot(q_rope, tl.trans(k_rope), qk)
        qk = tl.where(mask_n[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_RELOAD:
            # the rows again, a copy of its own for the PV dot (from L2; the cache
            # modifier keeps it from merging with the first): with one consumer per
            # copy the software pipeliner stages an fp8 tile, which it leaves as a
            # synchronous load when both dots take it through a conversion
            v = tl.load(kv_row + offs_v[None, :], mask=mask_n[:, None], other=0.0,
                        cache_modifier=".cg")
            if KV_FP8:
                # dequantized here, in fp32: a bare cast would be moved past the
                # tile's layout change for the dot, which then gathers single
                # bytes from shared memory
                v = (v.to(tl.float32) * k_scale).to(q_nope.dtype)
        else:
            v = k_nope
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if KV_FP8 and not V_RELOAD:
        out = out * k_scale  # V is the converted K tile, still unscaled
    o_ptr = O + t * stride_ot + s * stride_os + offs_h[:, None] * stride_oh + offs_v[None, :]
    tl.store(o_ptr, out.to(O.dtype.element_ty), mask=mask_h[:, None])
    if PARTIAL:
        # base-2 log-sum-exp of the split; -inf for a split without valid slots
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(Lse + t * stride_lt + offs_h * stride_lh + s, lse, mask=mask_h)


@triton.jit
def _sparse_mla_merge_kernel(
    Part,
    Lse,
    O,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    D_V: tl.constexpr,
):
    h = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_v = tl.arange(0, D_V)
    lse = tl.load(Lse + t * stride_lt + h * stride_lh + offs_s)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no valid slot at all: zeros below
    w = tl.exp2(lse - m)
    part = tl.load(Part + t * stride_pt + h * stride_ph + offs_s[:, None] * stride_ps
                   + offs_v[None, :])
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(O + t * stride_ot + h * stride_oh + offs_v, out.to(O.dtype.element_ty))


def split_k_outputs(o: torch.Tensor, topk: int, splits: int, block_n: int):
    """Where the attention kernel writes for `splits` splits of a token's top-k:
    the slots per split (whole key blocks), the output (`o` itself, or fp32
    partial rows [T, H, splits, D]), their log-sum-exps [T, H, splits] (unused
    without splits) and the strides of both as the kernel takes them."""
    split_len = triton.cdiv(triton.cdiv(topk, splits), block_n) * block_n
    if splits == 1:
        return split_len, o, o, (o.stride(0), o.stride(1), 0), (0, 0)
    num_tokens, num_heads, d_v = o.shape
    out = torch.empty(num_tokens, num_heads, splits, d_v, dtype=torch.float32,
                      device=o.device)
    lse = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=o.device)
    return (split_len, out, lse, (out.stride(0), out.stride(1), out.stride(2)),
            (lse.stride(0), lse.stride(1)))


def merge_split_k(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor) -> None:
    """Merge the partial rows of `split_k_outputs` into `o` by their log-sum-exps
    (nothing to do without splits: the kernel wrote `o`)."""
    if out is o:
        return
    num_tokens, num_heads, d_v = o.shape
    _sparse_mla_merge_kernel[(num_heads, num_tokens)](
        out, lse, o,
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), o.stride(0), o.stride(1),
        NUM_SPLITS=out.shape[2], D_V=d_v, num_warps=4,
    )


def sparse_mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    valid_counts: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    k_scale: torch.Tensor,
    launch: SparseMLALaunch | None = None,
) -> torch.Tensor:
    """Sparse MLA over global KV slots.

    q: [T, H, kv_lora_rank + rope] (fp16/bf16); kv_cache: [NB, BS, kv_lora_rank +
    rope] (fp16/bf16, or fp8 with the per-tensor scale `k_scale`, a 1-element
    tensor); slots: int32 [T, K], the valid slots of a token first; valid_counts:
    int32 [T]. Returns o: [T, H, kv_lora_rank] in q's dtype; a token without valid
    slots gets zeros. `launch` overrides `sparse_mla_launch` on q's device
    (benchmarks, tests).
    """
    num_tokens, num_heads, head_dim = q.shape
    topk = slots.shape[1]
    o = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return o
    kv = kv_cache.view(-1, kv_cache.shape[-1])
    assert kv.stride(-1) == 1 and q.stride(-1) == 1 and slots.stride(-1) == 1
    if kv.dtype == torch.uint8:  # vLLM stores an fp8 cache as uint8
        kv = kv.view(torch.float8_e4m3fn)
    if launch is None:
        launch = sparse_mla_launch(sparse_mla_device(q.device), num_tokens, num_heads,
                                   head_dim, kv_lora_rank, topk, q.dtype, kv.dtype)
    splits = launch.splits
    split_len, out, lse, so, sl = split_k_outputs(o, topk, splits, launch.block_n)
    args = (q, kv, slots, valid_counts, k_scale, out, lse, so, sl, scale, split_len, splits)
    if launch.tile is SparseMLATile.GLUON_WARP_SPECIALIZED:
        gluon_sparse_mla.sparse_mla_attention_ws(*args)
    elif launch.tile is SparseMLATile.GLUON_FP8_ROWS:
        gluon_sparse_mla_fp8.sparse_mla_attention_fp8(*args, block_h=launch.block_h)
    else:
        grid = (triton.cdiv(num_heads, launch.block_h), num_tokens, splits)
        _sparse_mla_kernel[grid](
            q, kv, slots, valid_counts, k_scale, out, lse, scale,
            q.stride(0), q.stride(1), kv.stride(0), slots.stride(0),
            *so, *sl,
            num_heads, split_len,
            BLOCK_H=launch.block_h, BLOCK_N=launch.block_n, D_V=kv_lora_rank,
            D_R=head_dim - kv_lora_rank, KV_FP8=kv.dtype in FP8_DTYPES, PARTIAL=splits > 1,
            V_RELOAD=launch.tile is SparseMLATile.TRITON_V_RELOAD,
            num_warps=launch.num_warps, num_stages=launch.num_stages,
        )
    merge_split_k(out, lse, o)
    return o
