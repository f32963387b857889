# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Portable logits kernels of the DeepSeek-V3.2 / GLM-5 sparse attention indexer.

The lightning indexer scores every key position s of a query token t as

    logits[t, s] = scale_k[s] * sum_h w[t, h] * relu(q[t, h] . k[s])

with q and k in fp8 e4m3 (per-token q scales are folded into w by the caller)
and one fp32 scale per key. DeepGEMM implements this (`fp8_fp4_mqa_logits`,
`fp8_fp4_paged_mqa_logits`) where vLLM's platform supports DeepGEMM: SM90, the
SM100 family and, with the DeepGEMM vLLM 0.26 vendors, the SM120 family. The
Triton kernels here run on every GPU from SM80 on, reading the same inputs:

- prefill: q [M, H, D] fp8, gathered k [N, D] fp8 with scales [N] fp32, per-row
  key bounds [ks, ke); logits [M, N] fp32.
- decode: q [B, next_n, H, D] fp8, the indexer's paged K cache (per block of BS
  tokens: BS x D fp8 values, then BS fp32 scales), per-row context lengths
  [B, next_n] and block tables; logits [B * next_n, max_model_len] fp32.

They compute q . k with fp8 tensor-core dots where the GPU has them (SM89+) and
with 16-bit dots elsewhere (SM80/86): q and k are then read as bytes and their
e4m3 bit patterns converted to fp16 in registers (exact: every e4m3 value is an
fp16 value), since Triton has no e4m3 type below SM89. Same inputs, same
outputs, fp32 accumulation either way.

Positions outside a row's valid range are -inf where a program touches them and
otherwise left unwritten, as DeepGEMM's `clean_logits=False`; the top-k kernels
only read the valid range. No host synchronisation: launch shapes depend only on
tensor shapes.

The platform chooses the implementation: DeepGEMM where it is installed and the
platform supports it (`support_deep_gemm`, which upstream's indexer relies on), so
the Triton kernels run on SM80/86/89 and on GPUs DeepGEMM has no kernels for; and
the Triton kernels' dots: fp8 where the GPU has them (compute capability 8.9+),
16-bit elsewhere. Tests emulate another GPU's path through what the platform reports
(tests/plugins/vllm_report_capability), not through a setting of their own.

`VLLM_SPARSE_INDEXER_CACHE` = fp8 (default) | 16bit chooses the key cache of
DeepSeek-V3.2 / GLM-5's indexer (vLLM's deepseek_v2 model): 16bit stores the keys in
the model's dtype (128 x 2 bytes a token instead of 128 fp8 bytes and a scale) and
leaves the queries unquantized, as llama.cpp's indexer does; the logits then take
16-bit q and k (no scales) on the Triton kernels, with 16-bit dots, whatever backend
computes fp8 keys. fp8 rounding of q and k moves the top-k selection where scores
are close; the 16-bit cache avoids that at twice the indexer cache's bytes.
"""

import functools
import os

import torch

from vllm.logger import init_logger
from vllm.overlay_switches import register_switches
from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton

logger = init_logger(__name__)

CACHE_ENV = "VLLM_SPARSE_INDEXER_CACHE"
# the dtypes of the 16-bit key cache's keys (and queries): the model's
KEYS16_DTYPES = (torch.float16, torch.bfloat16)


def _cache_switch() -> str:
    """VLLM_SPARSE_INDEXER_CACHE as set (lower case, fp8 where unset), not validated."""
    return os.environ.get(CACHE_ENV, "fp8").strip().lower()


# the key cache's switch as a vLLM environment variable: it sets what the traced indexer
# computes (the queries quantized to fp8 or not), so a graph compiled for one value must
# not load for the other
register_switches({CACHE_ENV: _cache_switch})
# persistent_topk's FilteredTopK plan needs this much opt-in shared memory per
# block; below it (SM86/89/12x, ~99 KB) the oversubscription fallback can fail.
PERSISTENT_TOPK_MIN_SMEM = 128 * 1024


@functools.cache
def indexer_logits_backend() -> str:
    """'deepgemm' or 'triton' for the indexer logits on this CUDA device.

    Not `is_deep_gemm_supported()`: its VLLM_USE_DEEP_GEMM switch is about
    DeepGEMM's GEMMs, and upstream's indexer uses DeepGEMM regardless of it.
    """
    from vllm.utils.import_utils import has_deep_gemm

    if has_deep_gemm() and current_platform.support_deep_gemm():
        return "deepgemm"
    return "triton"


def deep_gemm_computes(keys_dtype: torch.dtype) -> bool:
    """Whether DeepGEMM computes the logits over keys of this dtype: fp8 keys where it
    is the chosen backend; 16-bit keys always take the Triton kernels."""
    return keys_dtype not in KEYS16_DTYPES and indexer_logits_backend() == "deepgemm"


def indexer_cache_16bit() -> bool:
    """Whether the indexer's key cache holds 16-bit keys (VLLM_SPARSE_INDEXER_CACHE)."""
    choice = _cache_switch()
    if choice not in ("fp8", "16bit"):
        raise ValueError(f"{CACHE_ENV}={choice!r}: expected fp8 or 16bit")
    return choice == "16bit"


