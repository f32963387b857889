# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sparse MLA attention for Hopper: a warp-specialized 64-head tile in Gluon.

The tile `triton_sparse_mla` launches on SM90 for blocks of 64 heads of a 16-bit
or fp8 e4m3 cache, and for fewer heads (masked) where it beats the smaller Triton
tiles: 17-32 heads of a 16-bit cache from 8 tokens on, 33-63 of an fp8 one
(`gluon_sparse_mla_fp8` takes up to 32; `SparseMLATile.GLUON_WARP_SPECIALIZED` in
`sparse_mla_launch`).
It writes the same split-K partial outputs for the same merge. One program per
(64-head block, token, split), three partitions over two shared-memory stages of 64
gathered rows:

- a producer (4 warps, 40 registers) first copies the queries, which arrive on
  their own mbarrier while the first rows are gathered, then copies each tile's
  rows by slot with async copies that arrive on the stage's "full" mbarrier,
  loading the next tile's slot ids while it waits for a free stage. For an fp8
  cache (56 registers) it lands a tile's rows in the upper half of the free
  stage and converts them there to the queries' dtype (`_producer_fp8`);
- two consumers (4 warps, 232 registers each). Consumer C scores rows
  [32 C, 32 C + 32) of the tile for all 64 heads (wgmma, queries and rows in
  shared memory). The consumers exchange their row maxima and their halves of P
  through shared memory (two mbarriers per tile), and each accumulates output
  columns [256 C, 256 C + 256) from both halves. Each releases the stage on its
  "empty" mbarrier once its PV dots are done.

Faster than the Triton tile with a 16-bit and an fp8 cache (docs/results.md#sparse-mla-vs-flashmla). Triton
3.6's own `warp_specialize` loop option does not partition this loop for sm_90, hence
Gluon.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy as cp,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from vllm.triton_utils import triton

TILE_HEADS = 64
TILE_ROWS = 64
NUM_STAGES = 2  # two stages of 64 rows next to the 64-head queries: 225 KiB
KV_LORA_RANK = 512
ROPE_DIM = 64


@gluon.jit
def _copy_queries(Q, t, hb, stride_qt, stride_qh, num_heads, q_smem, qr_smem, q_bar):
    """The producer's first copies: the tile's queries, which arrive on `q_bar` while
    the first rows are gathered (heads past `num_heads` are zero-filled)."""
    BLOCK_H: gl.constexpr = q_smem.type.shape[0]
    D_V: gl.constexpr = q_smem.type.shape[1]
    D_R: gl.constexpr = qr_smem.type.shape[1]
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, ld))
    row = Q + t * stride_qt + offs_h[:, None] * stride_qh
    mask = (offs_h < num_heads)[:, None]
    cp.async_copy_global_to_shared(
        q_smem, row + gl.arange(0, D_V, gl.SliceLayout(0, ld))[None, :], mask=mask)
    cp.async_copy_global_to_shared(
        qr_smem, row + D_V + gl.arange(0, D_R, gl.SliceLayout(0, ld))[None, :], mask=mask)
    cp.mbarrier_arrive(q_bar, increment_count=False)


