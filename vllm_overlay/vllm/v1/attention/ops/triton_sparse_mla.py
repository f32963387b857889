# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sparse MLA attention (DeepSeek-V3.2 / GLM-5 DSA) as one gather kernel.

Each query token attends to its own top-k KV-cache slots (global slot ids, -1
padding after the valid ones). Unlike a paged decode kernel with a page size of
1, this kernel

- reads every selected KV row once for a block of up to 64 local heads: the heads
  are the M dimension of the tensor-core dots (QK^T over 512 + 64, PV over 512);
- gathers the rows by slot directly (no block-table indirection);
- splits a token's top-k over several programs when there are few tokens, and
  merges the partial results by their log-sum-exp in a second small kernel;
- reads an fp8 cache as is and dequantizes on load (the per-tensor scale is
  applied to the scores and the output, or to the tile, so the dots stay in 16
  bits).

Launch parameters come from the shapes, the KV dtype and the device's compute
capability and shared memory per block only (a table, no host sync), so the
kernels are stable under CUDA graph capture.
"""

import functools
import importlib

import torch

import vllm.envs as envs
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton

logger = init_logger(__name__)

# Upper bound for the split-K partial results (fp32 [T, H, splits, D_V]).
_MAX_PARTIAL_BYTES = 32 * 1024 * 1024

# Opt-in shared memory per block: 227 KiB on SM 9.0 and 10.0, 163 KiB on 8.0,
# 99 KiB on 8.6, 8.9 and 12.x. The key block of 32- and 64-head tiles is sized
# to it (every table entry is compiled for each architecture and checked against
# its limit in tests/v1/attention/test_triton_mla_sparse_targets.py).
_MEDIUM_SHARED_MEM = 120 * 1024  # 32 rows
HOPPER_SHARED_MEM = 227 * 1024
# slots per split of `gluon_sparse_mla_fp8`'s tile (its slot ids live in shared memory)
ROWS_IN_M_MAX_SLOTS = 2048


@functools.cache
def device_shared_mem(device_index: int) -> int:
    """Opt-in shared memory per block of a CUDA device (read once per device)."""
    return current_platform.get_max_shared_memory_per_block(device_index)


@functools.cache
def device_capability(device_index: int) -> int:
    """Compute capability of a CUDA device as major * 10 + minor (e.g. 90, 120)."""
    return current_platform.get_device_capability(device_index).to_int()


@triton.jit
def _sparse_mla_kernel(
    Q,
    KV,
    Slots,
    Counts,
    KScale,
    O,
    Lse,
    sm_scale,
    stride_qt,
    stride_qh,
    stride_kv,
    stride_st,
    stride_ot,
    stride_oh,
    stride_os,
    stride_lt,
    stride_lh,
    num_heads,
    split_len,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_V: tl.constexpr,
    D_R: tl.constexpr,
    KV_FP8: tl.constexpr,
    PARTIAL: tl.constexpr,
    V_RELOAD: tl.constexpr,
):
    # heads fastest: the programs of one token run together and share its rows in L2
    hb = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    s = tl.program_id(2)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_v = tl.arange(0, D_V)
    offs_r = tl.arange(0, D_R)
    q_row = Q + t * stride_qt + offs_h[:, None] * stride_qh
    q_nope = tl.load(q_row + offs_v[None, :], mask=mask_h[:, None], other=0.0)
    q_rope = tl.load(q_row + D_V + offs_r[None, :], mask=mask_h[:, None], other=0.0)

    count = tl.load(Counts + t)
    start = s * split_len
    end = tl.minimum(start + split_len, count)
    qk_scale = sm_scale * 1.4426950408889634  # log2(e): softmax in base 2
    if KV_FP8:
        k_scale = tl.load(KScale)
        qk_scale = qk_scale * k_scale

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D_V], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slot = tl.load(Slots + t * stride_st + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_row = KV + slot[:, None] * stride_kv
        k_nope = tl.load(kv_row + offs_v[None, :], mask=mask_n[:, None], other=0.0)
        k_rope = tl.load(kv_row + D_V + offs_r[None, :], mask=mask_n[:, None], other=0.0)
        if KV_FP8:
            k_nope = k_nope.to(q_nope.dtype)
            k_rope = k_rope.to(q_nope.dtype)
        qk = tl.dot(q_nope, tl.trans(k_nope))
        qk = tl.dot(q_rope, tl.trans(k_rope), qk)
        qk = tl.where(mask_n[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_RELOAD:
            # the rows again, a copy of its own for the PV dot (from L2; the cache
            # modifier keeps it from merging with the first): with one consumer per
            # copy the software pipeliner stages an fp8 tile, which it leaves as a
            # synchronous load when both dots take it through a conversion
            v = tl.load(kv_row + offs_v[None, :], mask=mask_n[:, None], other=0.0,
                        cache_modifier=".cg")
            if KV_FP8:
                # dequantized here, in fp32: a bare cast would be moved past the
                # tile's layout change for the dot, which then gathers single
                # bytes from shared memory
                v = (v.to(tl.float32) * k_scale).to(q_nope.dtype)
        else:
            v = k_nope
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if KV_FP8 and not V_RELOAD:
        out = out * k_scale  # V is the converted K tile, still unscaled
    o_ptr = O + t * stride_ot + s * stride_os + offs_h[:, None] * stride_oh + offs_v[None, :]
    tl.store(o_ptr, out.to(O.dtype.element_ty), mask=mask_h[:, None])
    if PARTIAL:
        # base-2 log-sum-exp of the split; -inf for a split without valid slots
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(Lse + t * stride_lt + offs_h * stride_lh + s, lse, mask=mask_h)


@triton.jit
def _sparse_mla_merge_kernel(
    Part,
    Lse,
    O,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    D_V: tl.constexpr,
):
    h = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_v = tl.arange(0, D_V)
    lse = tl.load(Lse + t * stride_lt + h * stride_lh + offs_s)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no valid slot at all: zeros below
    w = tl.exp2(lse - m)
    part = tl.load(Part + t * stride_pt + h * stride_ph + offs_s[:, None] * stride_ps
                   + offs_v[None, :])
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(O + t * stride_ot + h * stride_oh + offs_v, out.to(O.dtype.element_ty))


def _num_splits(num_tokens: int, num_heads: int, block_h: int, topk: int,
                kv_lora_rank: int, programs_per_wave: int, min_slots: int = 64) -> int:
    """Split-K count that brings the programs to about one wave (a power of two,
    rounded down; the H200 sweeps found more splits slower: each writes and reads
    back its fp32 partial rows), with at least `min_slots` slots per split."""
    # batch-invariant mode: a token's result must not depend on the batch size
    if envs.VLLM_BATCH_INVARIANT:
        return 1
    per_wave = programs_per_wave // (num_tokens * triton.cdiv(num_heads, block_h))
    if per_wave < 2:
        return 1
    splits = 1 << (per_wave.bit_length() - 1)
    splits = min(splits, max(1, triton.next_power_of_2(topk) // min_slots))
    per_split = num_tokens * num_heads * kv_lora_rank * 4  # fp32 partial rows
    while splits > 1 and splits * per_split > _MAX_PARTIAL_BYTES:
        splits //= 2
    return splits


def launch_config(
    num_tokens: int,
    num_heads: int,
    topk: int,
    kv_lora_rank: int,
    num_sms: int,
    max_shared_mem: int = HOPPER_SHARED_MEM,
    kv_fp8: bool = False,
    capability: int = 90,
    warp_specialized: bool = True,
) -> dict:
    """Block sizes, warps, stages and splits for a shape (no data, no host sync).

    max_shared_mem: the device's opt-in shared memory per block (bytes); kv_fp8:
    the cache is fp8; capability: major * 10 + minor.
    V_RELOAD (fp8 caches) reads the rows a second time for the PV dot instead of
    reusing the converted K tile.
    WARP_SPECIALIZED (Hopper; 64-head tiles, and fewer heads where it is faster; fp8
    caches in e4m3) runs the tile as `gluon_sparse_mla`'s warp-specialized kernel
    instead of `_sparse_mla_kernel` (the Triton parameters above stay its fallback);
    ROWS_IN_M (Hopper, an fp8 e4m3 cache, up to 32 heads) runs
    `gluon_sparse_mla_fp8`'s tile of BLOCK_H (8 or 16) heads. warp_specialized=False
    gives the Triton tile's entry instead of either Gluon tile (where they cannot run:
    `sparse_mla_attention` falls back to it).
    """
    block_h = 16 if num_heads <= 16 else (32 if num_heads <= 32 else 64)
    # Hopper's (and SM100's) shared memory holds two programs of up to 32 heads per SM
    two_per_sm = max_shared_mem >= HOPPER_SHARED_MEM
    hopper = capability // 10 == 9 and two_per_sm
    # An fp8 cache's 1-32 heads take the rows tile at every token count: on the H200
    # (kernel-only, top-k 2048) it took 8.4 / 9.7 / 9.7 us at one token and 8 / 16 / 32
    # heads where the 64-head fp8 tile took 11.4 / 11.8 / 12.2, 21.7 vs 36.6 us at 32
    # tokens and 16 heads, 86.7 vs 116.1 at 128 tokens and 32 heads (as two 16-head
    # programs, the second reading the rows from L2). In the benchmark
    # (benchmarks/results/h200-sparse-mla-gather.json) it takes 0.42-0.44x the 16-bit
    # cache's time at 8 heads, 0.55-0.56x at 16 and 0.98-1.01x at 32 from 256 tokens on.
    if warp_specialized and hopper and kv_fp8 and num_heads <= 32:
        block_h = 8 if num_heads <= 8 else 16
        # about one wave of two programs an SM, at least two 64-row tiles a split (H200
        # kernel-only: 8 heads at 1-4 tokens, 16 splits 8.4-9.0 us, 32 splits 8.7-9.7;
        # 16 heads at 64 tokens, 4 splits 33.1, 2 splits 36.3; 32 heads at 32 tokens, 4
        # splits 29.8, 2 splits 33.1), and a split's slot ids fit the tile's shared
        # memory (batch-invariant mode: the fewest splits, whatever the batch)
        splits = max(_num_splits(num_tokens, num_heads, block_h, topk, kv_lora_rank,
                                 2 * num_sms, 128),
                     triton.next_power_of_2(triton.cdiv(topk, ROWS_IN_M_MAX_SLOTS)))
        return {"BLOCK_H": block_h, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2,
                "splits": splits, "V_RELOAD": False, "WARP_SPECIALIZED": False,
                "ROWS_IN_M": True}
    # H200, kernel-only: the warp-specialized 64-head tile, its heads past num_heads
    # masked, takes 0.65-0.88x the 32-head Triton tile's time with a 16-bit cache from
    # 8 tokens on (1.09x at one token; 8 and 16 heads: within 7%; with an fp8 cache it
    # took 0.7-0.9x the 16- and 32-head Triton tiles', where the rows tile now runs).
    # Batch-invariant mode takes it at every token count: the tile must not depend on
    # the batch
    if (warp_specialized and hopper and block_h == 32
            and (num_tokens >= 8 or envs.VLLM_BATCH_INVARIANT)):
        block_h = 64
    if (block_h == 32 and two_per_sm and not kv_fp8
            and _num_splits(num_tokens, num_heads, 32, topk, kv_lora_rank, 2 * num_sms) > 1):
        # too few tokens to fill the GPU: 32 heads as two 16-head programs (the
        # second reads the rows from L2), whose dots spill no registers. H200
        # sweep: 19.0 vs 22.2 us at 8 tokens, 80.0 vs 96.5 us at 64. An fp8
        # 16-head tile is slower there (128 vs 92 us at 64 tokens).
        block_h = 16
    # Hopper runs 64-head tiles as wgmma dots with both operands in shared memory
    # and SM100 as tcgen05 dots; smaller tiles, and every tile elsewhere, are
    # mma.sync dots that take their operands through registers. Those read an
    # fp8 tile's rows a second time for the PV dot (V_RELOAD): otherwise a
    # synchronous load.
    smem_dots = block_h == 64 and capability // 10 in (9, 10)
    v_reload = kv_fp8 and not smem_dots
    # H200 sweeps (benchmarks/results/h200-sparse-mla-sweep.{log,json}): 64-row key
    # blocks; 64-head tiles in three stages (1.8x faster than two stages of 32
    # rows), 32-head tiles in one warpgroup (1.4x faster than two, despite a
    # few spilled registers)
    block_n, num_warps, num_stages = 64, 4, 2
    if block_h == 64:
        num_warps, num_stages = 8, 3
    if v_reload:
        # H200 fp8 sweep: 32-row key blocks (85 KiB at 16 heads, so also within
        # 99 KiB)
        block_n = 32
    # three stages of 64 rows fit Hopper's wgmma path (216 KiB), not SM100's
    # (345 KiB) nor any smaller shared memory
    if block_h > 16 and not hopper:
        block_n, num_stages = 32, 2
        if max_shared_mem < _MEDIUM_SHARED_MEM and kv_fp8:
            # the converted copy of the rows does not fit 99 KiB next to a
            # 64-head query tile, nor 32 rows next to a 32-head one
            block_h, block_n, num_warps = 32, 16, 4
        elif max_shared_mem < _MEDIUM_SHARED_MEM:
            block_n = 16 if block_h == 64 else 32
    # H200: the warp-specialized tile takes 0.56-0.63x the Triton tile's time at 64 and
    # 128 heads from 64 tokens on, and 0.69-0.82x at 1-8 tokens; with an fp8 cache,
    # 0.52-0.89x the Triton fp8 tiles' (benchmarks/results/h200-sparse-mla-gather.json)
    warp_specialized = warp_specialized and hopper and block_h == 64
    # split-K to about one wave of programs. The warp-specialized tile takes two
    # 64-row tiles per split from two tokens on: splits of one tile cost more in
    # partial rows (128 KiB a program) than they gain (H200, 4 tokens x 64 heads:
    # 15.0 us at 16 splits, 17.9 at 32)
    waves = 2 if block_h <= 32 and two_per_sm else 1
    min_slots = 128 if warp_specialized and num_tokens > 1 else 64
    splits = _num_splits(num_tokens, num_heads, block_h, topk, kv_lora_rank,
                         waves * num_sms, min_slots)
    return {"BLOCK_H": block_h, "BLOCK_N": block_n, "num_warps": num_warps,
            "num_stages": num_stages, "splits": splits, "V_RELOAD": v_reload,
            "WARP_SPECIALIZED": warp_specialized, "ROWS_IN_M": False}


def device_launch_config(
    device: torch.device,
    num_tokens: int,
    num_heads: int,
    topk: int,
    kv_lora_rank: int,
    num_sms: int,
    kv_fp8: bool,
    warp_specialized: bool = True,
) -> dict:
    """`launch_config` with the device's shared memory per block and compute
    capability (Hopper's for a CPU device, which only the Triton interpreter runs)."""
    if device.type != "cuda":
        return launch_config(num_tokens, num_heads, topk, kv_lora_rank, num_sms,
                             HOPPER_SHARED_MEM, kv_fp8, 90, warp_specialized)
    index = torch.cuda.current_device() if device.index is None else device.index
    return launch_config(num_tokens, num_heads, topk, kv_lora_rank, num_sms,
                         device_shared_mem(index), kv_fp8, device_capability(index),
                         warp_specialized)


@functools.cache
def _gluon_module(name: str):
    """A Gluon tile's module (`gluon_sparse_mla`: the warp-specialized Hopper tile,
    `gluon_sparse_mla_fp8`: the 8- and 16-head fp8 tile); None where this Triton has no
    Gluon (the Triton tile runs instead)."""
    try:
        return importlib.import_module(f"vllm.v1.attention.ops.{name}")
    except ImportError as e:
        logger.warning("Sparse MLA: the Gluon kernel %s is unavailable (%s); using the "
                       "Triton kernel.", name, e)
        return None


def _warp_specialized_ops(cfg: dict, q: torch.Tensor, kv: torch.Tensor, kv_lora_rank: int):
    """`gluon_sparse_mla` where the launch table chose its tile and it takes these
    tensors (a GPU, not the interpreter; a cache in q's dtype or fp8 e4m3), else None."""
    if not (cfg.get("WARP_SPECIALIZED") and q.is_cuda
            and kv.dtype in (q.dtype, torch.float8_e4m3fn)):
        return None
    ops = _gluon_module("gluon_sparse_mla")
    if ops is None or not ops.supports(cfg["BLOCK_H"], kv_lora_rank,
                                       q.shape[-1] - kv_lora_rank, q.dtype):
        return None
    return ops


def _rows_in_m_ops(cfg: dict, q: torch.Tensor, kv: torch.Tensor, kv_lora_rank: int):
    """`gluon_sparse_mla_fp8` where the launch table chose its tile and it takes these
    tensors (a GPU, not the interpreter; an fp8 e4m3 cache), else None."""
    if not (cfg.get("ROWS_IN_M") and q.is_cuda):
        return None
    ops = _gluon_module("gluon_sparse_mla_fp8")
    if ops is None or not ops.supports(kv_lora_rank, q.shape[-1] - kv_lora_rank, q.dtype,
                                       kv.dtype):
        return None
    return ops


def _gluon_launch(cfg: dict, q: torch.Tensor, kv: torch.Tensor, kv_lora_rank: int):
    """The Gluon tile the launch table chose, where it takes these tensors, as (rows per
    tile, launcher); else None."""
    ops = _warp_specialized_ops(cfg, q, kv, kv_lora_rank)
    if ops is not None:
        return ops.TILE_ROWS, ops.sparse_mla_attention_ws
    ops = _rows_in_m_ops(cfg, q, kv, kv_lora_rank)
    if ops is not None:
        return ops.TILE_ROWS, functools.partial(ops.sparse_mla_attention_fp8,
                                                block_h=cfg["BLOCK_H"])
    return None


def split_k_outputs(o: torch.Tensor, topk: int, splits: int, block_n: int):
    """Where the attention kernel writes for `splits` splits of a token's top-k:
    the slots per split (whole key blocks), the output (`o` itself, or fp32
    partial rows [T, H, splits, D]), their log-sum-exps [T, H, splits] (unused
    without splits) and the strides of both as the kernel takes them."""
    split_len = triton.cdiv(triton.cdiv(topk, splits), block_n) * block_n
    if splits == 1:
        return split_len, o, o, (o.stride(0), o.stride(1), 0), (0, 0)
    num_tokens, num_heads, d_v = o.shape
    out = torch.empty(num_tokens, num_heads, splits, d_v, dtype=torch.float32,
                      device=o.device)
    lse = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=o.device)
    return (split_len, out, lse, (out.stride(0), out.stride(1), out.stride(2)),
            (lse.stride(0), lse.stride(1)))


