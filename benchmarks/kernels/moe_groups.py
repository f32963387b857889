# SPDX-License-Identifier: Apache-2.0
"""Candidate GGUF MoE kernels for few tokens (decode of 8-64 sequences), Q4_K and Q6_K
experts; benchmarks/kernels/benchmark_gguf_ops.py times them as `groups` beside the
plugin's kernels. Not in the wheel: they move into the plugin if they win there.

The plugin's MMVQ kernel (`moe_vec_q`) reads an expert once per token that chose it;
these read it once per group of up to BLOCK_M tokens that chose it (vLLM's
`moe_align_block_size` groups, the layout the plugin's Triton MoE kernels take), with
the whole block (256 values) of each of BLOCK_N rows loaded at once and dequantized in
registers for one 16-bit dot a block. The dot's K order need not be the values' order,
only the same for both operands: Q4_K's value 64 g + 32 h + l sits in the low (h = 0)
or high (h = 1) nibble of byte 32 g + l, so its bytes are split into nibbles as loaded
([.., g, l, h]) and the activations are read in that order; Q6_K's values are
assembled in their own order ([.., n, s, l]: value 128 n + 32 s + l). A second Q4_K
variant dots each 32-value sub-block's 4-bit codes and scales the [tokens, rows] result
(fewer operations a weight, eight smaller dots a block).
"""

import torch
import triton
import triton.language as tl
from vllm_gguf_plugin.triton.fused_moe.utils import load_moe_token_info
from vllm_gguf_plugin.triton.gemm.utils import load_f16_from_u8

BLOCK_VALUES = 256
BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}


