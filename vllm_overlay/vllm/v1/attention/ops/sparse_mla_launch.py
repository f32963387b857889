# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Launch policy of sparse MLA attention (`triton_sparse_mla.sparse_mla_attention`).

`sparse_mla_launch` chooses the tile that runs a shape and its launch parameters
(`SparseMLALaunch`) from the shape, the query and cache dtypes and the GPU's limits
(`SparseMLADevice`, read through vLLM's platform) only: no data, no host sync, so the
launches are stable under CUDA-graph capture. The Triton tile's parameters are a table
(`TRITON_TILES`); the rules below pick the head block, Hopper's Gluon tiles and the
split-K count. docs/kernels.md says where the measurements behind them are
(docs/results.md#sparse-mla-vs-flashmla holds the current figures).
"""

import dataclasses
import enum
import functools

import torch

import vllm.envs as envs
from vllm.platforms import current_platform
from vllm.triton_utils import triton
from vllm.v1.attention.ops import gluon_sparse_mla, gluon_sparse_mla_fp8

# Opt-in shared memory per block of SM90 and SM100; SM80 has 163 KiB, SM86, SM89 and
# SM12x have 99 KiB.
HOPPER_SHARED_MEM = 227 * 1024
# Below this, the Triton tiles of 32 and 64 heads take their smallest key blocks.
_SMALL_SHARED_MEM = 120 * 1024
# Bound of one launch's split-K partial rows (fp32 [T, H, splits, D_V]).
_MAX_PARTIAL_BYTES = 32 * 1024 * 1024

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class SparseMLATile(enum.Enum):
    """The kernel a launch runs."""

    # `_sparse_mla_kernel`, the PV dot on the rows read for QK^T
    TRITON = "triton"
    # `_sparse_mla_kernel` reading an fp8 tile's rows a second time for the PV dot
    TRITON_V_RELOAD = "triton_v_reload"
    # `gluon_sparse_mla`: Hopper's warp-specialized tile of 64 heads
    GLUON_WARP_SPECIALIZED = "gluon_warp_specialized"
    # `gluon_sparse_mla_fp8`: Hopper's tile of 8 or 16 heads over an fp8 e4m3 cache
    GLUON_FP8_ROWS = "gluon_fp8_rows"


GLUON_TILES = {
    SparseMLATile.GLUON_WARP_SPECIALIZED: gluon_sparse_mla,
    SparseMLATile.GLUON_FP8_ROWS: gluon_sparse_mla_fp8,
}


@dataclasses.dataclass(frozen=True)
class SparseMLALaunch:
    """A launch of sparse MLA attention: the tile and its parameters."""

    tile: SparseMLATile
    block_h: int  # heads a program
    block_n: int  # KV rows a loop iteration
    num_warps: int  # (a Gluon tile's launcher sets its own: warps a partition)
    num_stages: int  # (a Gluon tile's launcher sets its own: buffers of rows)
    splits: int  # programs a token's top-k is split over, merged by log-sum-exp


class GpuKind(enum.Enum):
    """What a GPU gives the tiles: how its 64-head dots take their operands, and room
    for the rows in shared memory."""

    HOPPER = "hopper"  # SM90, 227 KiB: wgmma dots from shared memory
    SM100 = "sm100"  # SM10x, 227 KiB: tcgen05 dots from shared memory
    MMA_SYNC = "mma_sync"  # other GPUs from 120 KiB (SM80): dots through registers
    MMA_SYNC_SMALL = "mma_sync_small"  # less (SM86, SM89, SM12x): dots through registers


@dataclasses.dataclass(frozen=True)
class SparseMLADevice:
    """The limits of a GPU that the launch policy reads."""

    capability: int  # major * 10 + minor
    shared_mem: int  # opt-in shared memory per block, bytes
    num_sms: int
    gluon: bool = True  # runs the Gluon tiles (not under the Triton interpreter)

    @property
    def kind(self) -> GpuKind:
        if self.shared_mem < _SMALL_SHARED_MEM:
            return GpuKind.MMA_SYNC_SMALL
        if self.shared_mem < HOPPER_SHARED_MEM:
            return GpuKind.MMA_SYNC
        return {9: GpuKind.HOPPER, 10: GpuKind.SM100}.get(self.capability // 10,
                                                           GpuKind.MMA_SYNC)

    @property
    def two_per_sm(self) -> bool:
        """Whether an SM holds two programs of up to 32 heads."""
        return self.shared_mem >= HOPPER_SHARED_MEM


# What the Triton interpreter (CPU tensors) plans for: Hopper, 132 SMs, no Gluon tiles.
INTERPRETER_DEVICE = SparseMLADevice(capability=90, shared_mem=HOPPER_SHARED_MEM,
                                     num_sms=132, gluon=False)


@functools.cache
def cuda_device(index: int) -> SparseMLADevice:
    """A CUDA device's limits, read once through vLLM's platform."""
    return SparseMLADevice(
        capability=current_platform.get_device_capability(index).to_int(),
        shared_mem=current_platform.get_max_shared_memory_per_block(index),
        num_sms=current_platform.num_compute_units(index),
    )


def sparse_mla_device(device: torch.device) -> SparseMLADevice:
    """The limits of the device of a tensor."""
    if device.type != "cuda":
        return INTERPRETER_DEVICE
    return cuda_device(torch.cuda.current_device() if device.index is None else device.index)


_T, _VR = SparseMLATile.TRITON, SparseMLATile.TRITON_V_RELOAD
# The Triton tile by GPU kind, head block (16, 32 or 64 heads) and whether the cache is
# fp8: (heads a program, KV rows a loop iteration, warps, stages, tile). Every entry is
# compiled for each GPU and checked against its shared memory and for synchronous row
# loads in tests/v1/attention/test_triton_mla_sparse_targets.py.
TRITON_TILES: dict[tuple[GpuKind, int, bool], tuple[int, int, int, int, SparseMLATile]] = {
    # 64-row key blocks; 64-head wgmma tiles in three stages, which fit only here
    (GpuKind.HOPPER, 16, False): (16, 64, 4, 2, _T),
    (GpuKind.HOPPER, 16, True): (16, 32, 4, 2, _VR),
    (GpuKind.HOPPER, 32, False): (32, 64, 4, 2, _T),
    (GpuKind.HOPPER, 32, True): (32, 32, 4, 2, _VR),
    (GpuKind.HOPPER, 64, False): (64, 64, 8, 3, _T),
    (GpuKind.HOPPER, 64, True): (64, 64, 8, 3, _T),
    # two stages of 32 rows from 32 heads on; 64-head dots read an fp8 tile once
    (GpuKind.SM100, 16, False): (16, 64, 4, 2, _T),
    (GpuKind.SM100, 16, True): (16, 32, 4, 2, _VR),
    (GpuKind.SM100, 32, False): (32, 32, 4, 2, _T),
    (GpuKind.SM100, 32, True): (32, 32, 4, 2, _VR),
    (GpuKind.SM100, 64, False): (64, 32, 8, 2, _T),
    (GpuKind.SM100, 64, True): (64, 32, 8, 2, _T),
    # SM100's blocks; every fp8 tile of register-operand dots reads its rows twice; a
    # 16-bit cache's 64 heads as 32-head programs of 64 rows (a 64-head mma.sync tile's
    # registers leave it half the speed)
    (GpuKind.MMA_SYNC, 16, False): (16, 64, 4, 2, _T),
    (GpuKind.MMA_SYNC, 16, True): (16, 32, 4, 2, _VR),
    (GpuKind.MMA_SYNC, 32, False): (32, 32, 4, 2, _T),
    (GpuKind.MMA_SYNC, 32, True): (32, 32, 4, 2, _VR),
    (GpuKind.MMA_SYNC, 64, False): (32, 64, 4, 2, _T),
    (GpuKind.MMA_SYNC, 64, True): (64, 32, 8, 2, _VR),
    # 16-row blocks where 32 do not fit; 64 heads as 32-head programs (a 64-head
    # mma.sync tile's registers leave it a third of the speed); five stages where an
    # fp8 tile or 16 rows leave the room
    (GpuKind.MMA_SYNC_SMALL, 16, False): (16, 64, 4, 2, _T),
    (GpuKind.MMA_SYNC_SMALL, 16, True): (16, 32, 4, 2, _VR),
    (GpuKind.MMA_SYNC_SMALL, 32, False): (32, 32, 4, 2, _T),
    (GpuKind.MMA_SYNC_SMALL, 32, True): (32, 16, 4, 5, _VR),
    (GpuKind.MMA_SYNC_SMALL, 64, False): (32, 16, 4, 5, _T),
    (GpuKind.MMA_SYNC_SMALL, 64, True): (32, 16, 4, 5, _VR),
}


def _num_splits(num_tokens: int, num_heads: int, block_h: int, topk: int,
                kv_lora_rank: int, programs_per_wave: int, min_slots: int = 64) -> int:
    """Split-K count that brings the programs to about one wave (a power of two, rounded
    down: more splits cost more partial rows than they gain), with at least `min_slots`
    slots a split and the partial rows within `_MAX_PARTIAL_BYTES`."""
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


def _launch(device: SparseMLADevice, num_tokens: int, num_heads: int, topk: int,
            kv_lora_rank: int, kv_fp8: bool, gluon: bool) -> SparseMLALaunch:
    hopper_gluon = gluon and device.kind is GpuKind.HOPPER
    if hopper_gluon and kv_fp8 and num_heads <= 32:
        # the fp8 rows tile at every token count, 17-32 heads as two programs of 16
        block_h = 8 if num_heads <= 8 else 16
        rows = gluon_sparse_mla_fp8.TILE_ROWS
        # one wave of two programs an SM, two tiles a split, a split's slot ids within
        # the tile's shared memory
        splits = max(_num_splits(num_tokens, num_heads, block_h, topk, kv_lora_rank,
                                 2 * device.num_sms, 2 * rows),
                     triton.next_power_of_2(triton.cdiv(topk, gluon_sparse_mla_fp8.MAX_SLOTS)))
        return SparseMLALaunch(SparseMLATile.GLUON_FP8_ROWS, block_h, rows,
                               gluon_sparse_mla_fp8.NUM_WARPS, 2, splits)
    block_h = 16 if num_heads <= 16 else (32 if num_heads <= 32 else 64)
    if block_h == 32:
        if hopper_gluon and (num_tokens >= 8 or envs.VLLM_BATCH_INVARIANT):
            # the warp-specialized tile, its heads past num_heads masked (at every token
            # count in batch-invariant mode: the tile must not depend on the batch)
            block_h = gluon_sparse_mla.TILE_HEADS
        elif (device.two_per_sm and not kv_fp8
              and _num_splits(num_tokens, num_heads, 32, topk, kv_lora_rank,
                              2 * device.num_sms) > 1):
            # too few tokens to fill the GPU: two 16-head programs, the second reading
            # the rows from L2, whose dots spill no registers
            block_h = 16
    block_h, block_n, num_warps, num_stages, tile = TRITON_TILES[device.kind, block_h, kv_fp8]
    if hopper_gluon and block_h == gluon_sparse_mla.TILE_HEADS:
        # two 64-row tiles a split from two tokens on: a split of one tile costs more in
        # partial rows than it gains
        rows = gluon_sparse_mla.TILE_ROWS
        splits = _num_splits(num_tokens, num_heads, block_h, topk, kv_lora_rank,
                             device.num_sms, 2 * rows if num_tokens > 1 else rows)
        return SparseMLALaunch(SparseMLATile.GLUON_WARP_SPECIALIZED, block_h, rows, 4,
                               gluon_sparse_mla.NUM_STAGES, splits)
    waves = 2 if block_h <= 32 and device.two_per_sm else 1
    splits = _num_splits(num_tokens, num_heads, block_h, topk, kv_lora_rank,
                         waves * device.num_sms)
    return SparseMLALaunch(tile, block_h, block_n, num_warps, num_stages, splits)


def sparse_mla_launch(device: SparseMLADevice, num_tokens: int, num_heads: int,
                      head_dim: int, kv_lora_rank: int, topk: int, q_dtype: torch.dtype,
                      kv_dtype: torch.dtype) -> SparseMLALaunch:
    """The launch for `num_tokens` queries of `num_heads` x `head_dim` (the latent
    `kv_lora_rank` columns, then the rope ones) over `topk` slots each, on `device`.
    A Gluon tile that does not take these dtypes or shapes gives way to the table's
    Triton tile.

    Chosen once for each set of arguments (and batch-invariant mode, which the rules
    read): `sparse_mla_attention` asks per layer and step where attention runs outside
    a CUDA graph (eager, piecewise graphs, token counts past the captured sizes), and
    the answer is a function of these alone."""
    return _cached_launch(device, num_tokens, num_heads, head_dim, kv_lora_rank, topk,
                          q_dtype, kv_dtype, bool(envs.VLLM_BATCH_INVARIANT))


@functools.lru_cache(maxsize=4096)
def _cached_launch(device: SparseMLADevice, num_tokens: int, num_heads: int,
                   head_dim: int, kv_lora_rank: int, topk: int, q_dtype: torch.dtype,
                   kv_dtype: torch.dtype, batch_invariant: bool) -> SparseMLALaunch:
    # batch_invariant: only a key (the rules read envs.VLLM_BATCH_INVARIANT, equal to it)
    del batch_invariant
    kv_fp8 = kv_dtype in FP8_DTYPES
    launch = _launch(device, num_tokens, num_heads, topk, kv_lora_rank, kv_fp8, device.gluon)
    module = GLUON_TILES.get(launch.tile)
    if module is not None and not module.supports(launch.block_h, kv_lora_rank,
                                                  head_dim - kv_lora_rank, q_dtype, kv_dtype):
        launch = _launch(device, num_tokens, num_heads, topk, kv_lora_rank, kv_fp8, False)
    return launch
