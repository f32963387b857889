# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sparse MLA attention over an fp8 cache for 8 or 16 heads a program, in Gluon.

`triton_sparse_mla` launches this tile on Hopper for an fp8 e4m3 cache with few
local heads (`launch_config(...)["ROWS_IN_M"]`: GLM-5 or DeepSeek-V3.2 at tensor
parallel 4 and up). It writes the same split-K partial outputs for the same merge.

The 64-head tiles pad 8 heads to 64 and convert every fp8 row to 16 bits in shared
memory. Here the gathered rows are the M dimension of mma.sync dots and the heads
are N, so no work is padded and the rows go from shared memory to registers once
per dot, where they are converted:

- one program per (8 or 16 heads, token, split), 4 warps; the split's slot ids are
  copied to shared memory first, then each tile of 64 rows by slot with async
  copies into one of two buffers while the other is computed;
- the warps split a tile's rows into groups: 4 groups of 16 rows at 8 heads; at 16
  heads 2 groups of 32 rows (two independent row blocks a warp), each read by two
  warps of 8 heads. A warp keeps its own running maximum, sum and output [512, 8]
  (128 registers a thread): S^T = K Q^T (queries from shared memory), its softmax,
  then O^T += V^T P^T, with P^T moved within the warp by shuffles. The only barrier
  in the loop is the one for the copies; the row groups' results are merged by
  their maxima at the end;
- V^T is read as 16-byte rows and relabelled in registers: output column m of the
  dot is latent column 128 c + 16 g + 2 i + b for m = 128 c + 16 i + 8 b + g
  (`_latent_column`), the order in which each thread's mma operand is 16
  contiguous bytes of a row;
- the dots are in fp16: e4m3 converts to fp16 with one instruction per two values
  (to bf16, four more per pair), and each head's query is scaled by a power of two
  that brings its largest magnitude to [2^13, 2^14), exact for a bf16 query down to
  2^-24 of that magnitude; the score scale takes the inverse.

H200, top-k 2048, at 256-4096 tokens: 8 heads 0.59-0.61x the time of the 16-bit
cache's tile (2.8-3.2 TB/s of fp8 rows), 0.40-0.43x the Triton fp8 tile's; 16 heads
0.89-0.91x the 16-bit cache's (two 8-head programs: 1.17-1.22x)
(benchmarks/results/h200-sparse-mla-gather.json). mma.sync and async copies exist
from SM80 on; only Hopper's launch table selects it (measured there).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from vllm.triton_utils import triton

TILE_HEADS = (8, 16)  # heads a program: 8 per warp
TILE_ROWS = 64
NUM_WARPS = 4  # 4 groups of 16 rows (8 heads), or 2 groups of 32 rows, 2 warps each (16)
MAX_SLOTS = 2048  # slot ids of a split in shared memory (8 KiB)
KV_LORA_RANK = 512
ROPE_DIM = 64