@gluon.jit
def _producer(Q, KV, Slots, t, hb, stride_qt, stride_qh, num_heads, stride_kv, stride_st,
              start, end, n_iters, q_smem, qr_smem, k_smem, r_smem, q_bar, full_bars,
              empty_bars, BLOCK_N: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr):
    STAGES: gl.constexpr = k_smem.type.shape[0]
    # a warp copies 4 rows x 128 bytes per instruction: whole 128-byte lines, and a thread
    # needs the slots of BLOCK_N / 16 rows only (the same ones for the latent and rope parts)
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    offs_v = gl.arange(0, D_V, gl.SliceLayout(0, ld))
    offs_r = gl.arange(0, D_R, gl.SliceLayout(0, ld))
    offs_b = gl.arange(0, BLOCK_N, gl.SliceLayout(1, ld))
    base = Slots + t * stride_st + start
    count = end - start
    nxt = gl.load(base + offs_b, mask=offs_b < count, other=0)
    _copy_queries(Q, t, hb, stride_qt, stride_qh, num_heads, q_smem, qr_smem, q_bar)
    for it in range(n_iters):
        stage = it % STAGES
        n0 = it * BLOCK_N
        mask_n = (n0 + offs_b) < count
        slot = nxt.to(gl.int64)
        # the next tile's slot ids load while this one waits for its stage
        nxt = gl.load(base + n0 + BLOCK_N + offs_b, mask=(n0 + BLOCK_N + offs_b) < count,
                      other=0)
        # the stage is free once both consumers' PV dots on it are done
        mbarrier.wait(empty_bars.index(stage), ((it // STAGES) & 1) ^ 1)
        row = KV + slot[:, None] * stride_kv
        cp.async_copy_global_to_shared(k_smem.index(stage), row + offs_v[None, :],
                                       mask=mask_n[:, None])
        cp.async_copy_global_to_shared(r_smem.index(stage), row + D_V + offs_r[None, :],
                                       mask=mask_n[:, None])
        # each thread's copies arrive on the stage's barrier when they land
        cp.mbarrier_arrive(full_bars.index(stage), increment_count=False)


# fp8 e4m3 -> bf16, four values per instance: the packed e4m3 -> f16x2 conversion, then
# f16 -> bf16 by moving the exponent field (bf16 bits of the value x 2^-112: every e4m3
# value, subnormals included, is an f16 normal with its low 7 mantissa bits zero, and
# stays a bf16 normal) and one bf16x2 multiply by 2^112. Triton's own cast converts
# f16 -> bf16 one element at a time (`cvt.bf16.f16`), which made bf16 queries slower
# than fp16 ones.
_E4M3_TO_BF16 = gl.constexpr("""{
.reg .b16 a<2>;
.reg .b32 h<2>, m<2>, k, z;
mov.b32 {a0, a1}, $2;
cvt.rn.f16x2.e4m3x2 h0, a0;
cvt.rn.f16x2.e4m3x2 h1, a1;
and.b32 m0, h0, 0x7FFF7FFF;
and.b32 m1, h1, 0x7FFF7FFF;
shr.b32 m0, m0, 3;
shr.b32 m1, m1, 3;
lop3.b32 m0, h0, 0x80008000, m0, 0xEA;
lop3.b32 m1, h1, 0x80008000, m1, 0xEA;
mov.b32 k, 0x77807780;
mov.b32 z, 0x80008000;
fma.rn.bf16x2 $0, m0, k, z;
fma.rn.bf16x2 $1, m1, k, z;
}""")


@gluon.jit
def _e4m3_to(x, dtype: gl.constexpr):
    """fp8 e4m3 values (four contiguous per thread) in `dtype` (fp16 or bf16)."""
    if dtype == gl.bfloat16:
        return gl.inline_asm_elementwise(_E4M3_TO_BF16, "=r,=r,r",
                                         [x.to(gl.uint8, bitcast=True)],
                                         dtype=gl.bfloat16, is_pure=True, pack=4)
    else:
        return x.to(dtype)


@gluon.jit
def _producer_fp8(Q, KV, Slots, t, hb, stride_qt, stride_qh, num_heads, stride_kv,
                  stride_st, start, end, n_iters, q_smem, qr_smem, k_smem, r_smem, q_bar,
                  full_bars, empty_bars, BLOCK_N: gl.constexpr, D_V: gl.constexpr,
                  D_R: gl.constexpr):
    """The producer for an fp8 cache. A free stage's second half receives the tile's fp8
    rows by async copies (the whole tile in flight); they are then converted in place
    to the queries' dtype, one 64-column block at a time. The NVMMA layout stores a
    block of 64 16-bit columns (8 KiB) after the other, so the first four blocks
    land below the fp8 copy, and block j >= 4 overwrites fp8 blocks 2j - 8 and
    2j - 7, which blocks <= j have already read. The per-tensor scale goes on the
    scores and the output."""
    STAGES: gl.constexpr = k_smem.type.shape[0]
    dtype: gl.constexpr = k_smem.dtype
    COLS: gl.constexpr = 64
    # a warp copies 2 rows x 256 bytes of latent and 8 rows x 64 bytes of rope per
    # instruction (16 bytes a thread)
    ld: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [4, 1], [1, 0])
    ld_r: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    cvt: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    # fp8 copies: 64-byte swizzled blocks of 64 columns, 4 KiB each, in the upper half of
    # the stage (and of its rope part)
    sl8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8,
                                             rank=2)
    offs_v = gl.arange(0, D_V, gl.SliceLayout(0, ld))
    offs_r = gl.arange(0, D_R, gl.SliceLayout(0, ld_r))
    offs_b = gl.arange(0, BLOCK_N, gl.SliceLayout(1, ld))
    offs_br = gl.arange(0, BLOCK_N, gl.SliceLayout(1, ld_r))
    base = Slots + t * stride_st + start
    count = end - start
    nxt = gl.load(base + offs_b, mask=offs_b < count, other=0)
    nxt_r = gl.load(base + offs_br, mask=offs_br < count, other=0)
    _copy_queries(Q, t, hb, stride_qt, stride_qh, num_heads, q_smem, qr_smem, q_bar)
    for it in range(n_iters):
        stage = it % STAGES
        n0 = it * BLOCK_N
        mask_n = (n0 + offs_b) < count
        mask_r = (n0 + offs_br) < count
        slot = nxt.to(gl.int64)
        slot_r = nxt_r.to(gl.int64)
        # the next tile's slot ids load while this one's rows are copied and converted
        nxt = gl.load(base + n0 + BLOCK_N + offs_b, mask=(n0 + BLOCK_N + offs_b) < count,
                      other=0)
        nxt_r = gl.load(base + n0 + BLOCK_N + offs_br, mask=(n0 + BLOCK_N + offs_br) < count,
                        other=0)
        mbarrier.wait(empty_bars.index(stage), ((it // STAGES) & 1) ^ 1)
        k_stage = k_smem.index(stage)
        r_stage = r_smem.index(stage)
        k8 = k_stage._reinterpret(KV.dtype.element_ty, [2, BLOCK_N, D_V], sl8).index(1)
        r8 = r_stage._reinterpret(KV.dtype.element_ty, [2, BLOCK_N, D_R], sl8).index(1)
        cp.async_copy_global_to_shared(k8, KV + slot[:, None] * stride_kv + offs_v[None, :],
                                       mask=mask_n[:, None])
        cp.async_copy_global_to_shared(r8, KV + slot_r[:, None] * stride_kv + D_V
                                       + offs_r[None, :], mask=mask_r[:, None])
        cp.commit_group()
        cp.wait_group(0)
        gl.thread_barrier()  # every thread's copies have landed
        for j in gl.static_range(D_V // COLS):
            x = k8.slice(j * COLS, COLS, dim=1).load(cvt)
            if j >= D_V // COLS // 2:
                gl.thread_barrier()  # the fp8 blocks this store overwrites were read
            k_stage.slice(j * COLS, COLS, dim=1).store(_e4m3_to(x, dtype))
        xr = r8.load(cvt)
        gl.thread_barrier()
        r_stage.store(_e4m3_to(xr, dtype))
        # the consumers' wgmma dots read the stage through the async proxy
        fence_async_shared()
        mbarrier.arrive(full_bars.index(stage))


@gluon.jit
def _consumer(q_smem, qr_smem, k_smem, r_smem, p_smem, m_smem, q_bar, full_bars, empty_bars,
              x_bars, O, Lse, t, s, hb, start, end, n_iters, qk_scale, v_scale, num_heads,
              stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
              C: gl.constexpr, BLOCK_N: gl.constexpr, D_V: gl.constexpr,
              PARTIAL: gl.constexpr):
    """Consumer C of two: the scores of rows [C * BLOCK_N / 2, (C + 1) * BLOCK_N / 2) of
    each tile, and output columns [C * D_V / 2, (C + 1) * D_V / 2) from both halves' P."""
    BLOCK_H: gl.constexpr = 64
    HALF_N: gl.constexpr = BLOCK_N // 2
    D_O: gl.constexpr = D_V // 2
    STAGES: gl.constexpr = k_smem.type.shape[0]
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D_O, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_H], gl.float32, row_s)  # over this consumer's rows only
    acc = gl.zeros([BLOCK_H, D_O], gl.float32, o_layout)
    s_zero = gl.zeros([BLOCK_H, HALF_N], gl.float32, s_layout)
    offs_ns = C * HALF_N + gl.arange(0, HALF_N, gl.SliceLayout(0, s_layout))
    mbarrier.wait(q_bar, 0)
    for it in range(n_iters):
        stage = it % STAGES
        phase = it & 1
        mbarrier.wait(full_bars.index(stage), (it // STAGES) & 1)
        k_cur = k_smem.index(stage)
        k_half = k_cur.slice(C * HALF_N, HALF_N, dim=0)
        qk = warpgroup_mma(q_smem, k_half.permute([1, 0]), s_zero, use_acc=False)
        qk = warpgroup_mma(qr_smem, r_smem.index(stage).slice(C * HALF_N, HALF_N, dim=0)
                           .permute([1, 0]), qk)
        mask_n = (start + it * BLOCK_N + offs_ns) < end
        qk = gl.where(mask_n[None, :], qk * qk_scale, float("-inf"))
        # both halves' row maxima: exchanged through shared memory
        m_smem.index(C).store(gl.max(qk, 1))
        mbarrier.arrive(x_bars.index(0))
        mbarrier.wait(x_bars.index(0), phase)
        m_new = gl.maximum(m_i, gl.maximum(m_smem.index(0).load(row_s),
                                           m_smem.index(1).load(row_s)))
        p = gl.exp2(qk - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        # this half's P goes to the other consumer through shared memory; this consumer's
        # PV dot on it (from registers) runs while the other half's P arrives
        p16 = p.to(dtype)
        p_smem.index(C).store(p16)
        fence_async_shared()
        mbarrier.arrive(x_bars.index(1))
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        v = k_cur.slice(C * D_O, D_O, dim=1)
        acc = warpgroup_mma(gl.convert_layout(p16, p_layout), v.slice(C * HALF_N, HALF_N, dim=0),
                            acc, is_async=True)
        mbarrier.wait(x_bars.index(1), phase)
        acc = warpgroup_mma(p_smem.index(1 - C), v.slice((1 - C) * HALF_N, HALF_N, dim=0), acc,
                            is_async=True)
        # Waited here, not after the next tile's QK^T: a dot in flight across the loop's
        # back edge makes ptxas serialize every wgmma of the kernel (C7515: the loop-carried
        # accumulator is copied while the dot runs).
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty_bars.index(stage))

    # the row sums of both halves (the maxima are already shared)
    m_smem.index(C).store(l_i)
    mbarrier.arrive(x_bars.index(0))
    mbarrier.wait(x_bars.index(0), n_iters & 1)
    l_tot = m_smem.index(0).load(row_s) + m_smem.index(1).load(row_s)
    l_safe = gl.where(l_tot > 0.0, l_tot, 1.0)
    out = acc * gl.convert_layout(v_scale / l_safe, row_o)[:, None]
    offs_ho = hb * BLOCK_H + gl.arange(0, BLOCK_H, row_o)
    offs_o = C * D_O + gl.arange(0, D_O, gl.SliceLayout(0, o_layout))
    o_ptr = O + t * stride_ot + s * stride_os + offs_ho[:, None] * stride_oh + offs_o[None, :]
    gl.store(o_ptr, out.to(O.dtype.element_ty), mask=(offs_ho < num_heads)[:, None])
    if PARTIAL and C == 0:
        lse = gl.where(l_tot > 0.0, m_i + gl.log2(l_safe), float("-inf"))
        offs_hl = hb * BLOCK_H + gl.arange(0, BLOCK_H, row_s)
        gl.store(Lse + t * stride_lt + offs_hl * stride_lh + s, lse, mask=offs_hl < num_heads)


# one function for the three partitions, each launched with its ROLE: consumer 0 (the
# default partition), consumer 1, the producer
@gluon.jit
def _partition(q_smem, qr_smem, k_smem, r_smem, p_smem, m_smem, q_bar, full_bars, empty_bars,
               x_bars, Q, O, Lse, KV, Slots, t, s, hb, start, end, n_iters, qk_scale, v_scale,
               num_heads, stride_qt, stride_qh, stride_kv, stride_st, stride_ot, stride_oh,
               stride_os, stride_lt, stride_lh,
               BLOCK_N: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr,
               PARTIAL: gl.constexpr, ROLE: gl.constexpr):
    if ROLE < 2:
        _consumer(q_smem, qr_smem, k_smem, r_smem, p_smem, m_smem, q_bar, full_bars,
                  empty_bars, x_bars, O, Lse, t, s, hb, start, end, n_iters, qk_scale,
                  v_scale, num_heads, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
                  ROLE, BLOCK_N, D_V, PARTIAL)
    elif KV.dtype.element_ty.is_fp8():
        _producer_fp8(Q, KV, Slots, t, hb, stride_qt, stride_qh, num_heads, stride_kv,
                      stride_st, start, end, n_iters, q_smem, qr_smem, k_smem, r_smem, q_bar,
                      full_bars, empty_bars, BLOCK_N, D_V, D_R)
    else:
        _producer(Q, KV, Slots, t, hb, stride_qt, stride_qh, num_heads, stride_kv, stride_st,
                  start, end, n_iters, q_smem, qr_smem, k_smem, r_smem, q_bar, full_bars,
                  empty_bars, BLOCK_N, D_V, D_R)


@gluon.jit
def _sparse_mla_ws_kernel(
    Q, KV, Slots, Counts, KScale, O, Lse, sm_scale,
    stride_qt, stride_qh, stride_kv, stride_st, stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh, num_heads, split_len,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr,
    PARTIAL: gl.constexpr, num_warps: gl.constexpr,
):
    BLOCK_H: gl.constexpr = 64
    dtype: gl.constexpr = Q.dtype.element_ty
    sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    sl_p: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=BLOCK_N, element_bitwidth=16,
                                              rank=2)
    sl_m: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    hb = gl.program_id(0)
    t = gl.program_id(1).to(gl.int64)
    s = gl.program_id(2)

    # the queries are the producer's first copies (`_copy_queries`)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, D_V], sl)
    qr_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, D_R], sl)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_V], sl)
    r_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_R], sl)
    p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_H, BLOCK_N // 2], sl_p)
    m_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], sl_m)
    full_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=128)  # the producer's threads' query copies
    FP8: gl.constexpr = KV.dtype.element_ty.is_fp8()
    for i in gl.static_range(STAGES):
        # the producer's threads' async copies, or its one arrive for an fp8 cache
        mbarrier.init(full_bars.index(i), count=1 if FP8 else 128)
        mbarrier.init(empty_bars.index(i), count=2)  # the two consumers
    for i in gl.static_range(2):
        mbarrier.init(x_bars.index(i), count=2)  # the consumers' exchanges (maxima, P)
    fence_async_shared()

    count = gl.load(Counts + t)
    start = s * split_len
    end = gl.minimum(start + split_len, count)
    n_iters = gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)
    # an fp8 cache's per-tensor scale goes on the scores and the output
    if FP8:
        v_scale = gl.load(KScale)
    else:
        v_scale = gl.to_tensor(1.0)
    qk_scale = sm_scale * 1.4426950408889634 * v_scale
    # registers per thread (of 168 x 384 at launch): the fp8 producer holds and converts
    # rows, the 16-bit one only issues copies
    CONSUMER_REGS: gl.constexpr = 224 if FP8 else 232
    PRODUCER_REGS: gl.constexpr = 56 if FP8 else 40
    # (a tuple built once and passed three times loses the constexprs)
    gl.warp_specialize([
        (_partition, (q_smem, qr_smem, k_smem, r_smem, p_smem, m_smem, q_bar, full_bars,
                      empty_bars, x_bars, Q, O, Lse, KV, Slots, t, s, hb, start, end,
                      n_iters, qk_scale, v_scale, num_heads, stride_qt, stride_qh, stride_kv,
                      stride_st, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
                      BLOCK_N, D_V, D_R, PARTIAL, 0)),
        (_partition, (q_smem, qr_smem, k_smem, r_smem, p_smem, m_smem, q_bar, full_bars,
                      empty_bars, x_bars, Q, O, Lse, KV, Slots, t, s, hb, start, end,
                      n_iters, qk_scale, v_scale, num_heads, stride_qt, stride_qh, stride_kv,
                      stride_st, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
                      BLOCK_N, D_V, D_R, PARTIAL, 1)),
        (_partition, (q_smem, qr_smem, k_smem, r_smem, p_smem, m_smem, q_bar, full_bars,
                      empty_bars, x_bars, Q, O, Lse, KV, Slots, t, s, hb, start, end,
                      n_iters, qk_scale, v_scale, num_heads, stride_qt, stride_qh, stride_kv,
                      stride_st, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
                      BLOCK_N, D_V, D_R, PARTIAL, 2)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def supports(num_heads_per_tile: int, kv_lora_rank: int, rope_dim: int,
             q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """The shapes and dtypes this tile takes (GLM-5 / DeepSeek-V3.2 MLA, 16-bit queries,
    a cache in the queries' dtype or fp8 e4m3)."""
    return (num_heads_per_tile == TILE_HEADS and kv_lora_rank == KV_LORA_RANK
            and rope_dim == ROPE_DIM and q_dtype in (torch.bfloat16, torch.float16)
            and kv_dtype in (q_dtype, torch.float8_e4m3fn))


def sparse_mla_attention_ws(
    q: torch.Tensor,
    kv: torch.Tensor,
    slots: torch.Tensor,
    valid_counts: torch.Tensor,
    k_scale: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    out_strides: tuple,
    lse_strides: tuple,
    scale: float,
    split_len: int,
    splits: int,
) -> None:
    """Launch the tile over q [T, H, 576] (bf16 or fp16) and kv [slots, 576] (q's
    dtype, or fp8 e4m3 with the per-tensor scale `k_scale`, a 1-element fp32
    tensor): into `out` (q's dtype, [T, H, 512]) without splits, else fp32 partial
    rows and their log-sum-exps for `triton_sparse_mla.merge_split_k` (the
    outputs and strides of `triton_sparse_mla.split_k_outputs`)."""
    num_tokens, num_heads, _ = q.shape
    grid = (triton.cdiv(num_heads, TILE_HEADS), num_tokens, splits)
    _sparse_mla_ws_kernel[grid](
        q, kv, slots, valid_counts, k_scale, out, lse, scale,
        q.stride(0), q.stride(1), kv.stride(0), slots.stride(0), *out_strides,
        *lse_strides, num_heads, split_len,
        BLOCK_N=TILE_ROWS, STAGES=NUM_STAGES, D_V=KV_LORA_RANK, D_R=ROPE_DIM,
        PARTIAL=splits > 1,
        num_warps=4, maxnreg=168)
