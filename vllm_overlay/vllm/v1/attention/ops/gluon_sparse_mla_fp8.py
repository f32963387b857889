# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sparse MLA attention over an fp8 cache for 8 or 16 heads a program, in Gluon.

`triton_sparse_mla` launches this tile on Hopper for an fp8 e4m3 cache with up to
32 local heads (`SparseMLATile.GLUON_FP8_ROWS` in `sparse_mla_launch`: GLM-5 at
tensor parallel 2 and up, DeepSeek-V3.2 at 4 and up; 17-32 heads as two programs of
16). It writes the same split-K partial outputs for the same merge.

The 64-head tiles pad 8 heads to 64 and convert every fp8 row to 16 bits in shared
memory. Here mma.sync dots take the fp8 rows from shared memory to registers, where
they are converted, and no work is padded. Each of a tile's fp8 values is converted
once per dot that reads it, whatever the number of heads:

- one program per (8 or 16 heads, token, split), 4 warps; the split's slot ids are
  copied to shared memory first, then each tile of 64 rows by slot with async
  copies into one of two buffers while the other is computed;
- scores: warp w takes the tile's rows [16 w, 16 w + 16) for every head, S^T = K Q^T
  (rows in M, heads in N; the rope queries stay in registers for the whole loop).
  The dot's index is relabelled within each block of 64 latent columns
  (`_relabel_k`): the 8 contiguous fp8 bytes a thread loads from a row are the
  columns its fp16 operand holds, and the queries are stored in shared memory in
  that order, so ldmatrix loads them straight into the registers the dots read.
  The warps' maxima meet in shared memory, so every warp keeps the same running
  maximum; each writes its rows of P (fp16) to shared memory;
- output: warp w takes the output columns [128 w, 128 w + 128) for every head over
  all 64 rows, O^T += V^T P^T, with its own accumulator [128, heads]. V^T is read as
  16-byte rows and relabelled in registers: output column m of the dot is latent
  column 128 c + 16 g + 2 i + b for m = 128 c + 16 i + 8 b + g, the order in which
  each thread's mma operand is 16 contiguous bytes of a row. The operand pairs two
  rows' values of a column: one byte permute per four values puts them side by side
  before the packed conversion (`_E4M3_ROW_PAIRS`);