@gluon.jit
def _copy_rows(KV, slots_smem, n0, count, stride_kv, k_buf, r_buf,
               BLOCK_N: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr):
    """Async copies of the split's rows [n0, n0 + BLOCK_N) into a buffer (rows past
    `count` are zero-filled)."""
    # a warp copies 2 rows x 256 bytes of latent and 8 rows x 64 bytes of rope per
    # instruction (16 bytes a thread)
    ld: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [4, 1], [1, 0])
    ld_r: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    mask = (n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(1, ld))) < count
    mask_r = (n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(1, ld_r))) < count
    # the last iteration's copies (past the split's end) are masked: any tile's ids do
    ids = slots_smem.index(gl.minimum(n0 // BLOCK_N, slots_smem.type.shape[0] - 1))
    slot = ids.load(gl.SliceLayout(1, ld)).to(gl.int64)
    slot_r = ids.load(gl.SliceLayout(1, ld_r)).to(gl.int64)
    cp.async_copy_global_to_shared(
        k_buf, KV + slot[:, None] * stride_kv + gl.arange(0, D_V, gl.SliceLayout(0, ld))[None, :],
        mask=mask[:, None])
    cp.async_copy_global_to_shared(
        r_buf, KV + slot_r[:, None] * stride_kv + D_V
        + gl.arange(0, D_R, gl.SliceLayout(0, ld_r))[None, :], mask=mask_r[:, None])


@gluon.jit
def _latent_column(m):
    """The latent column of output column m (see the module docstring)."""
    return (m >> 7) * 128 + (m & 7) * 16 + ((m >> 4) & 7) * 2 + ((m >> 3) & 1)


@gluon.jit
def _pv(k3, c: gl.constexpr, p, alpha, acc, dtype: gl.constexpr, HEAD_WARPS: gl.constexpr):
    """acc [W, 128, H] * alpha + V^T P^T over output columns [128 c, 128 c + 128):
    V^T from each row group's rows k3 [W, R, 512] (fp8), P^T [W, R, H]."""
    W: gl.constexpr = k3.type.shape[0]
    R: gl.constexpr = k3.type.shape[1]
    v_op: gl.constexpr = gl.DotOperandLayout(0, acc.type.layout, 2)
    # a thread loads 16 contiguous bytes of a row (bits 0-3 of the column in registers,
    # 4-6 in lanes: 8 lanes read a 128-byte row) for 4 of every 16 rows (row bits 1-2
    # in lanes, 0 and 3 in registers); the warps of a row group (the low warp bits, as
    # in the mma layout) load the same rows
    if HEAD_WARPS == 1:  # 4 groups of 16 rows
        v_ld: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 8, 0]],
            lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 16], [0, 0, 32], [0, 0, 64]],
            warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[W, R, 128])
    else:  # 2 groups of 32 rows (row bit 4 in registers), two warps each
        v_ld: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 8, 0],
                       [0, 16, 0]],
            lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 16], [0, 0, 32], [0, 0, 64]],
            warp_bases=[[0, 0, 0], [1, 0, 0]], block_bases=[], shape=[W, R, 128])
    x = k3.slice(c * 128, 128, dim=2).load(v_ld).to(dtype)
    # latent column 16 g + 2 i + b (of the 128) -> output column 16 i + 8 b + g: the
    # mma operand's layout, up to the order of each thread's registers
    x = gl.reshape(gl.permute(gl.reshape(x, [W, R, 8, 8, 2]), [0, 1, 3, 4, 2]), [W, R, 128])
    v = gl.convert_layout(gl.permute(x, [0, 2, 1]), v_op)
    return mma_v2(v, p, acc * alpha[:, None, :])


