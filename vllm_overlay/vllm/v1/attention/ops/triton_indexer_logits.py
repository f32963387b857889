# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Portable logits kernels of the DeepSeek-V3.2 / GLM-5 sparse attention indexer.

The lightning indexer scores every key position s of a query token t as

    logits[t, s] = scale_k[s] * sum_h w[t, h] * relu(q[t, h] . k[s])

with q and k in fp8 (per-token q scales are folded into w by the caller) and
one fp32 scale per key. DeepGEMM implements this (`fp8_fp4_mqa_logits`,
`fp8_fp4_paged_mqa_logits`) where vLLM's platform supports DeepGEMM: SM90, the
SM100 family and, with the DeepGEMM vLLM 0.26 vendors, the SM120 family. The
Triton kernels here run on every GPU with fp8 support (SM89+), reading the same
inputs:

- prefill: q [M, H, D] fp8, gathered k [N, D] fp8 with scales [N] fp32, per-row
  key bounds [ks, ke); logits [M, N] fp32.
- decode: q [B, next_n, H, D] fp8, the indexer's paged K cache (per block of BS
  tokens: BS x D fp8 values, then BS fp32 scales), per-row context lengths
  [B, next_n] and block tables; logits [B * next_n, max_model_len] fp32.

Positions outside a row's valid range are -inf where a program touches them and
otherwise left unwritten, as DeepGEMM's `clean_logits=False`; the top-k kernels
only read the valid range. No host synchronisation: launch shapes depend only on
tensor shapes.