def _fp8_dot_supported() -> bool:
    """fp8 tensor-core dots, and e4m3 as a Triton type: compute capability 8.9+.

    Read from `get_device_capability`, which the platform caches: this runs per indexer
    layer and step (the Triton logits, the decode queries' padding), and vLLM 0.26.0's
    NVML platform opened and shut NVML at every `has_device_capability` call (the
    overlay's `cuda.py` no longer does). Same answer: has_device_capability compares
    this capability."""
    capability = current_platform.get_device_capability()
    return capability is not None and capability.to_int() >= 89


def triton_indexer_dots() -> str:
    """'fp8' or '16bit': the dots of the Triton kernels, by the GPU's capability.

    '16bit' reads q and k as bytes and converts them to fp16 in registers: the
    path of GPUs without fp8 dots (SM80/86). Read per call (cheap), so that it
    follows the capability tests and the test hook report.
    """
    return "fp8" if _fp8_dot_supported() else "16bit"


def check_triton_indexer_supported(keys16: bool = False) -> None:
    """The Triton kernels need 16-bit tensor-core dots (compute capability 8.0+).
    keys16: an indexer layer with the 16-bit key cache, which the Triton kernels
    compute whatever the backend of fp8 keys (DeepGEMM reads fp8 keys only), with
    16-bit dots."""
    if not current_platform.has_device_capability(80):
        raise RuntimeError(
            "The portable sparse attention indexer (DeepSeek-V3.2 / GLM-5) needs "
            "compute capability 8.0 or newer; this GPU reports "
            f"{current_platform.get_device_capability()}."
        )
    if keys16:
        logger.info_once(
            "Sparse attention indexer: Triton logits kernels on 16-bit keys and "
            "queries (%s=16bit).",
            CACHE_ENV,
        )
        return
    logger.info_once(
        "Sparse attention indexer: Triton logits kernels with %s dots.",
        "fp8" if triton_indexer_dots() == "fp8" else "16-bit (fp8 converted in registers)",
    )


def use_persistent_topk(topk_tokens: int) -> bool:
    # Called per layer and step: the platform reads the device property once.
    if topk_tokens not in (512, 1024, 2048):
        return False
    optin = current_platform.get_max_shared_memory_per_block(torch.cuda.current_device())
    return optin >= PERSISTENT_TOPK_MIN_SMEM


@torch.compiler.assume_constant_result
def e4m3_as_bytes() -> bool:
    """Whether Triton kernels on the indexer's CUDA path take fp8 e4m3 tensors as
    bytes (uint8): with 16-bit dots, where Triton has no e4m3 type (SM80/86).

    A constant to torch.compile: the q quantization asks it inside the compiled
    model, where the platform's capability query (NVML) cannot be traced. The
    capability is in the compile cache's key: the GPU's name (Inductor's system
    factors), or the test hook's registered variable where it reports another.
    """
    return current_platform.is_cuda() and triton_indexer_dots() == "16bit"