@triton.jit
def _q4_k_scale_min(at, j, mask):
    """The 6-bit scale and min of sub-block `j` of the Q4_K blocks at `at` (llama.cpp's
    get_scale_min_k4; scales[i] sits at byte 4 + i), as float32."""
    low = j < 4
    a = tl.load(at + 4 + tl.where(low, j, j + 4), mask=mask, other=0)
    b = tl.load(at + 4 + tl.where(low, j + 4, j - 4), mask=mask, other=0)
    c = tl.load(at + 4 + j, mask=mask, other=0)
    sc = tl.where(low, a & 63, (a & 0xF) | ((b >> 6) << 4))
    mn = tl.where(low, b & 63, (a >> 4) | ((c >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _q4_k_block(blk, n_mask):
    """The 256 values of each row's Q4_K block at `blk` ([BLOCK_N] pointers), in
    [BLOCK_N, 4, 32, 2] (g, l, h) order, and that order's value index [4, 32, 2]."""
    g = tl.arange(0, 4)
    l_ = tl.arange(0, 32)
    h = tl.arange(0, 2)
    mask = n_mask[:, None, None]
    at = blk[:, None, None]
    # sub-block j = 2 g + h
    sc, mn = _q4_k_scale_min(at, (2 * g[:, None] + h[None, :])[None, :, :], mask)
    d = load_f16_from_u8(blk, n_mask).to(tl.float32)[:, None, None]
    dmin = load_f16_from_u8(blk + 2, n_mask).to(tl.float32)[:, None, None]
    q = tl.load(at + (16 + 32 * g[:, None] + l_[None, :])[None, :, :], mask=mask, other=0)
    q = tl.join(q & 0xF, q >> 4).to(tl.float32)  # [N, 4, 32, 2]
    w = q * (d * sc)[:, :, None, :] - (dmin * mn)[:, :, None, :]
    value = 64 * g[:, None, None] + 32 * h[None, None, :] + l_[None, :, None]
    return w, value


@triton.jit
def _q4_k_dots_scaled_after(blk, n_mask, x_at, tok_mask, acc):
    """`acc` plus one Q4_K block's product, each 32-value sub-block's 4-bit codes dotted
    with the activations as they are and scaled after the dot: d * scale * (x . q) -
    dmin * min * sum(x), per row and token, instead of a scale and a min per value."""
    l_ = tl.arange(0, 32)
    d = load_f16_from_u8(blk, n_mask).to(tl.float32)
    dmin = load_f16_from_u8(blk + 2, n_mask).to(tl.float32)
    for g in tl.static_range(4):
        q = tl.load(blk[:, None] + 16 + 32 * g + l_[None, :], mask=n_mask[:, None], other=0)
        for h in tl.static_range(2):
            sc, mn = _q4_k_scale_min(blk, tl.full((1,), 2 * g + h, tl.int32), n_mask)
            xs = tl.load(x_at[:, None] + 64 * g + 32 * h + l_[None, :], mask=tok_mask[:, None],
                         other=0.0)
            codes = ((q >> (4 * h)) & 0xF).to(xs.dtype)
            dots = tl.dot(xs, tl.trans(codes))
            xsum = tl.sum(xs.to(tl.float32), axis=1)
            acc += dots * (d * sc)[None, :] - xsum[:, None] * (dmin * mn)[None, :]
    return acc


@triton.jit
def _q6_k_block(blk, n_mask):
    """The 256 values of each row's Q6_K block at `blk`, in [BLOCK_N, 2, 4, 32] (n, s,
    l) order (value 128 n + 32 s + l), and that order's value index [2, 4, 32]."""
    n_ = tl.arange(0, 2)[:, None, None]
    s = tl.arange(0, 4)[None, :, None]
    l_ = tl.arange(0, 32)[None, None, :]
    mask = n_mask[:, None, None, None]
    at = blk[:, None, None, None]
    # llama.cpp's dequantize_row_q6_K: 4 low bits in ql, 2 high in qh, int8 scale per 16
    ql = tl.load(at + (64 * n_ + 32 * (s % 2) + l_)[None, :, :, :], mask=mask, other=0)
    qh = tl.load(at + (128 + 32 * n_ + l_)[None, :, :, :], mask=mask, other=0)
    sc = tl.load(at + (192 + 8 * n_ + 2 * s + l_ // 16)[None, :, :, :], mask=mask, other=0)
    q = ((ql >> (4 * (s // 2))[None, :, :, :]) & 0xF) | (((qh >> (2 * s)[None, :, :, :]) & 3) << 4)
    d = load_f16_from_u8(blk + 208, n_mask).to(tl.float32)[:, None, None, None]
    w = d * sc.to(tl.int8, bitcast=True).to(tl.float32) * (q.to(tl.float32) - 32.0)
    return w, 128 * n_ + 32 * s + l_


@triton.jit
def _moe_groups_kernel(
    x_ptr, w_ptr, y_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, num_valid,
    top_k, n, num_k_blocks, stride_xm, stride_we, stride_wn, stride_ym,
    Q6_K: tl.constexpr, SCALE_AFTER: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # the grid covers the most groups there can be; the rest of expert_ids is not written
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m)
    if expert < 0:
        return
    offs_out, offs_tok, tok_mask = load_moe_token_info(sorted_ids_ptr, pid_m, top_k, num_valid,
                                                       BLOCK_M=BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64) * stride_wn
    x_rows = x_ptr + offs_tok * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(num_k_blocks):
        if SCALE_AFTER:
            acc = _q4_k_dots_scaled_after(rows + kb * 144, n_mask, x_rows + kb * 256, tok_mask,
                                          acc)
        else:
            if Q6_K:
                w, value = _q6_k_block(rows + kb * 210, n_mask)
            else:
                w, value = _q4_k_block(rows + kb * 144, n_mask)
            xk = tl.load(x_rows[:, None, None, None] + kb * 256 + value[None, :, :, :],
                         mask=tok_mask[:, None, None, None], other=0.0)
            xk = tl.reshape(xk, (BLOCK_M, 256))
            w = tl.reshape(w, (BLOCK_N, 256)).to(xk.dtype)
            acc = tl.dot(xk, tl.trans(w), acc)
    y = y_ptr + offs_out[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=tok_mask[:, None] & n_mask[None, :])


def moe_groups(x: torch.Tensor, w: torch.Tensor, qtype: str, sorted_token_ids: torch.Tensor,
               expert_ids: torch.Tensor, num_tokens_post_padded: torch.Tensor, top_k: int,
               rows: int, block_m: int = 16, block_n: int = 32, num_warps: int = 4,
               scale_after: bool = False) -> torch.Tensor:
    """y[p] = dequantized expert(p) @ x[p // top_k] for the (token, slot) pairs p that
    `sorted_token_ids` lists in groups of `block_m` (one expert each, `expert_ids`;
    entries >= tokens * top_k pad a group; groups from num_tokens_post_padded / block_m
    on are unused), as vLLM's moe_align_block_size writes them and the plugin's
    ggml_moe_a8_vec computes the pairs; y has tokens * top_k rows. w: [experts, rows,
    K / 256 * block bytes] of `qtype` (Q4_K or Q6_K). `scale_after`: Q4_K's sub-blocks
    scaled after their dots (_q4_k_dots_scaled_after), not value by value."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"{qtype}: these kernels take {sorted(BLOCK_BYTES)}")
    if scale_after and qtype != "Q4_K":
        raise ValueError("scale_after is Q4_K's")
    if w.dtype != torch.uint8 or w.dim() != 3 or w.shape[1] != rows:
        raise ValueError(f"w must be [experts, {rows}, bytes] uint8, got {tuple(w.shape)} "
                         f"{w.dtype}")
    k_blocks, rest = divmod(w.shape[2], BLOCK_BYTES[qtype])
    if rest or x.shape[1] != k_blocks * BLOCK_VALUES:
        raise ValueError(f"x has {x.shape[1]} columns, the {qtype} rows {w.shape[2]} bytes")
    if sorted_token_ids.numel() != expert_ids.numel() * block_m:
        raise ValueError("sorted_token_ids must hold block_m entries per expert_ids entry")
    num_valid = x.shape[0] * top_k
    y = torch.zeros(num_valid, rows, dtype=x.dtype, device=x.device)
    x = x.contiguous()
    grid = (expert_ids.numel(), triton.cdiv(rows, block_n))
    _moe_groups_kernel[grid](
        x, w, y, sorted_token_ids, expert_ids, num_tokens_post_padded, num_valid, top_k,
        rows, k_blocks, x.stride(0), w.stride(0), w.stride(1), y.stride(0),
        Q6_K=qtype == "Q6_K", SCALE_AFTER=scale_after, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps)
    return y