@gluon.jit
def _tile(KV, slots_smem, count, stride_kv, it, k_cur, r_cur, k_nxt, r_nxt, q_smem, qr_smem,
          h_scale, offs_n, m_i, l_i, acc0, acc1, acc2, acc3, HEAD_WARPS: gl.constexpr):
    """Tile `it` from one buffer, while tile it + 1 is copied into the other (separate
    allocations: no barrier between those copies and these reads)."""
    W: gl.constexpr = acc0.type.shape[0]
    BLOCK_H: gl.constexpr = acc0.type.shape[2]
    BLOCK_N: gl.constexpr = k_cur.type.shape[0]
    D_V: gl.constexpr = k_cur.type.shape[1]
    D_R: gl.constexpr = r_cur.type.shape[1]
    R: gl.constexpr = BLOCK_N // W
    dtype: gl.constexpr = q_smem.dtype
    mma: gl.constexpr = acc0.type.layout
    # 8 contiguous values of the reduced dimension a thread (both operands): 8-byte loads
    # of the fp8 rows, 16-byte ones of the queries
    k_op: gl.constexpr = gl.DotOperandLayout(0, mma, 8)
    q_op: gl.constexpr = gl.DotOperandLayout(1, mma, 8)
    q_sl: gl.constexpr = gl.SliceLayout(0, q_op)
    p_op: gl.constexpr = gl.DotOperandLayout(1, mma, 2)
    # this thread's copies of tile `it` have landed; after the barrier, everyone's, and
    # every warp is done with tile it - 1, whose buffer the next copies overwrite
    cp.wait_group(0)
    gl.thread_barrier()
    _copy_rows(KV, slots_smem, (it + 1) * BLOCK_N, count, stride_kv, k_nxt, r_nxt,
               BLOCK_N, D_V, D_R)
    cp.commit_group()

    k3 = k_cur.reshape([W, R, D_V])
    r3 = r_cur.reshape([W, R, D_R])
    q_zero = gl.zeros([W, 64, BLOCK_H], dtype, q_op)
    # three accumulators (two for 32 rows a warp, which has two independent row blocks):
    # shorter chains of dependent mma.sync
    ACCS: gl.constexpr = 3 if R == 16 else 2
    qk0 = gl.zeros([W, R, BLOCK_H], gl.float32, mma)
    qk1 = gl.zeros([W, R, BLOCK_H], gl.float32, mma)
    qk2 = gl.zeros([W, R, BLOCK_H], gl.float32, mma)
    for j in gl.static_range(D_V // 64):
        kk = k3.slice(j * 64, 64, dim=2).load(k_op).to(dtype)
        # every warp's copy of the same queries
        qq = gl.broadcast(gl.expand_dims(
            q_smem.slice(j * 64, 64, dim=1).permute([1, 0]).load(q_sl), 0), q_zero)[0]
        if j % ACCS == 0:
            qk0 = mma_v2(kk, qq, qk0)
        elif j % ACCS == 1:
            qk1 = mma_v2(kk, qq, qk1)
        else:
            qk2 = mma_v2(kk, qq, qk2)
    kk = r3.load(k_op).to(dtype)
    qq = gl.broadcast(gl.expand_dims(qr_smem.permute([1, 0]).load(q_sl), 0), q_zero)[0]
    qk = mma_v2(kk, qq, qk2) + qk0 + qk1
    mask_n = (it * BLOCK_N + offs_n) < count
    qk = gl.where(mask_n[:, :, None], qk * h_scale, float("-inf"))
    # each warp's own running maximum and sum (a warp's rows may all be masked)
    m_new = gl.maximum(m_i, gl.max(qk, 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(qk - m_use[:, None, :])
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, 1)
    p = gl.convert_layout(p.to(dtype), p_op)
    acc0 = _pv(k3, 0, p, alpha, acc0, dtype, HEAD_WARPS)
    acc1 = _pv(k3, 1, p, alpha, acc1, dtype, HEAD_WARPS)
    acc2 = _pv(k3, 2, p, alpha, acc2, dtype, HEAD_WARPS)
    acc3 = _pv(k3, 3, p, alpha, acc3, dtype, HEAD_WARPS)
    return m_new, l_i, acc0, acc1, acc2, acc3


@gluon.jit
def _store(acc, c: gl.constexpr, wgt, inv_l, O, o_base, offs_h, stride_oh, num_heads):
    """Output columns [128 c, 128 c + 128): the warps' sums, weighted by `wgt`."""
    out = gl.sum(acc * wgt[:, None, :], axis=0) * inv_l[None, :]
    m = c * 128 + gl.arange(0, 128, gl.SliceLayout(1, out.type.layout))
    o_ptr = O + o_base + offs_h[None, :] * stride_oh + _latent_column(m)[:, None]
    gl.store(o_ptr, out.to(O.dtype.element_ty), mask=(offs_h < num_heads)[None, :])


@gluon.jit
def _sparse_mla_fp8_kernel(
    Q, KV, Slots, Counts, KScale, O, Lse, sm_scale,
    stride_qt, stride_qh, stride_kv, stride_st, stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh, num_heads, split_len,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr,
    MAX_SLOTS: gl.constexpr, PARTIAL: gl.constexpr, num_warps: gl.constexpr,
):
    # the warps: W row groups of R rows, each group's HEAD_WARPS warps 8 heads each
    gl.static_assert((BLOCK_H == 8 or BLOCK_H == 16) and num_warps == 4 and BLOCK_N == 64)
    HEAD_WARPS: gl.constexpr = BLOCK_H // 8
    W: gl.constexpr = num_warps // HEAD_WARPS
    R: gl.constexpr = BLOCK_N // W
    dtype: gl.constexpr = gl.float16
    kv_ty: gl.constexpr = KV.dtype.element_ty
    hb = gl.program_id(0)
    t = gl.program_id(1).to(gl.int64)
    s = gl.program_id(2)
    # [row group, row or output column, head]: each warp's own rows, heads and outputs
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[W, 1, HEAD_WARPS], instr_shape=[1, 16, 8])
    wh: gl.constexpr = gl.SliceLayout(1, mma)  # [row group, head]
    sl_k: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 8, [1, 0])
    sl_r: gl.constexpr = gl.SwizzledSharedLayout(16, 2, 4, [1, 0])
    sl_q: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
    sl_s: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    k_a = gl.allocate_shared_memory(kv_ty, [BLOCK_N, D_V], sl_k)
    r_a = gl.allocate_shared_memory(kv_ty, [BLOCK_N, D_R], sl_r)
    k_b = gl.allocate_shared_memory(kv_ty, [BLOCK_N, D_V], sl_k)
    r_b = gl.allocate_shared_memory(kv_ty, [BLOCK_N, D_R], sl_r)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, D_V], sl_q)
    qr_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, D_R], sl_q)
    slots_smem = gl.allocate_shared_memory(gl.int32, [MAX_SLOTS // BLOCK_N, BLOCK_N], sl_s)

    count = gl.load(Counts + t)
    start = s * split_len
    end = gl.minimum(start + split_len, count)
    n_iters = gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)
    count = end - start  # valid slots of this split (split_len <= MAX_SLOTS)
    # the split's slot ids, then the first tile: a tile's copies wait for no global load
    offs_s = gl.arange(0, MAX_SLOTS, gl.BlockedLayout([4], [32], [num_warps], [0]))
    cp.async_copy_global_to_shared(slots_smem._reinterpret(gl.int32, [MAX_SLOTS], sl_s),
                                   Slots + t * stride_st + start + offs_s, mask=offs_s < count)
    cp.commit_group()

    # the queries in fp16, each head scaled by 2^(13 - e), e the exponent of its largest
    # magnitude (the biased exponent clamped: a head of zeros keeps a finite scale)
    ldq: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    offs_hq = hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, ldq))
    q_row = Q + t * stride_qt + offs_hq[:, None] * stride_qh
    mask_hq = (offs_hq < num_heads)[:, None]
    q = gl.load(q_row + gl.arange(0, D_V, gl.SliceLayout(0, ldq))[None, :], mask=mask_hq,
                other=0.0).to(gl.float32)
    qr = gl.load(q_row + D_V + gl.arange(0, D_R, gl.SliceLayout(0, ldq))[None, :],
                 mask=mask_hq, other=0.0).to(gl.float32)
    amax = gl.maximum(gl.max(gl.abs(q), 1), gl.max(gl.abs(qr), 1))
    e = (amax.to(gl.int32, bitcast=True) >> 23) & 255
    q_mul = (gl.minimum(gl.maximum(267 - e, 1), 254) << 23).to(gl.float32, bitcast=True)
    q_smem.store((q * q_mul[:, None]).to(dtype))
    qr_smem.store((qr * q_mul[:, None]).to(dtype))
    # the per-tensor fp8 scale on the scores and the output; base-2 softmax
    v_scale = gl.load(KScale)
    h_scale = sm_scale * 1.4426950408889634 * v_scale / q_mul
    h_scale = gl.convert_layout(h_scale, gl.SliceLayout(0, wh))[None, None, :]

    cp.wait_group(0)
    gl.thread_barrier()  # the slot ids (and the queries) are in shared memory
    _copy_rows(KV, slots_smem, 0, count, stride_kv, k_a, r_a, BLOCK_N, D_V, D_R)
    cp.commit_group()

    m_i = gl.full([W, BLOCK_H], float("-inf"), gl.float32, wh)
    l_i = gl.zeros([W, BLOCK_H], gl.float32, wh)
    acc0 = gl.zeros([W, 128, BLOCK_H], gl.float32, mma)
    acc1 = gl.zeros([W, 128, BLOCK_H], gl.float32, mma)
    acc2 = gl.zeros([W, 128, BLOCK_H], gl.float32, mma)
    acc3 = gl.zeros([W, 128, BLOCK_H], gl.float32, mma)
    wr: gl.constexpr = gl.SliceLayout(2, mma)
    offs_n = (gl.arange(0, W, gl.SliceLayout(1, wr))[:, None] * R
              + gl.arange(0, R, gl.SliceLayout(0, wr))[None, :])
    for it in range(0, n_iters, 2):
        m_i, l_i, acc0, acc1, acc2, acc3 = _tile(
            KV, slots_smem, count, stride_kv, it, k_a, r_a, k_b, r_b, q_smem, qr_smem, h_scale,
            offs_n, m_i, l_i, acc0, acc1, acc2, acc3, HEAD_WARPS)
        if it + 1 < n_iters:
            m_i, l_i, acc0, acc1, acc2, acc3 = _tile(
                KV, slots_smem, count, stride_kv, it + 1, k_b, r_b, k_a, r_a, q_smem, qr_smem,
                h_scale, offs_n, m_i, l_i, acc0, acc1, acc2, acc3, HEAD_WARPS)
    cp.wait_group(0)

    # the row groups' results, merged by their maxima
    m_tot = gl.max(m_i, 0)
    wgt = gl.exp2(m_i - gl.where(m_tot == float("-inf"), 0.0, m_tot)[None, :])
    l_tot = gl.sum(l_i * wgt, 0)
    l_safe = gl.where(l_tot > 0.0, l_tot, 1.0)
    head_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, mma))
    inv_l = gl.convert_layout(v_scale / l_safe, head_l)
    offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, head_l)
    o_base = t * stride_ot + s * stride_os
    _store(acc0, 0, wgt, inv_l, O, o_base, offs_h, stride_oh, num_heads)
    _store(acc1, 1, wgt, inv_l, O, o_base, offs_h, stride_oh, num_heads)
    _store(acc2, 2, wgt, inv_l, O, o_base, offs_h, stride_oh, num_heads)
    _store(acc3, 3, wgt, inv_l, O, o_base, offs_h, stride_oh, num_heads)
    if PARTIAL:
        # base-2 log-sum-exp of the split; -inf without valid slots
        lse = gl.where(l_tot > 0.0, m_tot + gl.log2(l_safe), float("-inf"))
        offs_hl = hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(0, wh))
        gl.store(Lse + t * stride_lt + offs_hl * stride_lh + s, lse, mask=offs_hl < num_heads)


