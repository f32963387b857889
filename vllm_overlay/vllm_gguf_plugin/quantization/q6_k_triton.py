# SPDX-License-Identifier: Apache-2.0
"""Linear Q6_K products of a few tokens on a Triton GEMM over the file's blocks.

From 2 tokens the plugin runs Q6_K on MMQ (int8 activations), whose time grows with
every token: at GLM-5's shapes it ran slower than dequantizing the weight and running a
16-bit GEMM from 8-32 tokens on (docs/results.md, "Dense products: Q4_K on vLLM's
Marlin GEMM"), and its Triton GEMM takes K 16 values at a time. Q6_K has no Marlin form
(a scale per 16 values), and a Q4_K_M file keeps the output head and about half of its
layers' ffn_down at Q6_K. The kernel reads each weight row's 210-byte blocks once per
tile of token rows, multiplies each 16-value sub-block's codes (exact in 16 bits) by
16-bit activations on tensor cores and scales the float32 result; it splits along K
where its output tiles do not fill the GPU.

Off unless VLLM_GGUF_Q6_K_TRITON=1: faster at the op, not yet in a whole decode step
(H200, 2026-12-04, in the history of docs/results.md). Then, with float16 or bfloat16 activations, a
linear Q6_K product of LINEAR_TOKENS tokens runs here. Other counts (from 65 the
dequantized 16-bit GEMM, as without the switch), and the routed experts' products
(slower on this tile than on the plugin's kernels), keep the plugin's paths.
"""

import dataclasses
import functools
import os

import torch
from gguf import GGMLQuantizationType
from vllm.triton_utils import tl, triton

Q6_K = int(GGMLQuantizationType.Q6_K)
Q6_K_BLOCK, Q6_K_BYTES = 256, 210  # values and bytes of a block: ql 128, qh 64, scales 16, d 2
Q6_K_ENV = "VLLM_GGUF_Q6_K_TRITON"
# from 8 tokens (fewer: MMVQ and MMQ are faster, docs/results.md) to 64: past that a third
# token tile decodes every weight again, slower than dequantizing it once
LINEAR_TOKENS = range(8, 65)


@functools.cache
def enabled() -> bool:
    """On only with VLLM_GGUF_Q6_K_TRITON=1 (read once)."""
    return os.environ.get(Q6_K_ENV, "0").strip() == "1"


def takes(x: torch.Tensor, qweight_type: int) -> bool:
    """Whether a linear product of x [tokens, K] with a weight of this type runs here."""
    return (x.shape[0] in LINEAR_TOKENS and qweight_type == Q6_K
            and x.dtype in (torch.float16, torch.bfloat16) and enabled())


@dataclasses.dataclass(frozen=True)
class Q6KLaunch:
    """One launch of the kernel: token rows and weight rows a tile, K splits, warps."""

    block_m: int
    block_n: int
    split_k: int = 1
    num_warps: int = 4


# its activation loads are 4 bytes a thread, enough for cp.async (16 rows on 8 warps
# load 2 and wait); no spills on SM80, SM90 and SM120 (the tests)
TILE = Q6KLaunch(32, 64, num_warps=8)
MIN_BLOCKS_A_SPLIT = 4  # a K split reads at least this many blocks of a row
WAVES = 2  # programs to fill the GPU: this many per SM


def launch(m: int, n: int, k_blocks: int, sms: int) -> Q6KLaunch:
    """The launch of an [m, K] x [n, K]^T product, K = k_blocks * 256: TILE, with K split
    in two until the tiles fill WAVES programs per SM or a split would read fewer than
    MIN_BLOCKS_A_SPLIT blocks of a row."""
    tiles = triton.cdiv(m, TILE.block_m) * triton.cdiv(n, TILE.block_n)
    split_k = 1
    while tiles * split_k < WAVES * sms and k_blocks // (2 * split_k) >= MIN_BLOCKS_A_SPLIT:
        split_k *= 2
    return dataclasses.replace(TILE, split_k=split_k)


