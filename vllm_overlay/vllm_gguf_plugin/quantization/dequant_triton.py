# SPDX-License-Identifier: Apache-2.0
"""Q4_K and Q6_K weights dequantized to 16 bits on Triton.

The products that dequantize their weight for a 16-bit GEMM (the dense ones of many
tokens, the routed experts' prefill) spent that time in the plugin's CUDA
`ggml_dequantize`: a 32- or 64-thread CTA a 256-value block, float16 arithmetic, about
1.1 TB/s on an H200, a quarter of its bandwidth. Here a warp decodes a block, each
thread 8 consecutive values of a sub-block (one 16-byte store of 16-bit values),
unpacking the codes 4 an instruction. The values are gguf-py's: computed in float32,
where every product is exact (a float16 d times a 6-bit or int8 scale times a 4- or
6-bit code fits 24 bits), and rounded once to the output's dtype.
"""

import dataclasses
import math

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from vllm.triton_utils import tl, triton

Q4_K = int(GGMLQuantizationType.Q4_K)
Q6_K = int(GGMLQuantizationType.Q6_K)
TYPES = {Q4_K, Q6_K}


@dataclasses.dataclass(frozen=True)
class DequantLaunch:
    """One launch: 256-value blocks a program (of one row: they divide its blocks, so
    that no program needs a mask), warps a program."""

    blocks: int
    num_warps: int


# 8 warps a program: programs of 1 warp fill only half an SM (32 programs at most, of
# its 64 warps)
MAX_BLOCKS = 8


def launch(row_blocks: int) -> DequantLaunch:
    """A warp a block (8 values a thread: one 16-byte store of float16/bfloat16), as
    many blocks a program as divide the row's, up to MAX_BLOCKS."""
    blocks = math.gcd(row_blocks, MAX_BLOCKS)
    return DequantLaunch(blocks, num_warps=blocks)