def merge_split_k(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor) -> None:
    """Merge the partial rows of `split_k_outputs` into `o` by their log-sum-exps
    (nothing to do without splits: the kernel wrote `o`)."""
    if out is o:
        return
    num_tokens, num_heads, d_v = o.shape
    _sparse_mla_merge_kernel[(num_heads, num_tokens)](
        out, lse, o,
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), o.stride(0), o.stride(1),
        NUM_SPLITS=out.shape[2], D_V=d_v, num_warps=4,
    )


def sparse_mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    valid_counts: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    k_scale: torch.Tensor,
    num_sms: int,
    config: dict | None = None,
) -> torch.Tensor:
    """Sparse MLA over global KV slots.

    q: [T, H, kv_lora_rank + rope] (fp16/bf16); kv_cache: [NB, BS, kv_lora_rank +
    rope] (fp16/bf16, or fp8 with the per-tensor scale `k_scale`, a 1-element
    tensor); slots: int32 [T, K], the valid slots of a token first; valid_counts:
    int32 [T]. Returns o: [T, H, kv_lora_rank] in q's dtype; a token without valid
    slots gets zeros. `config` overrides `device_launch_config` on q's device
    (benchmarks, tests).
    """
    num_tokens, num_heads, head_dim = q.shape
    d_r = head_dim - kv_lora_rank
    topk = slots.shape[1]
    o = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return o
    kv = kv_cache.view(-1, kv_cache.shape[-1])
    assert kv.stride(-1) == 1 and q.stride(-1) == 1 and slots.stride(-1) == 1
    kv_fp8 = kv.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8)
    if kv.dtype == torch.uint8:  # vLLM stores an fp8 cache as uint8
        kv = kv.view(torch.float8_e4m3fn)
    cfg = config or device_launch_config(q.device, num_tokens, num_heads, topk,
                                         kv_lora_rank, num_sms, kv_fp8)
    gluon = _gluon_launch(cfg, q, kv, kv_lora_rank)
    if gluon is not None:
        tile_rows, launch = gluon
        splits = cfg["splits"]
        split_len, out, lse, so, sl = split_k_outputs(o, topk, splits, tile_rows)
        launch(q, kv, slots, valid_counts, k_scale, out, lse, so, sl, scale, split_len, splits)
        merge_split_k(out, lse, o)
        return o
    if config is None and (cfg["WARP_SPECIALIZED"] or cfg.get("ROWS_IN_M")):
        # the Gluon kernel does not take these tensors (an e5m2 cache, the interpreter, a
        # Triton without Gluon): the table's Triton tile instead
        cfg = device_launch_config(q.device, num_tokens, num_heads, topk, kv_lora_rank,
                                   num_sms, kv_fp8, warp_specialized=False)
    splits = cfg["splits"]
    split_len, out, lse, so, sl = split_k_outputs(o, topk, splits, cfg["BLOCK_N"])
    grid = (triton.cdiv(num_heads, cfg["BLOCK_H"]), num_tokens, splits)
    _sparse_mla_kernel[grid](
        q, kv, slots, valid_counts, k_scale, out, lse, scale,
        q.stride(0), q.stride(1), kv.stride(0), slots.stride(0),
        *so, *sl,
        num_heads, split_len,
        BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], D_V=kv_lora_rank, D_R=d_r,
        KV_FP8=kv_fp8, PARTIAL=splits > 1, V_RELOAD=cfg.get("V_RELOAD", False),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    merge_split_k(out, lse, o)
    return o