@triton.jit
def _q6_k_rows_dot(x_rows, m_mask, rows, n_mask, k_first, K_BLOCKS, SPLIT_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """x_rows [BLOCK_M] (pointers to activation rows) times the Q6_K weight rows `rows`
    [BLOCK_N] (pointers to their first block) over the blocks k_first, k_first + SPLIT_K,
    ...: [BLOCK_M, BLOCK_N] float32.

    A Q6_K block (ggml's block_q6_K) holds 256 values as two halves of 128; in half h,
    value 32 * c + 16 * j + l (quarter c, sub-block j, l < 16) is q - 32 times d *
    scales[8h + 2c + j], q = low | high << 4, low the low (c < 2) or high nibble of
    ql[64h + 32 * (c % 2) + 16j + l], high bits 2c, 2c + 1 of qh[32h + 16j + l]; ql at
    byte 0, qh at 128, the int8 scales at 192, d (float16) at 208. Each sub-block's
    q - 32 (exact in 16 bits) goes through the dot and its scale multiplies the float32
    result, so that no weight is rounded.
    """
    offs_l = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(k_first, K_BLOCKS, SPLIT_K):
        blk = rows + kb * 210
        d_bits = (tl.load(blk + 208, mask=n_mask, other=0).to(tl.uint16)
                  | (tl.load(blk + 209, mask=n_mask, other=0).to(tl.uint16) << 8))
        d = d_bits.to(tl.float16, bitcast=True).to(tl.float32)
        for h in range(2):  # a loop, not unrolled: a half-block's tiles live at a time
            for j in tl.static_range(2):
                qh = tl.load(blk[:, None] + (128 + 32 * h + 16 * j + offs_l)[None, :],
                             mask=n_mask[:, None], other=0)
                for odd in tl.static_range(2):
                    ql = tl.load(blk[:, None] + (64 * h + 32 * odd + 16 * j + offs_l)[None, :],
                                 mask=n_mask[:, None], other=0)
                    for nibble in tl.static_range(2):
                        c = odd + 2 * nibble
                        low = (ql >> 4) if nibble == 1 else (ql & 0xF)
                        q = (low | (((qh >> (2 * c)) & 0x3) << 4)).to(tl.int16)
                        sc = tl.load(blk + 192 + 8 * h + 2 * c + j, mask=n_mask, other=0)
                        scale = sc.to(tl.int8, bitcast=True).to(tl.float32) * d
                        xs = tl.load(x_rows[:, None] + (kb * 256 + 128 * h + 32 * c + 16 * j
                                                        + offs_l)[None, :],
                                     mask=m_mask[:, None], other=0.0)
                        # q - 32 as 16 bits from the exponent bits of 1024 (float16) or
                        # 128 (bfloat16) with q in the mantissa: no conversion instruction
                        if xs.dtype == tl.float16:
                            w = (q | 0x6400).to(tl.float16, bitcast=True) - 1056.0
                        else:
                            w = (q | 0x4300).to(tl.bfloat16, bitcast=True) - 160.0
                        part = tl.dot(xs, tl.trans(w))
                        acc += part * scale[None, :]
    return acc


# one compile for every token count: the output head runs outside CUDA graphs, where a
# count new to the process (M % 16 differs) would compile mid-decode
@triton.jit(do_not_specialize=["M", "stride_ys"])
def _q6_k_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K_BLOCKS, stride_xm, stride_wn,
                      stride_ys, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    """y[s] = x @ dequant(w).T over the blocks s, s + SPLIT_K, ... of each row."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = _q6_k_rows_dot(x_ptr + offs_m.to(tl.int64) * stride_xm, m_mask,
                         w_ptr + offs_n.to(tl.int64) * stride_wn, n_mask, pid_k, K_BLOCKS,
                         SPLIT_K, BLOCK_M, BLOCK_N)
    y = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def mul_mat(x: torch.Tensor, qweight: torch.Tensor,
            config: Q6KLaunch | None = None) -> torch.Tensor:
    """x [M, K] (float16/bfloat16) @ dequant(qweight).T, qweight [n, >= K / 256 * 210]
    Q6_K blocks (a padded row's tail is not read); [M, n] in x's dtype."""
    m, k = x.shape
    n, row_bytes = qweight.shape
    if k % Q6_K_BLOCK or row_bytes < k // Q6_K_BLOCK * Q6_K_BYTES:
        raise ValueError(f"Q6_K product: {k} inputs against weight rows of {row_bytes} bytes")
    k_blocks = k // Q6_K_BLOCK
    x = x.contiguous()
    if config is None:
        config = launch(m, n, k_blocks, _sms(x.device) if x.is_cuda else 1)
    out = torch.empty((config.split_k, m, n), device=x.device,
                      dtype=x.dtype if config.split_k == 1 else torch.float32)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), config.split_k)
    _q6_k_gemm_kernel[grid](x, qweight, out, m, n, k_blocks, x.stride(0), qweight.stride(0),
                            out.stride(0), out.stride(1), BLOCK_M=config.block_m,
                            BLOCK_N=config.block_n, SPLIT_K=config.split_k,
                            num_warps=config.num_warps)
    return out[0] if config.split_k == 1 else out.sum(0).to(x.dtype)
