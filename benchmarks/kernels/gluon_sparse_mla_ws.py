# SPDX-License-Identifier: Apache-2.0
"""Work in progress, NOT RUN ON A GPU YET: a warp-specialized 64-head sparse MLA tile
in Gluon for sm_90 (16-bit caches).

Three partitions share a ring of STAGES shared-memory stages of rows:
- a producer (4 warps, 40 registers) gathers the rows of the next tiles with async
  copies, each thread's copies arriving on the stage's "full" mbarrier;
- two consumers (4 warps each, 232 registers) each compute the whole score tile for
  the 64 heads (the QK^T dot is done twice) and the PV dot for their half of the
  output columns, then release the stage on its "empty" mbarrier.
The consumers never meet at a CTA-wide barrier, and the gather's issue cost leaves
them (the two stalls that Nsight Compute puts first in the Triton tile, see
benchmarks/results/h200-sparse-mla-ncu.log).

    python benchmarks/kernels/benchmark_triton_mla_sparse.py \
        --ops-file benchmarks/kernels/gluon_sparse_mla_ws.py --heads 64 128 --kv bf16
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy as cp,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from vllm.triton_utils import triton
from vllm.v1.attention.ops import triton_sparse_mla as tsm

# the benchmark reads the Triton kernel's compile stats from here
_sparse_mla_kernel = tsm._sparse_mla_kernel
STAGES = 2  # two stages of 64 rows next to the queries: 217 KiB


@gluon.jit
def _producer(KV, Slots, t, stride_kv, stride_st, start, end, n_iters,
              k_smem, r_smem, full_bars, empty_bars,
              BLOCK_N: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr):
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


@gluon.jit
def _consumer(q_smem, qr_smem, k_smem, r_smem, p_smem, m_smem, full_bars, empty_bars, x_bars,
              O, Lse, t, s, hb, start, end, n_iters, qk_scale, num_heads,
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
    out = acc / gl.convert_layout(l_safe, row_o)[:, None]
    offs_ho = hb * BLOCK_H + gl.arange(0, BLOCK_H, row_o)
    offs_o = C * D_O + gl.arange(0, D_O, gl.SliceLayout(0, o_layout))
    o_ptr = O + t * stride_ot + s * stride_os + offs_ho[:, None] * stride_oh + offs_o[None, :]
    gl.store(o_ptr, out.to(O.dtype.element_ty), mask=(offs_ho < num_heads)[:, None])
    if PARTIAL and C == 0:
        lse = gl.where(l_tot > 0.0, m_i + gl.log2(l_safe), float("-inf"))
        offs_hl = hb * BLOCK_H + gl.arange(0, BLOCK_H, row_s)
        gl.store(Lse + t * stride_lt + offs_hl * stride_lh + s, lse, mask=offs_hl < num_heads)


# gl.warp_specialize hands every worker partition the same arguments: one function per
# role, dispatching on a constexpr
@gluon.jit
def _consumer0(q_smem, qr_smem, k_smem, r_smem, p_smem, m_smem, full_bars, empty_bars,
               x_bars, O, Lse, KV, Slots, t, s, hb, start, end, n_iters, qk_scale, num_heads,
               stride_kv, stride_st, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
               BLOCK_N: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr,
               PARTIAL: gl.constexpr):
    _consumer(q_smem, qr_smem, k_smem, r_smem, p_smem, m_smem, full_bars, empty_bars, x_bars,
              O, Lse, t, s, hb, start, end, n_iters, qk_scale, num_heads,
              stride_ot, stride_oh, stride_os, stride_lt, stride_lh, 0, BLOCK_N, D_V, PARTIAL)


@gluon.jit
def _worker(q_smem, qr_smem, k_smem, r_smem, p_smem, m_smem, full_bars, empty_bars, x_bars,
            O, Lse, KV, Slots, t, s, hb, start, end, n_iters, qk_scale, num_heads,
            stride_kv, stride_st, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
            BLOCK_N: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr,
            PARTIAL: gl.constexpr, ROLE: gl.constexpr):
    if ROLE == 0:
        _consumer(q_smem, qr_smem, k_smem, r_smem, p_smem, m_smem, full_bars, empty_bars,
                  x_bars, O, Lse, t, s, hb, start, end, n_iters, qk_scale, num_heads,
                  stride_ot, stride_oh, stride_os, stride_lt, stride_lh, 1, BLOCK_N, D_V,
                  PARTIAL)
    else:
        _producer(KV, Slots, t, stride_kv, stride_st, start, end, n_iters, k_smem, r_smem,
                  full_bars, empty_bars, BLOCK_N, D_V, D_R)


@gluon.jit
def _consumer1(q_smem, qr_smem, k_smem, r_smem, p_smem, m_smem, full_bars, empty_bars,
               x_bars, O, Lse, KV, Slots, t, s, hb, start, end, n_iters, qk_scale, num_heads,
               stride_kv, stride_st, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
               BLOCK_N: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr,
               PARTIAL: gl.constexpr):
    _worker(q_smem, qr_smem, k_smem, r_smem, p_smem, m_smem, full_bars, empty_bars, x_bars,
            O, Lse, KV, Slots, t, s, hb, start, end, n_iters, qk_scale, num_heads,
            stride_kv, stride_st, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
            BLOCK_N, D_V, D_R, PARTIAL, 0)


@gluon.jit
def _producer_w(q_smem, qr_smem, k_smem, r_smem, p_smem, m_smem, full_bars, empty_bars,
                x_bars, O, Lse, KV, Slots, t, s, hb, start, end, n_iters, qk_scale, num_heads,
                stride_kv, stride_st, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
                BLOCK_N: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr,
                PARTIAL: gl.constexpr):
    _worker(q_smem, qr_smem, k_smem, r_smem, p_smem, m_smem, full_bars, empty_bars, x_bars,
            O, Lse, KV, Slots, t, s, hb, start, end, n_iters, qk_scale, num_heads,
            stride_kv, stride_st, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
            BLOCK_N, D_V, D_R, PARTIAL, 1)


@gluon.jit
def _sparse_mla_ws_kernel(
    Q, KV, Slots, Counts, O, Lse, sm_scale,
    stride_qt, stride_qh, stride_kv, stride_st, stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh, num_heads, split_len,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr,
    PARTIAL: gl.constexpr, num_warps: gl.constexpr,
):
    BLOCK_H: gl.constexpr = 64
    dtype: gl.constexpr = Q.dtype.element_ty
    ld_v: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    ld_r: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    sl_p: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=BLOCK_N, element_bitwidth=16,
                                              rank=2)
    sl_m: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    hb = gl.program_id(0)
    t = gl.program_id(1).to(gl.int64)
    s = gl.program_id(2)

    offs_hq = hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, ld_v))
    offs_v = gl.arange(0, D_V, gl.SliceLayout(0, ld_v))
    q_nope = gl.load(Q + t * stride_qt + offs_hq[:, None] * stride_qh + offs_v[None, :],
                     mask=(offs_hq < num_heads)[:, None], other=0.0)
    offs_hr = hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, ld_r))
    offs_r = gl.arange(0, D_R, gl.SliceLayout(0, ld_r))
    q_rope = gl.load(Q + t * stride_qt + offs_hr[:, None] * stride_qh + D_V + offs_r[None, :],
                     mask=(offs_hr < num_heads)[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, D_V], sl, q_nope)
    qr_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, D_R], sl, q_rope)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_V], sl)
    r_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_R], sl)
    p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_H, BLOCK_N // 2], sl_p)
    m_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], sl_m)
    full_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full_bars.index(i), count=128)  # the producer's threads
        mbarrier.init(empty_bars.index(i), count=2)  # the two consumers
    for i in gl.static_range(2):
        mbarrier.init(x_bars.index(i), count=2)  # the consumers' exchanges (maxima, P)
    fence_async_shared()

    count = gl.load(Counts + t)
    start = s * split_len
    end = gl.minimum(start + split_len, count)
    n_iters = gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)
    qk_scale = sm_scale * 1.4426950408889634
    # (a tuple built once and passed three times loses the constexprs)
    gl.warp_specialize([
        (_consumer0, (q_smem, qr_smem, k_smem, r_smem, p_smem, m_smem, full_bars, empty_bars, x_bars,
             O, Lse, KV, Slots, t, s, hb, start, end, n_iters, qk_scale, num_heads,
             stride_kv, stride_st, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
             BLOCK_N, D_V, D_R, PARTIAL)),
        (_consumer1, (q_smem, qr_smem, k_smem, r_smem, p_smem, m_smem, full_bars, empty_bars, x_bars,
             O, Lse, KV, Slots, t, s, hb, start, end, n_iters, qk_scale, num_heads,
             stride_kv, stride_st, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
             BLOCK_N, D_V, D_R, PARTIAL)),
        (_producer_w, (q_smem, qr_smem, k_smem, r_smem, p_smem, m_smem, full_bars, empty_bars, x_bars,
             O, Lse, KV, Slots, t, s, hb, start, end, n_iters, qk_scale, num_heads,
             stride_kv, stride_st, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
             BLOCK_N, D_V, D_R, PARTIAL)),
    ],
                       [4, 4], [232, 40])


def device_launch_config(device: torch.device, num_tokens: int, num_heads: int, topk: int,
                         kv_lora_rank: int, num_sms: int, kv_fp8: bool) -> dict:
    """The launch table's configuration; "GLUON" marks the tiles this kernel takes
    (64 heads of a 16-bit cache on Hopper)."""
    cfg = tsm.device_launch_config(device, num_tokens, num_heads, topk, kv_lora_rank,
                                   num_sms, kv_fp8)
    hopper = False
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        hopper = (tsm.device_capability(index) // 10 == 9
                  and tsm.device_shared_mem(index) >= tsm.HOPPER_SHARED_MEM)
    cfg["GLUON"] = hopper and cfg["BLOCK_H"] == 64 and not kv_fp8 and cfg["V_SPLITS"] == 1
    return cfg


def sparse_mla_attention(q, kv_cache, slots, valid_counts, kv_lora_rank, scale, k_scale,
                         num_sms, config=None):
    """`triton_sparse_mla.sparse_mla_attention`, with the warp-specialized kernel for the tiles
    `device_launch_config` marks."""
    num_tokens, num_heads, head_dim = q.shape
    kv = kv_cache.view(-1, kv_cache.shape[-1])
    kv_fp8 = kv.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8)
    cfg = config or device_launch_config(q.device, num_tokens, num_heads, slots.shape[1],
                                         kv_lora_rank, num_sms, kv_fp8)
    if not cfg.get("GLUON") or num_tokens == 0:
        return tsm.sparse_mla_attention(q, kv_cache, slots, valid_counts, kv_lora_rank,
                                        scale, k_scale, num_sms, config=cfg)
    assert cfg["BLOCK_H"] == 64 and not kv_fp8 and cfg.get("V_SPLITS", 1) == 1
    assert kv.stride(-1) == 1 and q.stride(-1) == 1 and slots.stride(-1) == 1
    splits = cfg["splits"]
    o = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    split_len, out, lse, so, sl = tsm.split_k_outputs(o, slots.shape[1], splits,
                                                      cfg["BLOCK_N"])
    grid = (triton.cdiv(num_heads, 64), num_tokens, splits)
    _sparse_mla_ws_kernel[grid](
        q, kv, slots, valid_counts, out, lse, scale,
        q.stride(0), q.stride(1), kv.stride(0), slots.stride(0), *so, *sl,
        num_heads, split_len, BLOCK_N=cfg["BLOCK_N"], STAGES=STAGES, D_V=kv_lora_rank,
        D_R=head_dim - kv_lora_rank, PARTIAL=splits > 1, num_warps=4, maxnreg=168)
    tsm.merge_split_k(out, lse, o)
    return o