@triton.jit
def e4m3_bytes_to_f16(x, ASM: tl.constexpr):
    """e4m3 bit patterns (uint8) -> fp16 holding each value times 2^-8, exactly.

    The sign goes to bit 15 and the exponent and mantissa bits (6..0) to bits
    13..7: fp16 reads the 4-bit exponent with its bias of 15 instead of e4m3's 7,
    so normals and subnormals alike come out scaled by 2^-8 (e4m3's subnormals
    become fp16 subnormals). The e4m3fn NaN pattern (0x7f) is read as 480 * 2^-8.
    ASM: four bytes at a time in inline PTX, 2 instructions a value (CUDA): each
    byte moved to the top of its 16-bit half, the sign cleared, shifted down by one,
    the sign put back. Else integer operations (the interpreter; on a GPU they
    compile to ~10 instructions a value).
    """
    if ASM:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 a<2>, b<2>;
            prmt.b32 a0, 0, $2, 0x5040;
            prmt.b32 a1, 0, $2, 0x7060;
            lop3.b32 b0, a0, 0x7fff7fff, 0, 0xc0;
            lop3.b32 b1, a1, 0x7fff7fff, 0, 0xc0;
            shr.b32 b0, b0, 1;
            shr.b32 b1, b1, 1;
            lop3.b32 $0, b0, 0x80008000, a0, 0xf8;
            lop3.b32 $1, b1, 0x80008000, a1, 0xf8;
            }""",
            "=r,=r,r",
            [x],
            dtype=tl.float16,
            is_pure=True,
            pack=4,
        )
    u = x.to(tl.uint16)
    bits = ((u & 0x80) << 8) | ((u & 0x7F) << 7)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def f32_to_e4m3(x, dtype: tl.constexpr):
    """fp32 values within +-448 as e4m3 of `dtype`, rounded to nearest even.

    dtype fp8e4nv converts; uint8 (GPUs whose Triton has no e4m3 type, SM80/86)
    gives the same e4m3 bit patterns from fp32 bits: normals drop 20 mantissa
    bits with round-to-nearest-even and rebias the exponent (a carry rounds up
    into the next binade); below 2^-6, adding 2^14 (whose fp32 spacing is 2^-9)
    rounds to the nearest multiple of 2^-9, whose count is the subnormal's 3-bit
    mantissa (a count of 8 is 2^-6, the first normal).
    """
    if dtype == tl.uint8:
        bits = x.to(tl.uint32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
        subnormal = (tl.abs(x) + 16384.0).to(tl.uint32, bitcast=True) - 0x46800000
        e4m3 = tl.where(mag >= 0x3C800000, normal, subnormal) | ((bits >> 24) & 0x80)
        return e4m3.to(tl.uint8)
    return x.to(dtype)


# A prefill's token and key counts (and the logits' row stride, the key count) take
# every value while serving: specialized, each class Triton tells apart (1, a multiple
# of 16, neither) compiles at its first launch while every request waits.
@triton.jit(do_not_specialize=["M", "N", "stride_om"])
def _mqa_logits_kernel(
    Q,
    K,
    KS,
    W,
    CU_KS,
    CU_KE,
    OUT,
    M,
    N,
    stride_qm,
    stride_qh,
    stride_km,
    stride_wm,
    stride_om,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    ASM: tl.constexpr,
    KEYS16: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    ks = tl.load(CU_KS + offs_m, mask=mask_m, other=N)
    ke = tl.load(CU_KE + offs_m, mask=mask_m, other=0)
    # Skip key tiles that no row of this tile may see.
    if (pid_n * BLOCK_N < tl.max(ke)) & ((pid_n + 1) * BLOCK_N > tl.min(ks)):
        offs_d = tl.arange(0, D)
        mask_n = offs_n < N
        k = tl.load(
            K + offs_n[:, None].to(tl.int64) * stride_km + offs_d[None, :],
            mask=mask_n[:, None],
            other=0.0,
        )
        if not KEYS16:
            k_scale = tl.load(KS + offs_n, mask=mask_n, other=0.0)
        # All heads of BLOCK_M rows form the M dimension of one dot.
        offs_mh = tl.arange(0, BLOCK_M * H)
        row = pid_m * BLOCK_M + offs_mh // H
        head = offs_mh % H
        q = tl.load(
            Q + row[:, None].to(tl.int64) * stride_qm
            + head[:, None] * stride_qh + offs_d[None, :],
            mask=(row < M)[:, None],
            other=0.0,
        )
        w = tl.load(W + row.to(tl.int64) * stride_wm + head, mask=row < M, other=0.0)
        if UPCAST:
            # 16-bit dots: q and k are e4m3 bytes, as fp16 they carry 2^-8 each
            q = e4m3_bytes_to_f16(q, ASM)
            k = e4m3_bytes_to_f16(k, ASM)
            k_scale = k_scale * 65536.0
        s = tl.dot(q, tl.trans(k))  # [BLOCK_M * H, BLOCK_N], fp32
        s = tl.maximum(s, 0.0) * w[:, None]
        logits = tl.sum(tl.reshape(s, (BLOCK_M, H, BLOCK_N)), axis=1)
        if not KEYS16:
            logits = logits * k_scale[None, :]
        valid = (offs_n[None, :] >= ks[:, None]) & (offs_n[None, :] < ke[:, None])
        logits = tl.where(valid, logits, float("-inf"))
        tl.store(
            OUT + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
            logits,
            mask=mask_m[:, None] & mask_n[None, :],
        )


def triton_mqa_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor | None,
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    upcast: bool | None = None,
) -> torch.Tensor:
    """Prefill logits [M, N] (see module docstring).

    16-bit q and k (the 16-bit key cache) take no k_scale; fp8 ones, upcast:
    16-bit dots (q and k read as bytes); None: `triton_indexer_dots()`.
    """
    M, H, D = q.shape
    N = k.shape[0]
    keys16 = k.dtype in KEYS16_DTYPES
    assert k.shape[1] == D and weights.shape == (M, H)
    assert (k_scale is None and q.dtype == k.dtype) if keys16 else k_scale.numel() == N
    assert q.stride(2) == 1 and k.stride(1) == 1 and weights.stride(1) == 1
    out = torch.empty(M, N, dtype=torch.float32, device=q.device)
    if M == 0 or N == 0:
        return out
    if keys16:
        upcast = False
    elif upcast is None:
        upcast = triton_indexer_dots() == "16bit"
    if upcast:
        q, k = q.view(torch.uint8), k.view(torch.uint8)
    block_m = max(1, 128 // H)
    block_n = 128
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _mqa_logits_kernel[grid](
        q,
        k,
        k if keys16 else k_scale.reshape(-1),
        weights,
        cu_seqlen_ks,
        cu_seqlen_ke,
        out,
        M,
        N,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        weights.stride(0),
        out.stride(0),
        H=H,
        D=D,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        UPCAST=upcast,
        ASM=q.is_cuda and current_platform.is_cuda(),
        KEYS16=keys16,
        num_warps=8,
    )
    return out


@triton.jit
def _paged_mqa_logits_kernel(
    Q,
    KV_VALUES,
    KV_SCALES,
    W,
    SEQ_LENS,
    BLOCK_TABLE,
    OUT,
    max_model_len,
    stride_qr,
    stride_qh,
    stride_wr,
    stride_bt,
    stride_block,
    stride_or,
    NEXT_N: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    UPCAST: tl.constexpr,
    ASM: tl.constexpr,
    KEYS16: tl.constexpr,
):
    r = tl.program_id(0)
    split = tl.program_id(1)
    # the grid's splits, not a constant: a mixed batch's decode rows (eager) take
    # every count, and a constant would compile once per count under load
    splits = tl.num_programs(1)
    seq_len = tl.load(SEQ_LENS + r)
    req = r // NEXT_N
    offs_h = tl.arange(0, H)
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, BS)
    q = tl.load(Q + r.to(tl.int64) * stride_qr + offs_h[:, None] * stride_qh + offs_d[None, :])
    if UPCAST:
        # 16-bit dots: q and the keys are e4m3 bytes, as fp16 they carry 2^-8 each
        q = e4m3_bytes_to_f16(q, ASM)
    w = tl.load(W + r.to(tl.int64) * stride_wr + offs_h)
    for blk in range(split, tl.cdiv(seq_len, BS), splits):
        phys = tl.load(BLOCK_TABLE + req.to(tl.int64) * stride_bt + blk).to(tl.int64)
        base = phys * stride_block  # elements (fp8: bytes)
        k = tl.load(KV_VALUES + base + offs_t[:, None] * D + offs_d[None, :])
        if not KEYS16:
            k_scale = tl.load(KV_SCALES + (base + BS * D) // 4 + offs_t)
        if UPCAST:
            k = e4m3_bytes_to_f16(k, ASM)
            k_scale = k_scale * 65536.0
        s = tl.dot(q, tl.trans(k))  # [H, BS]
        s = tl.maximum(s, 0.0) * w[:, None]
        logits = tl.sum(s, axis=0)
        if not KEYS16:
            logits = logits * k_scale
        pos = blk * BS + offs_t
        logits = tl.where(pos < seq_len, logits, float("-inf"))
        tl.store(OUT + r.to(tl.int64) * stride_or + pos, logits, mask=pos < max_model_len)


def triton_paged_mqa_logits(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_model_len: int,
    upcast: bool | None = None,
) -> torch.Tensor:
    """Decode logits [B * next_n, max_model_len] (see module docstring).

    kv_cache: the indexer cache, uint8 [num_blocks, BS, D + 4] (or a view with
    a unit head dimension), or the 16-bit key cache [num_blocks, BS, D] in q's
    dtype; seq_lens: int32 [B, next_n] (or [B] for next_n 1); upcast (fp8
    keys): 16-bit dots (q and keys read as bytes); None: `triton_indexer_dots()`.
    """
    B, next_n, H, D = q.shape
    num_blocks, bs = kv_cache.shape[0], kv_cache.shape[1]
    keys16 = kv_cache.dtype in KEYS16_DTYPES
    if keys16:
        assert q.dtype == kv_cache.dtype and kv_cache.stride(0) == bs * D
    else:
        assert kv_cache.dtype == torch.uint8 and kv_cache.stride(0) == bs * (D + 4)
    rows = B * next_n
    out = torch.empty(rows, max_model_len, dtype=torch.float32, device=q.device)
    if rows == 0:
        return out
    if keys16:
        upcast = False
    elif upcast is None:
        upcast = triton_indexer_dots() == "16bit"
    seq_lens = seq_lens.reshape(-1)
    assert seq_lens.numel() == rows
    q = q.reshape(rows, H, D)
    assert q.stride(2) == 1 and weights.stride(1) == 1 and block_table.stride(1) == 1
    flat = kv_cache.reshape(num_blocks, -1)
    if upcast:
        q = q.view(torch.uint8)
    num_sms = current_platform.num_compute_units() if q.is_cuda else 8
    splits = max(1, min(64, triton.cdiv(2 * num_sms, rows)))
    if keys16:
        values, scales = flat, flat  # no scales
    else:
        values = flat if upcast else flat.view(current_platform.fp8_dtype())
        scales = flat.view(torch.float32)
    _paged_mqa_logits_kernel[(rows, splits)](
        q,
        values,
        scales,
        weights,
        seq_lens.contiguous(),
        block_table,
        out,
        max_model_len,
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        block_table.stride(0),
        flat.stride(0),
        out.stride(0),
        NEXT_N=next_n,
        H=H,
        D=D,
        BS=bs,
        UPCAST=upcast,
        ASM=q.is_cuda and current_platform.is_cuda(),
        KEYS16=keys16,
        num_warps=4,
    )
    return out


@triton.jit
def _write_k_cache_16bit_kernel(K, CACHE, SLOTS, stride_k, D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:
        offs_d = tl.arange(0, D)
        k = tl.load(K + t.to(tl.int64) * stride_k + offs_d)
        tl.store(CACHE + slot * D + offs_d, k)


def write_k_cache_16bit(
    k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store keys [T, D] into the 16-bit key cache [num_blocks, BS, D] at their
    slots (block * BS + offset); a slot of -1 (padding) is skipped. The 16-bit
    cache's `ops.indexer_k_quant_and_cache`."""
    T, D = k.shape
    num_blocks, bs = kv_cache.shape[0], kv_cache.shape[1]
    if k.dtype != kv_cache.dtype:
        raise TypeError(
            f"indexer keys are {k.dtype}, the 16-bit key cache {kv_cache.dtype}"
        )
    assert kv_cache.stride(0) == bs * D and kv_cache.stride(1) == D
    assert k.stride(1) == 1 and slot_mapping.numel() >= T
    if T == 0:
        return
    _write_k_cache_16bit_kernel[(T,)](
        k, kv_cache, slot_mapping, k.stride(0), D=D, num_warps=1
    )