@triton.jit
def _small_int_to_float(q, bias: tl.constexpr):
    """q - bias as float32 (0 <= q < 2**23): q in the mantissa of 2**23 and one exact
    add, a full-rate instruction where a conversion is quarter-rate."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + bias)


@triton.jit
def _words(x):
    """[A, B, C] bytes as [A, B, C // 4] little-endian 32-bit words: the unpacking runs
    on 4 codes an instruction (byte by byte, LLVM packs them in 16-bit halves that
    ptxas unpacks again)."""
    x = tl.reshape(x.to(tl.uint32), (x.shape[0], x.shape[1], x.shape[2] // 4, 2, 2))
    lo, hi = tl.split(x)
    lo, hi = tl.split(lo | (hi << 8))
    return lo | (hi << 16)


@triton.jit
def _bytes_to_float(w, bias: tl.constexpr):
    """The bytes of [A, B, C] words, less bias, as [A, B, 4C] float32. The joins add
    dimensions held in-thread, so that each thread's values stay in its registers."""
    b0 = _small_int_to_float(w & 0xFF, bias)
    b1 = _small_int_to_float((w >> 8) & 0xFF, bias)
    b2 = _small_int_to_float((w >> 16) & 0xFF, bias)
    b3 = _small_int_to_float(w >> 24, bias)
    y = tl.join(tl.join(b0, b2), tl.join(b1, b3))  # [A, B, C, 2, 2]: byte 2 * a + b
    return tl.reshape(y, (w.shape[0], w.shape[1], 4 * w.shape[2]))


@triton.jit
def _tile(w_ptr, y_ptr, stride_w, row_blocks, BLOCK_BYTES: tl.constexpr,
          BLOCKS: tl.constexpr):
    """Program (row, tile)'s blocks: [BLOCKS, 1, 1] pointers to their bytes, and the
    pointer to their first output."""
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * BLOCKS
    b = tl.arange(0, BLOCKS)[:, None, None]
    blk = w_ptr + row * stride_w + (first + b) * BLOCK_BYTES
    return blk, y_ptr + (row * row_blocks + first) * 256


# the row's block count only offsets the output (by whole blocks): one compile for any
@triton.jit(do_not_specialize=["row_blocks"])
def _q4_k_kernel(w_ptr, y_ptr, stride_w, row_blocks, BLOCKS: tl.constexpr):
    """Q4_K (ggml's block_q4_K, 144 bytes): value 32j + l of a block (sub-block j < 8)
    is d * sc_j * q - dmin * m_j, q the low (j even) or high nibble of qs[32(j // 2) + l];
    d, dmin float16 at bytes 0 and 2, the 6-bit sc_j and m_j packed in bytes 4-15, qs
    at 16. Tile [BLOCKS, 8 (j), 32 (l)]."""
    blk, y_ptr = _tile(w_ptr, y_ptr, stride_w, row_blocks, 144, BLOCKS)
    j = tl.arange(0, 8)[None, :, None]
    l = tl.arange(0, 32)[None, None, :]
    d = tl.load(blk.to(tl.pointer_type(tl.float16))).to(tl.float32)
    dmin = tl.load((blk + 2).to(tl.pointer_type(tl.float16))).to(tl.float32)
    # sub-block j < 4: sc, m the low 6 bits of scales[j], scales[j + 4]; j >= 4: the
    # low and high nibbles of scales[j + 4], bits 4-5 the top 2 of scales[j - 4], scales[j]
    lo = tl.load(blk + 4 + j % 4)
    mid = tl.load(blk + 8 + j % 4)
    hi = tl.load(blk + 12 + j % 4)
    sc = tl.where(j < 4, lo & 63, (hi & 0xF) | ((lo >> 6) << 4))
    m = tl.where(j < 4, mid & 63, (hi >> 4) | ((mid >> 6) << 4))
    qs = _words(tl.load(blk + 16 + 32 * (j // 2) + l))
    q = _bytes_to_float((qs >> (4 * (j % 2))) & 0x0F0F0F0F, 0)
    y = (d * sc.to(tl.float32)) * q - dmin * m.to(tl.float32)
    b = tl.arange(0, BLOCKS)[:, None, None]
    tl.store(y_ptr + b * 256 + 32 * j + l, y.to(y_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["row_blocks"])
def _q6_k_kernel(w_ptr, y_ptr, stride_w, row_blocks, BLOCKS: tl.constexpr):
    """Q6_K (ggml's block_q6_K, 210 bytes): value 16s + i of a block (sub-block s < 16,
    in half n = s // 8 and quarter g = s // 2 % 4 of it, l = 16 (s % 2) + i) is
    d * scales[s] * (q - 32), q = low | high << 4, low the low (g < 2) or high nibble of
    ql[64n + 32 (g % 2) + l], high bits 2g, 2g + 1 of qh[32n + l]; ql at byte 0, qh at
    128, the int8 scales at 192, d (float16) at 208. Tile [BLOCKS, 16 (s), 16 (i)]."""
    blk, y_ptr = _tile(w_ptr, y_ptr, stride_w, row_blocks, 210, BLOCKS)
    s = tl.arange(0, 16)[None, :, None]
    i = tl.arange(0, 16)[None, None, :]
    n, g, l = s // 8, s // 2 % 4, 16 * (s % 2) + i
    d = tl.load((blk + 208).to(tl.pointer_type(tl.float16))).to(tl.float32)
    scale = tl.load(blk + 192 + s).to(tl.int8, bitcast=True).to(tl.float32)
    ql = _words(tl.load(blk + 64 * n + 32 * (g % 2) + l))
    qh = _words(tl.load(blk + 128 + 32 * n + l))
    q = ((ql >> (4 * (g // 2))) & 0x0F0F0F0F) | (((qh >> (2 * g)) & 0x03030303) << 4)
    y = (d * scale) * _bytes_to_float(q, 32)
    b = tl.arange(0, BLOCKS)[:, None, None]
    tl.store(y_ptr + b * 256 + 16 * s + i, y.to(y_ptr.dtype.element_ty))


_KERNELS = {Q4_K: _q4_k_kernel, Q6_K: _q6_k_kernel}


def dequantize(qweight: torch.Tensor, qweight_type: int, rows: int, cols: int,
               dtype: torch.dtype) -> torch.Tensor:
    """qweight [rows, cols / 256 * type bytes] (uint8, Q4_K or Q6_K blocks; the rows may
    lie further apart) as a new contiguous [rows, cols] tensor of dtype."""
    if qweight_type not in TYPES:
        raise ValueError(f"Triton dequantization takes Q4_K and Q6_K, not type {qweight_type}")
    block, block_bytes = GGML_QUANT_SIZES[qweight_type]
    if cols % block:
        raise ValueError(f"Triton dequantization: {cols} columns, not a multiple of {block}")
    row_blocks = cols // block
    row_bytes = row_blocks * block_bytes
    if tuple(qweight.shape) != (rows, row_bytes):
        raise ValueError(f"Triton dequantization: {rows} rows of {cols} values are "
                         f"[{rows}, {row_bytes}] bytes, not {list(qweight.shape)}")
    # the float16 fields load as such: every block 2-byte aligned
    assert (qweight.dtype == torch.uint8 and qweight.stride(1) == 1
            and qweight.stride(0) % 2 == 0 and qweight.data_ptr() % 2 == 0), \
        "qweight: rows of contiguous bytes, 2-byte aligned"
    out = torch.empty((rows, cols), dtype=dtype, device=qweight.device)
    config = launch(row_blocks)
    _KERNELS[qweight_type][(rows, row_blocks // config.blocks)](
        qweight, out, qweight.stride(0), row_blocks, BLOCKS=config.blocks,
        num_warps=config.num_warps)
    return out