`VLLM_SPARSE_INDEXER_LOGITS` = auto (default) | deepgemm | triton chooses the
implementation; auto takes DeepGEMM where it is installed and the platform
supports it (`support_deep_gemm`, which upstream's indexer relies on), so the
Triton kernels run on SM89 and on GPUs DeepGEMM has no kernels for.
"""

import functools
import os

import torch

from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton
from vllm.v1.attention.ops import triton_sparse_mla

logger = init_logger(__name__)

LOGITS_BACKEND_ENV = "VLLM_SPARSE_INDEXER_LOGITS"
# persistent_topk's FilteredTopK plan needs this much opt-in shared memory per
# block; below it (SM86/89/12x, ~99 KB) the oversubscription fallback can fail.
PERSISTENT_TOPK_MIN_SMEM = 128 * 1024


@functools.cache
def indexer_logits_backend() -> str:
    """'deepgemm' or 'triton' for the indexer logits on this CUDA device.

    Not `is_deep_gemm_supported()`: its VLLM_USE_DEEP_GEMM switch is about
    DeepGEMM's GEMMs, and upstream's indexer uses DeepGEMM regardless of it.
    """
    choice = os.environ.get(LOGITS_BACKEND_ENV, "auto").strip().lower()
    if choice not in ("auto", "deepgemm", "triton"):
        raise ValueError(
            f"{LOGITS_BACKEND_ENV}={choice!r}: expected auto, deepgemm or triton"
        )
    if choice != "auto":
        return choice
    from vllm.utils.import_utils import has_deep_gemm

    if has_deep_gemm() and current_platform.support_deep_gemm():
        return "deepgemm"
    return "triton"


def check_triton_indexer_supported() -> None:
    """The indexer keeps q and k in fp8, which needs compute capability 8.9+."""
    if not current_platform.has_device_capability(89):
        cap = current_platform.get_device_capability()
        raise RuntimeError(
            "The sparse attention indexer (DeepSeek-V3.2 / GLM-5) stores its "
            "queries and keys in fp8, which needs compute capability 8.9 or "
            f"newer; this GPU reports {cap}. SM80/SM86 GPUs cannot run "
            "sparse-attention models in this build."
        )


def use_persistent_topk(topk_tokens: int) -> bool:
    # Called per layer and step: the device property is read once per device.
    if topk_tokens not in (512, 1024, 2048):
        return False
    optin = triton_sparse_mla.device_shared_mem(torch.cuda.current_device())
    return optin >= PERSISTENT_TOPK_MIN_SMEM


def _fp8_dot_supported() -> bool:
    return current_platform.has_device_capability(89)


@triton.jit
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
            q = q.to(tl.float16)
            k = k.to(tl.float16)
        s = tl.dot(q, tl.trans(k))  # [BLOCK_M * H, BLOCK_N], fp32
        s = tl.maximum(s, 0.0) * w[:, None]
        logits = tl.sum(tl.reshape(s, (BLOCK_M, H, BLOCK_N)), axis=1)
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
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    upcast: bool | None = None,
) -> torch.Tensor:
    """Prefill logits [M, N] (see module docstring)."""
    M, H, D = q.shape
    N = k.shape[0]
    assert k.shape[1] == D and k_scale.numel() == N and weights.shape == (M, H)
    assert q.stride(2) == 1 and k.stride(1) == 1 and weights.stride(1) == 1
    out = torch.empty(M, N, dtype=torch.float32, device=q.device)
    if M == 0 or N == 0:
        return out
    if upcast is None:
        upcast = not _fp8_dot_supported()
    block_m = max(1, 128 // H)
    block_n = 128
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _mqa_logits_kernel[grid](
        q,
        k,
        k_scale.reshape(-1),
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
    SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    r = tl.program_id(0)
    split = tl.program_id(1)
    seq_len = tl.load(SEQ_LENS + r)
    req = r // NEXT_N
    offs_h = tl.arange(0, H)
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, BS)
    q = tl.load(Q + r.to(tl.int64) * stride_qr + offs_h[:, None] * stride_qh + offs_d[None, :])
    if UPCAST:
        q = q.to(tl.float16)
    w = tl.load(W + r.to(tl.int64) * stride_wr + offs_h)
    for blk in range(split, tl.cdiv(seq_len, BS), SPLITS):
        phys = tl.load(BLOCK_TABLE + req.to(tl.int64) * stride_bt + blk).to(tl.int64)
        base = phys * stride_block  # bytes == fp8 elements
        k = tl.load(KV_VALUES + base + offs_t[:, None] * D + offs_d[None, :])
        k_scale = tl.load(KV_SCALES + (base + BS * D) // 4 + offs_t)
        if UPCAST:
            k = k.to(tl.float16)
        s = tl.dot(q, tl.trans(k))  # [H, BS]
        s = tl.maximum(s, 0.0) * w[:, None]
        logits = tl.sum(s, axis=0) * k_scale
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
    a unit head dimension); seq_lens: int32 [B, next_n] (or [B] for next_n 1).
    """
    B, next_n, H, D = q.shape
    num_blocks, bs = kv_cache.shape[0], kv_cache.shape[1]
    assert kv_cache.dtype == torch.uint8 and kv_cache.stride(0) == bs * (D + 4)
    rows = B * next_n
    out = torch.empty(rows, max_model_len, dtype=torch.float32, device=q.device)
    if rows == 0:
        return out
    if upcast is None:
        upcast = not _fp8_dot_supported()
    seq_lens = seq_lens.reshape(-1)
    assert seq_lens.numel() == rows
    q = q.reshape(rows, H, D)
    assert q.stride(2) == 1 and weights.stride(1) == 1 and block_table.stride(1) == 1
    flat = kv_cache.reshape(num_blocks, -1)
    num_sms = current_platform.num_compute_units() if q.is_cuda else 8
    splits = max(1, min(64, triton.cdiv(2 * num_sms, rows)))
    _paged_mqa_logits_kernel[(rows, splits)](
        q,
        flat.view(current_platform.fp8_dtype()),
        flat.view(torch.float32),
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
        SPLITS=splits,
        UPCAST=upcast,
        num_warps=4,
    )
    return out


def mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    clean_logits: bool,
) -> torch.Tensor:
    """`vllm.utils.deep_gemm.fp8_fp4_mqa_logits` on the chosen backend."""
    if indexer_logits_backend() == "deepgemm":
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
    """`vllm.utils.deep_gemm.fp8_fp4_paged_mqa_logits` on the chosen backend."""
    if indexer_logits_backend() == "deepgemm":
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