@triton.jit
def _gather_k_cache_16bit_kernel(
    CACHE,
    OUT,
    BLOCK_TABLE,
    CU_SEQ_LENS,
    batch_size,
    num_tokens,
    stride_bt,
    stride_block,
    stride_out,
    BS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D)
    # The request of each output row: cu_seq_lens[b] <= t < cu_seq_lens[b + 1].
    req = tl.full((BLOCK_T,), -1, tl.int32)
    for b in range(batch_size):
        start = tl.load(CU_SEQ_LENS + b)
        end = tl.load(CU_SEQ_LENS + b + 1)
        req = tl.where((offs_t >= start) & (offs_t < end), b, req)
    valid = (req >= 0) & (offs_t < num_tokens)
    req = tl.maximum(req, 0)
    pos = offs_t - tl.load(CU_SEQ_LENS + req, mask=valid, other=0)
    phys = tl.load(
        BLOCK_TABLE + req.to(tl.int64) * stride_bt + pos // BS, mask=valid, other=0
    ).to(tl.int64)
    src = phys * stride_block + (pos % BS).to(tl.int64) * D
    k = tl.load(CACHE + src[:, None] + offs_d[None, :], mask=valid[:, None])
    tl.store(
        OUT + offs_t[:, None].to(tl.int64) * stride_out + offs_d[None, :],
        k,
        mask=valid[:, None],
    )


