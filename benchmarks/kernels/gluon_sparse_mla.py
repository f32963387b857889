# SPDX-License-Identifier: Apache-2.0
"""Experiment: the gather kernel's 64-head tile (16-bit cache) in Gluon for sm_90,
with the next tile's rows copied at the top of each iteration.

Triton 3.6's loop pipeliner copies the next tile of rows after the current tile's
dots and waits for it at the top of the next iteration (see the kernel bench's
"copy groups in flight"); Nsight Compute puts 35% of the 64-head tile's stall samples
at that wait. This kernel issues the copy of tile i + 1 before tile i's dots, into
the second of two buffers (the same 225 KiB of shared memory), so one tile is in
flight during the dots. Everything else follows `triton_sparse_mla._sparse_mla_kernel`
(heads in M, split-K with the same merge kernel).

H200 result (benchmarks/results/h200-sparse-mla-gluon.json, against the Triton
kernel's bench of the same day): as exact as the Triton kernel against float64,
5-17% faster at 1-8 tokens, 2-6% slower from 64 tokens (4096 tokens x 64 heads: 4950
vs 4792 us). Hiding the copy does not speed the tile up at scale, so the launch
table does not use it. The warp-specialized tile that grew from it, and that the
table uses on Hopper, is `vllm/v1/attention/ops/gluon_sparse_mla.py`.

    python benchmarks/kernels/benchmark_triton_mla_sparse.py \
        --ops-file benchmarks/kernels/gluon_sparse_mla.py --heads 64 128 --kv bf16
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy as cp,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from vllm.triton_utils import triton
from vllm.v1.attention.ops import triton_sparse_mla as tsm

# the benchmark reads the Triton kernel's compile stats from here
_sparse_mla_kernel = tsm._sparse_mla_kernel


@gluon.jit
def _issue_rows(KV, Slots, t, stride_kv, stride_st, n0, end, k_buf, r_buf,
                BLOCK_N: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr,
                ld_v: gl.constexpr, ld_r: gl.constexpr):
    offs_n = n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(1, ld_v))
    mask_n = offs_n < end
    slot = gl.load(Slots + t * stride_st + offs_n, mask=mask_n, other=0).to(gl.int64)
    offs_v = gl.arange(0, D_V, gl.SliceLayout(0, ld_v))
    cp.async_copy_global_to_shared(k_buf, KV + slot[:, None] * stride_kv + offs_v[None, :],
                                   mask=mask_n[:, None])
    slot_r = gl.convert_layout(slot, gl.SliceLayout(1, ld_r))
    mask_r = gl.convert_layout(mask_n, gl.SliceLayout(1, ld_r))
    offs_r = gl.arange(0, D_R, gl.SliceLayout(0, ld_r))
    cp.async_copy_global_to_shared(r_buf, KV + slot_r[:, None] * stride_kv + D_V + offs_r[None, :],
                                   mask=mask_r[:, None])


@gluon.jit
def _sparse_mla_wgmma_kernel(
    Q, KV, Slots, Counts, O, Lse, sm_scale,
    stride_qt, stride_qh, stride_kv, stride_st, stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh, num_heads, split_len,
    BLOCK_N: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, PARTIAL: gl.constexpr,
    num_warps: gl.constexpr,
):
    BLOCK_H: gl.constexpr = 64
    WG: gl.constexpr = num_warps // 4  # warpgroups; each takes 1/WG of the columns
    dtype: gl.constexpr = Q.dtype.element_ty
    # register layouts
    ld_v: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    ld_r: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, WG], instr_shape=[16, BLOCK_N // WG, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, WG], instr_shape=[16, D_V // WG, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    # shared layouts
    q_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    k_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    hb = gl.program_id(0)
    t = gl.program_id(1).to(gl.int64)
    s = gl.program_id(2)

    # queries into shared memory
    offs_hq = hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, ld_v))
    offs_v = gl.arange(0, D_V, gl.SliceLayout(0, ld_v))
    q_row = Q + t * stride_qt + offs_hq[:, None] * stride_qh
    q_nope = gl.load(q_row + offs_v[None, :], mask=(offs_hq < num_heads)[:, None], other=0.0)
    offs_hr = hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, ld_r))
    offs_r = gl.arange(0, D_R, gl.SliceLayout(0, ld_r))
    q_rope = gl.load(Q + t * stride_qt + offs_hr[:, None] * stride_qh + D_V + offs_r[None, :],
                     mask=(offs_hr < num_heads)[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, D_V], q_sl, q_nope)
    qr_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, D_R], q_sl, q_rope)
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D_V], k_sl)
    r_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D_R], k_sl)
    fence_async_shared()

    count = gl.load(Counts + t)
    start = s * split_len
    end = gl.minimum(start + split_len, count)
    n_iters = gl.cdiv(end - start, BLOCK_N)
    qk_scale = sm_scale * 1.4426950408889634

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, s_layout))
    acc = warpgroup_mma_init(gl.zeros([BLOCK_H, D_V], gl.float32, o_layout))
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
    offs_ns = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))

    _issue_rows(KV, Slots, t, stride_kv, stride_st, start, end, k_smem.index(0), r_smem.index(0),
                BLOCK_N, D_V, D_R, ld_v, ld_r)
    cp.commit_group()
    for it in range(n_iters):
        cur = it % 2
        # the PV dot of the last tile read the other buffer: done, in every warpgroup,
        # before the next tile's rows go there
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()
        _issue_rows(KV, Slots, t, stride_kv, stride_st, start + (it + 1) * BLOCK_N, end,
                    k_smem.index(1 - cur), r_smem.index(1 - cur), BLOCK_N, D_V, D_R, ld_v, ld_r)
        cp.commit_group()
        cp.wait_group(1)  # this tile's rows (the next tile's may still be in flight)
        gl.thread_barrier()
        k_cur = k_smem.index(cur)
        qk = warpgroup_mma(q_smem, k_cur.permute([1, 0]), s_zero, use_acc=False)
        qk = warpgroup_mma(qr_smem, r_smem.index(cur).permute([1, 0]), qk)
        mask_n = (start + it * BLOCK_N + offs_ns) < end
        qk = gl.where(mask_n[None, :], qk * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 1))
        p = gl.exp2(qk - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
        acc = acc * alpha_o[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc = warpgroup_mma(p_op, k_cur, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    cp.wait_group(0)

    l_safe = gl.where(l_i > 0.0, l_i, 1.0)
    l_o = gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))
    out = acc / l_o[:, None]
    offs_ho = hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, o_layout))
    offs_o = gl.arange(0, D_V, gl.SliceLayout(0, o_layout))
    o_ptr = O + t * stride_ot + s * stride_os + offs_ho[:, None] * stride_oh + offs_o[None, :]
    gl.store(o_ptr, out.to(O.dtype.element_ty), mask=(offs_ho < num_heads)[:, None])
    if PARTIAL:
        lse = gl.where(l_i > 0.0, m_i + gl.log2(l_safe), float("-inf"))
        offs_hl = hb * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, s_layout))
        gl.store(Lse + t * stride_lt + offs_hl * stride_lh + s, lse, mask=offs_hl < num_heads)


def device_launch_config(device: torch.device, num_tokens: int, num_heads: int, topk: int,
                         kv_lora_rank: int, num_sms: int, kv_fp8: bool,
                         warp_specialized: bool = True) -> dict:
    """The launch table's configuration; "GLUON" marks the tiles this kernel takes
    (the warp-specialized tiles of a 16-bit cache on Hopper)."""
    cfg = tsm.device_launch_config(device, num_tokens, num_heads, topk, kv_lora_rank,
                                   num_sms, kv_fp8, warp_specialized)
    # the table's warp-specialized tiles of a 16-bit cache are exactly these (a CPU
    # device gets Hopper's table, for the interpreter, which runs no Gluon)
    cfg["GLUON"] = (device.type == "cuda" and cfg["WARP_SPECIALIZED"] and not kv_fp8
                    and cfg["V_SPLITS"] == 1)
    return cfg


def sparse_mla_attention(q, kv_cache, slots, valid_counts, kv_lora_rank, scale, k_scale,
                         num_sms, config=None):
    """`triton_sparse_mla.sparse_mla_attention`, with the Gluon kernel for the tiles
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
    _sparse_mla_wgmma_kernel[grid](
        q, kv, slots, valid_counts, out, lse, scale,
        q.stride(0), q.stride(1), kv.stride(0), slots.stride(0), *so, *sl,
        num_heads, split_len, BLOCK_N=cfg["BLOCK_N"], D_V=kv_lora_rank,
        D_R=head_dim - kv_lora_rank, PARTIAL=splits > 1, num_warps=cfg["num_warps"])
    tsm.merge_split_k(out, lse, o)
    return o