def supports(kv_lora_rank: int, rope_dim: int, q_dtype: torch.dtype,
             kv_dtype: torch.dtype) -> bool:
    """The shapes and dtypes this tile takes (GLM-5 / DeepSeek-V3.2 MLA, 16-bit queries,
    an fp8 e4m3 cache)."""
    return (kv_lora_rank == KV_LORA_RANK and rope_dim == ROPE_DIM
            and q_dtype in (torch.bfloat16, torch.float16) and kv_dtype == torch.float8_e4m3fn)


def sparse_mla_attention_fp8(
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
    block_h: int = 8,
) -> None:
    """Launch the tile over q [T, H, 576] (bf16 or fp16) and kv [slots, 576] (fp8 e4m3
    with the per-tensor scale `k_scale`, a 1-element fp32 tensor): into `out` (q's
    dtype, [T, H, 512]) without splits, else fp32 partial rows and their log-sum-exps
    for `triton_sparse_mla.merge_split_k` (the outputs and strides of
    `triton_sparse_mla.split_k_outputs`). A split takes at most MAX_SLOTS slots."""
    if split_len > MAX_SLOTS:
        raise ValueError(f"sparse MLA fp8 tile: {split_len} slots per split, more than "
                         f"its {MAX_SLOTS}; split the top-k further")
    if block_h not in TILE_HEADS:
        raise ValueError(f"sparse MLA fp8 tile: {block_h} heads a program, not one of "
                         f"{TILE_HEADS}")
    num_tokens, num_heads, _ = q.shape
    grid = (triton.cdiv(num_heads, block_h), num_tokens, splits)
    _sparse_mla_fp8_kernel[grid](
        q, kv, slots, valid_counts, k_scale, out, lse, scale,
        q.stride(0), q.stride(1), kv.stride(0), slots.stride(0), *out_strides,
        *lse_strides, num_heads, split_len,
        BLOCK_H=block_h, BLOCK_N=TILE_ROWS, D_V=KV_LORA_RANK, D_R=ROPE_DIM,
        MAX_SLOTS=MAX_SLOTS, PARTIAL=splits > 1, num_warps=NUM_WARPS)