def gather_k_cache_16bit(
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
) -> None:
    """Gather the keys of each request's first cu_seq_lens[b + 1] - cu_seq_lens[b]
    positions from the 16-bit key cache into rows [cu_seq_lens[b], cu_seq_lens[b + 1])
    of out [T, D]; rows past cu_seq_lens[-1] are left as they are. The 16-bit
    cache's `ops.cp_gather_indexer_k_quant_cache` (out's T may be an upper bound:
    no host synchronisation)."""
    num_blocks, bs, D = kv_cache.shape[0], kv_cache.shape[1], out.shape[1]
    assert out.dtype == kv_cache.dtype and out.stride(1) == 1
    assert kv_cache.stride(0) == bs * D and kv_cache.stride(1) == D
    assert block_table.stride(1) == 1
    T = out.shape[0]
    if T == 0:
        return
    block_t = 32
    _gather_k_cache_16bit_kernel[(triton.cdiv(T, block_t),)](
        kv_cache,
        out,
        block_table,
        cu_seq_lens,
        cu_seq_lens.numel() - 1,
        T,
        block_table.stride(0),
        kv_cache.stride(0),
        out.stride(0),
        BS=bs,
        D=D,
        BLOCK_T=block_t,
        num_warps=4,
    )


def mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv: tuple[torch.Tensor, torch.Tensor | None],
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    clean_logits: bool,
) -> torch.Tensor:
    """`vllm.utils.deep_gemm.fp8_fp4_mqa_logits` on the chosen backend (16-bit keys:
    the Triton kernel)."""
    if deep_gemm_computes(kv[0].dtype):
        from vllm.utils.deep_gemm import fp8_fp4_mqa_logits

        return fp8_fp4_mqa_logits(
            q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits=clean_logits
        )
    q_values, q_scale = q
    if q_scale is not None:
        raise NotImplementedError("the Triton indexer has no MXFP4 path; use DeepGEMM")
    k, k_scale = kv
    return triton_mqa_logits(q_values, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke)


def paged_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    schedule_metadata: torch.Tensor,
    max_model_len: int,
    clean_logits: bool,
) -> torch.Tensor:
    """`vllm.utils.deep_gemm.fp8_fp4_paged_mqa_logits` on the chosen backend (the
    16-bit key cache: the Triton kernel)."""
    if deep_gemm_computes(kv_cache.dtype):
        from vllm.utils.deep_gemm import fp8_fp4_paged_mqa_logits

        return fp8_fp4_paged_mqa_logits(
            q,
            kv_cache,
            weights,
            context_lens,
            block_tables,
            schedule_metadata,
            max_model_len=max_model_len,
            clean_logits=clean_logits,
        )
    q_values, q_scale = q
    if q_scale is not None:
        raise NotImplementedError("the Triton indexer has no MXFP4 path; use DeepGEMM")
    return triton_paged_mqa_logits(
        q_values, kv_cache, weights, context_lens, block_tables, max_model_len
    )