- the output goes through shared memory (the rows' buffers, free by then) back to
  [heads, latent columns] for 16-byte stores: from the accumulator's layout each
  store would write 2 bytes a 32-byte sector;
- three barriers a tile: the copies, the maxima, P;
- shared layouts without bank conflicts for the dots' loads: the rows' 16-byte units
  XORed by row bits (the two dots read a 128-byte line as 4 rows x 32 bytes and as
  rows 0/2/4/6 x 32 bytes), the queries' 64-byte halves by head bit 0, P's 16-byte
  halves by row bit 2 (plain swizzles left conflicts);
- the dots are in fp16: e4m3 converts to fp16 with one instruction per two values
  (to bf16, four more per pair), and each head's query is scaled by a power of two
  that brings its largest magnitude to [2^13, 2^14), exact for a bf16 query down to
  2^-24 of that magnitude; the score scale takes the inverse.

Measured on Hopper (docs/results.md#sparse-mla-vs-flashmla); mma.sync and async copies exist from SM80 on,
but only Hopper's launch table selects it.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from vllm.triton_utils import triton

TILE_HEADS = (8, 16)  # heads a program
TILE_ROWS = 64
NUM_WARPS = 4  # a warp: 16 rows of the scores, 128 output columns
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
def _relabel_k(x):
    """x [A, B, 64] with its last dimension relabelled for the score dot: latent column
    p of the block is dot index k', whose bits are p's bits (0, 3, 4, 1, 2, 5). A
    thread's fp16 operand (kWidth 2) holds k' = 2 t + {0, 1} + 8 {0, 1} + 16 {0, .., 3}
    of its rows, t = lane % 4: these are the columns [8 t, 8 t + 8) and [32 + 8 t,
    40 + 8 t), 8 contiguous bytes of fp8 twice. Applied to the fp8 rows as loaded and
    to the queries as stored, it leaves the dot unchanged."""
    A: gl.constexpr = x.type.shape[0]
    B: gl.constexpr = x.type.shape[1]
    x = gl.reshape(x, [A, B, 2, 2, 2, 2, 2, 2])  # the bits of p, 5 first
    return gl.reshape(gl.permute(x, [0, 1, 2, 5, 6, 3, 4, 7]), [A, B, 64])


# Two rows' fp8 values ($4: row 2 r, $5: row 2 r + 1, four columns each) to fp16 pairs
# of one column's two values ($0..$3 for the columns in order): a byte permute pairs
# the rows before each two packed conversions. The PV dot's operand holds such pairs;
# converting each row first and pairing the halves after takes a permute per two values.
_E4M3_ROW_PAIRS = gl.constexpr("""{
.reg .b32 t<2>;
.reg .b16 h<4>;
prmt.b32 t0, $4, $5, 0x5140;
prmt.b32 t1, $4, $5, 0x7362;
mov.b32 {h0, h1}, t0;
mov.b32 {h2, h3}, t1;
cvt.rn.f16x2.e4m3x2 $0, h0;
cvt.rn.f16x2.e4m3x2 $1, h1;
cvt.rn.f16x2.e4m3x2 $2, h2;
cvt.rn.f16x2.e4m3x2 $3, h3;
}""")


@gluon.jit
def _pv(k_cur, k: gl.constexpr, p_smem, acc, dtype: gl.constexpr):
    """acc [W, 128, H] += V^T P^T over the tile's rows [16 k, 16 k + 16) (fp8 in k_cur, P
    in p_smem): warp w's output columns are [128 w, 128 w + 128)."""
    W: gl.constexpr = acc.type.shape[0]
    H: gl.constexpr = acc.type.shape[2]
    D_V: gl.constexpr = k_cur.type.shape[1]
    v_op: gl.constexpr = gl.DotOperandLayout(0, acc.type.layout, 2)
    p_op: gl.constexpr = gl.DotOperandLayout(1, acc.type.layout, 2)
    # a thread loads 16 contiguous bytes of a row (column bits 0-3 in registers, 4-6 in
    # lanes), 4 of the 16 rows (row bits 1-2 in lanes, 0 and 3 in registers); the warps
    # take column bits 7-8
    v_ld: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [8, 0]],
        lane_bases=[[2, 0], [4, 0], [0, 16], [0, 32], [0, 64]],
        warp_bases=[[0, 128], [0, 256]], block_bases=[], shape=[16, D_V])
    x8 = k_cur.slice(k * 16, 16, dim=0).load(v_ld)
    ev, od = gl.split(gl.permute(gl.reshape(x8, [8, 2, D_V]), [0, 2, 1]))  # even, odd rows
    c01, c23 = gl.inline_asm_elementwise(
        _E4M3_ROW_PAIRS, "=r,=r,=r,=r,r,r",
        [ev.to(gl.uint8, bitcast=True), od.to(gl.uint8, bitcast=True)],
        dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
    # c01 at (row pair, column 4 q + 2 a + b): row 2 pair + b, column 4 q + a; c23 the
    # same for columns 4 q + 2 + a. Back to [rows, columns]:
    x = gl.reshape(gl.join(c01, c23), [8, D_V // 4, 2, 2, 2])  # pair, q, a, b, c01/c23
    x = gl.reshape(gl.permute(x, [0, 3, 1, 4, 2]), [16, D_V])
    x = gl.permute(gl.reshape(x, [16, W, 128]), [1, 0, 2])
    x = gl.reshape(gl.permute(gl.reshape(x, [W, 16, 8, 8, 2]), [0, 1, 3, 4, 2]), [W, 16, 128])
    v = gl.convert_layout(gl.permute(x, [0, 2, 1]), v_op)
    pz = gl.zeros([W, 16, H], dtype, p_op)
    pp = gl.broadcast(gl.expand_dims(
        p_smem.slice(k * 16, 16, dim=0).load(gl.SliceLayout(0, p_op)), 0), pz)[0]
    return mma_v2(v, pp, acc)


@gluon.jit
def _tile(KV, slots_smem, count, stride_kv, it, k_cur, r_cur, k_nxt, r_nxt, q_smem, qr_op,
          p_smem, m_smem, h_scale, offs_n, m_i, l_w, acc):
    """Tile `it` from one buffer, while tile it + 1 is copied into the other (separate
    allocations: no barrier between those copies and these reads). m_i: the running
    maximum (every warp's copy the same), l_w: the sums of P by row and head, summed
    over the rows after the loop."""
    W: gl.constexpr = acc.type.shape[0]
    BLOCK_H: gl.constexpr = acc.type.shape[2]
    BLOCK_N: gl.constexpr = k_cur.type.shape[0]
    D_V: gl.constexpr = k_cur.type.shape[1]
    D_R: gl.constexpr = r_cur.type.shape[1]
    R: gl.constexpr = BLOCK_N // W
    dtype: gl.constexpr = q_smem.dtype
    mma: gl.constexpr = acc.type.layout
    hv: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, mma))
    # fp8 rows as loaded: 8 contiguous bytes a thread (also the rope dot's operand)
    k_ld: gl.constexpr = gl.DotOperandLayout(0, mma, 8)
    k_op: gl.constexpr = gl.DotOperandLayout(0, mma, 2)
    q_op: gl.constexpr = gl.DotOperandLayout(1, mma, 2)
    q_sl: gl.constexpr = gl.SliceLayout(0, q_op)
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
    # three accumulators: shorter chains of dependent mma.sync
    qk0 = gl.zeros([W, R, BLOCK_H], gl.float32, mma)
    qk1 = gl.zeros([W, R, BLOCK_H], gl.float32, mma)
    qk2 = gl.zeros([W, R, BLOCK_H], gl.float32, mma)
    for j in gl.static_range(D_V // 64):
        kk = k3.slice(j * 64, 64, dim=2).load(k_ld).to(dtype)
        kk = gl.convert_layout(_relabel_k(kk), k_op)  # the same registers
        # every warp's copy of the same queries
        qq = gl.broadcast(gl.expand_dims(
            q_smem.slice(j * 64, 64, dim=1).permute([1, 0]).load(q_sl), 0), q_zero)[0]
        if j % 3 == 0:
            qk0 = mma_v2(kk, qq, qk0)
        elif j % 3 == 1:
            qk1 = mma_v2(kk, qq, qk1)
        else:
            qk2 = mma_v2(kk, qq, qk2)
    kk = r3.load(k_ld).to(dtype)
    qk = mma_v2(kk, qr_op, qk2) + qk0 + qk1
    mask_n = (it * BLOCK_N + offs_n) < count
    qk = gl.where(mask_n[:, :, None], qk * h_scale, float("-inf"))
    # the tile's maximum over every warp's rows (the barrier also orders P's writes
    # below after every warp's reads of tile it - 1's P)
    m_smem._reinterpret(gl.float32, [W * BLOCK_H], m_smem.layout).store(
        gl.reshape(gl.max(qk, 1), [W * BLOCK_H]))
    gl.thread_barrier()
    m_new = m_i
    for w in gl.static_range(W):
        m_new = gl.maximum(m_new, m_smem.index(w).load(hv))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(qk - m_use[None, None, :])
    alpha = gl.exp2(m_i - m_use)
    l_w = l_w * alpha[None, None, :] + p
    p_smem.reshape([W, R, BLOCK_H]).store(p.to(dtype))
    gl.thread_barrier()  # every warp's rows of P
    acc = acc * alpha[None, None, :]
    for k in gl.static_range(BLOCK_N // 16):
        acc = _pv(k_cur, k, p_smem, acc, dtype)
    return m_new, l_w, acc


@gluon.jit
def _sparse_mla_fp8_kernel(
    Q, KV, Slots, Counts, KScale, O, Lse, sm_scale,
    stride_qt, stride_qh, stride_kv, stride_st, stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh, num_heads, split_len,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr,
    MAX_SLOTS: gl.constexpr, PARTIAL: gl.constexpr, num_warps: gl.constexpr,
):
    gl.static_assert((BLOCK_H == 8 or BLOCK_H == 16) and num_warps == 4)
    # 128 output columns a warp; P's buffer also holds the rope queries once
    gl.static_assert(BLOCK_N == 64 and D_V == 128 * num_warps and D_R == BLOCK_N)
    W: gl.constexpr = num_warps
    R: gl.constexpr = BLOCK_N // W
    dtype: gl.constexpr = gl.float16
    kv_ty: gl.constexpr = KV.dtype.element_ty
    hb = gl.program_id(0)
    t = gl.program_id(1).to(gl.int64)
    s = gl.program_id(2)
    # [warp, row or output column, head]: S^T of the warp's rows, O^T of its columns
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    wh: gl.constexpr = gl.SliceLayout(1, mma)  # [warp, head]
    hv: gl.constexpr = gl.SliceLayout(0, wh)  # [head], the same in every warp
    # the rows' 16-byte units XORed by row bits 0-2 (as 2, 4, 2 units): a quarter-warp's
    # 8-byte score loads (rows 0-3 x 32 bytes) and 16-byte output loads (rows 0, 2, 4,
    # 6 x 32 bytes) each cover the 32 banks once. The rope rows (64 bytes): row bit 1
    # moves 32 bytes
    sl_k: gl.constexpr = gl.SharedLinearLayout(
        offset_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [0, 32], [0, 64], [0, 128],
                      [0, 256], [1, 32], [2, 64], [4, 32], [8, 0], [16, 0], [32, 0]])
    sl_r: gl.constexpr = gl.SharedLinearLayout(
        offset_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [0, 32], [1, 0], [2, 32],
                      [4, 0], [8, 0], [16, 0], [32, 0]])
    # queries: 16-byte units XORed by the head's low 3 bits (ldmatrix reads 8 heads x 16
    # bytes); the rope queries on their way to registers: 64-byte units by head bit 0
    sl_q: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
    sl_qr: gl.constexpr = gl.SwizzledSharedLayout(32, 1, 2, [1, 0])
    sl_s: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    # P's rows (32 bytes): 16-byte units XORed by row bit 2 (ldmatrix reads 8 rows)
    sl_p: gl.constexpr = gl.SwizzledSharedLayout(8, 4, 2, [1, 0])
    k_a = gl.allocate_shared_memory(kv_ty, [BLOCK_N, D_V], sl_k)
    r_a = gl.allocate_shared_memory(kv_ty, [BLOCK_N, D_R], sl_r)
    k_b = gl.allocate_shared_memory(kv_ty, [BLOCK_N, D_V], sl_k)
    r_b = gl.allocate_shared_memory(kv_ty, [BLOCK_N, D_R], sl_r)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, D_V], sl_q)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_H], sl_p)
    m_smem = gl.allocate_shared_memory(gl.float32, [W, BLOCK_H], sl_s)
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
    q16 = gl.reshape((q * q_mul[:, None]).to(dtype), [BLOCK_H, D_V // 64, 64])
    q_smem.store(gl.reshape(_relabel_k(q16), [BLOCK_H, D_V]))  # in the dot's order
    # the rope queries pass through P's buffer (the same size) on their way to registers
    qr_smem = p_smem._reinterpret(dtype, [BLOCK_H, D_R], sl_qr)
    qr_smem.store((qr * q_mul[:, None]).to(dtype))
    # the per-tensor fp8 scale on the scores and the output; base-2 softmax
    v_scale = gl.load(KScale)
    h_scale = sm_scale * 1.4426950408889634 * v_scale / q_mul
    h_scale = gl.convert_layout(h_scale, hv)[None, None, :]

    cp.wait_group(0)
    gl.thread_barrier()  # the slot ids and the queries are in shared memory
    # the rope queries as the score dot's operand, in registers for the whole loop (the
    # loop's first barrier orders P's first writes after these reads)
    q_op: gl.constexpr = gl.DotOperandLayout(1, mma, 8)
    qr_op = gl.broadcast(gl.expand_dims(
        qr_smem.permute([1, 0]).load(gl.SliceLayout(0, q_op)), 0),
        gl.zeros([W, D_R, BLOCK_H], dtype, q_op))[0]
    _copy_rows(KV, slots_smem, 0, count, stride_kv, k_a, r_a, BLOCK_N, D_V, D_R)
    cp.commit_group()

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, hv)
    l_w = gl.zeros([W, R, BLOCK_H], gl.float32, mma)
    acc = gl.zeros([W, 128, BLOCK_H], gl.float32, mma)
    wr: gl.constexpr = gl.SliceLayout(2, mma)
    offs_n = (gl.arange(0, W, gl.SliceLayout(1, wr))[:, None] * R
              + gl.arange(0, R, gl.SliceLayout(0, wr))[None, :])
    for it in range(0, n_iters, 2):
        m_i, l_w, acc = _tile(
            KV, slots_smem, count, stride_kv, it, k_a, r_a, k_b, r_b, q_smem, qr_op, p_smem,
            m_smem, h_scale, offs_n, m_i, l_w, acc)
        if it + 1 < n_iters:
            m_i, l_w, acc = _tile(
                KV, slots_smem, count, stride_kv, it + 1, k_b, r_b, k_a, r_a, q_smem, qr_op,
                p_smem, m_smem, h_scale, offs_n, m_i, l_w, acc)
    cp.wait_group(0)

    l_tot = gl.convert_layout(gl.sum(gl.sum(l_w, 1), 0), hv)
    l_safe = gl.where(l_tot > 0.0, l_tot, 1.0)
    inv_l = v_scale / l_safe
    # warp w's output columns m = 128 w + 16 i + 8 b + g of every head are the latent
    # columns 128 w + 16 g + 2 i + b: [heads, latent columns] in a layout of 16-byte
    # stores, a warp's 512 contiguous bytes of a row (the conversion goes through shared
    # memory)
    o = gl.reshape((acc * inv_l[None, None, :]).to(O.dtype.element_ty), [W, 8, 2, 8, BLOCK_H])
    o = gl.reshape(gl.permute(o, [4, 0, 3, 1, 2]), [BLOCK_H, D_V])
    VEC: gl.constexpr = 128 // O.dtype.element_ty.primitive_bitwidth
    st: gl.constexpr = gl.BlockedLayout([1, VEC], [1, 32], [num_warps, 1], [1, 0])
    o = gl.convert_layout(o, st)
    offs_ho = hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, st))
    o_ptr = (O + t * stride_ot + s * stride_os + offs_ho[:, None] * stride_oh
             + gl.arange(0, D_V, gl.SliceLayout(0, st))[None, :])
    gl.store(o_ptr, o, mask=(offs_ho < num_heads)[:, None])
    if PARTIAL:
        # base-2 log-sum-exp of the split; -inf without valid slots
        lse = gl.where(l_tot > 0.0, m_i + gl.log2(l_safe), float("-inf"))
        offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, hv)
        gl.store(Lse + t * stride_lt + offs_h * stride_lh + s, lse, mask=offs_h < num_heads)


def supports(num_heads_per_tile: int, kv_lora_rank: int, rope_dim: int,
             q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """The shapes and dtypes this tile takes (GLM-5 / DeepSeek-V3.2 MLA, 16-bit queries,
    an fp8 e4m3 cache)."""
    return (num_heads_per_tile in TILE_HEADS and kv_lora_rank == KV_LORA_RANK
            and rope_dim == ROPE_DIM and q_dtype in (torch.bfloat16, torch.float16)
            and kv_dtype == torch.float8_e4m3fn)


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

