# SPDX-License-Identifier: Apache-2.0
"""`sparse_mla_launch` chooses what the sparse MLA launch policy chose before its
restructure into a typed launch record and a table.

The reference below is the policy of `vllm/v1/attention/ops/triton_sparse_mla.py` at
commit 33e67de (before the restructure): `launch_config` with its `_num_splits`, and
the dispatch's step from a Gluon tile to the table's Triton entry where that tile does
not take the tensors (a CPU tensor under the Triton interpreter, a cache dtype it does
not read). It is copied here unchanged but for its comments, the environment read
(`batch_invariant`) and the Gluon tiles' `supports` written out for GLM-5's 512 + 64
head; commit deb1282 checked it against that code over this grid. Over a grid of GPUs
(capability, opt-in shared memory per block, SMs), heads, tokens, top-k, query and
cache dtypes, GPU or interpreter and batch invariance, the launch the code makes must
be the reference's effective launch: the same tile, heads a program, KV rows a loop
iteration and splits, and for a Triton tile the same warps and stages (a Gluon tile
has its own, which the reference's dict did not carry). The grid's GPUs are real
(capability, shared memory) pairs: a capability 9.x or 10.x with less than 227 KiB,
which no GPU has, is now planned as a GPU of that shared memory whose dots take their
operands through registers (the reference read an fp8 64-head tile's rows once there).
Changes to the reference, marked in it (measured as on SM120 and SM80, docs/results.md,
H200 as on each GPU, 2026-12-03): on the 99 KiB GPUs a 16-bit cache's 33+ heads run as
32-head programs of 16 rows in 5 stages, not 64-head ones, and an fp8 cache's 32-head
programs take 5 stages, not 2; on SM80 (163 KiB) a 16-bit cache's 33+ heads run as
32-head programs of 64 rows.
"""

import itertools

import pytest
import torch

KV_LORA, ROPE = 512, 64
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_REF_HOPPER_SHARED_MEM = 227 * 1024
_REF_MEDIUM_SHARED_MEM = 120 * 1024
_REF_MAX_PARTIAL_BYTES = 32 * 1024 * 1024
_REF_ROWS_IN_M_MAX_SLOTS = 2048


def _cdiv(a, b):
    return -(a // -b)


def _next_power_of_2(n):
    return 1 << (n - 1).bit_length()


def _ref_num_splits(num_tokens, num_heads, block_h, topk, kv_lora_rank, programs_per_wave,
                    min_slots=64, *, batch_invariant):
    if batch_invariant:
        return 1
    per_wave = programs_per_wave // (num_tokens * _cdiv(num_heads, block_h))
    if per_wave < 2:
        return 1
    splits = 1 << (per_wave.bit_length() - 1)
    splits = min(splits, max(1, _next_power_of_2(topk) // min_slots))
    per_split = num_tokens * num_heads * kv_lora_rank * 4
    while splits > 1 and splits * per_split > _REF_MAX_PARTIAL_BYTES:
        splits //= 2
    return splits


def _ref_launch_config(num_tokens, num_heads, topk, kv_lora_rank, num_sms, max_shared_mem,
                       kv_fp8, capability, warp_specialized, *, batch_invariant):
    bi = {"batch_invariant": batch_invariant}
    block_h = 16 if num_heads <= 16 else (32 if num_heads <= 32 else 64)
    two_per_sm = max_shared_mem >= _REF_HOPPER_SHARED_MEM
    hopper = capability // 10 == 9 and two_per_sm
    if warp_specialized and hopper and kv_fp8 and num_heads <= 32:
        block_h = 8 if num_heads <= 8 else 16
        splits = max(_ref_num_splits(num_tokens, num_heads, block_h, topk, kv_lora_rank,
                                     2 * num_sms, 128, **bi),
                     _next_power_of_2(_cdiv(topk, _REF_ROWS_IN_M_MAX_SLOTS)))
        return {"BLOCK_H": block_h, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2,
                "splits": splits, "V_SPLITS": 1, "V_RELOAD": False, "K_DEQUANT": False,
                "WARP_SPECIALIZED": False, "ROWS_IN_M": True}
    if (warp_specialized and hopper and block_h == 32
            and (num_tokens >= 8 or batch_invariant)):
        block_h = 64
    if (block_h == 32 and two_per_sm and not kv_fp8
            and _ref_num_splits(num_tokens, num_heads, 32, topk, kv_lora_rank, 2 * num_sms,
                                **bi) > 1):
        block_h = 16
    smem_dots = block_h == 64 and capability // 10 in (9, 10)
    v_reload = kv_fp8 and not smem_dots
    block_n, num_warps, num_stages = 64, 4, 2
    if block_h == 64:
        num_warps, num_stages = 8, 3
    if v_reload:
        block_n = 32
    if block_h > 16 and not hopper:
        block_n, num_stages = 32, 2
        if max_shared_mem < _REF_MEDIUM_SHARED_MEM and kv_fp8:
            # changed since 33e67de: 5 stages, not 2 (measured as on SM120)
            block_h, block_n, num_warps, num_stages = 32, 16, 4, 5
        elif (max_shared_mem >= _REF_MEDIUM_SHARED_MEM and block_h == 64 and not kv_fp8
              and (not two_per_sm or capability // 10 not in (9, 10))):
            # changed since 33e67de: 32-head programs of 64 rows (measured as on SM80)
            block_h, block_n, num_warps = 32, 64, 4
        elif max_shared_mem < _REF_MEDIUM_SHARED_MEM and block_h == 64:
            # changed since 33e67de: 32-head programs (measured as on SM120)
            block_h, block_n, num_warps, num_stages = 32, 16, 4, 5
        elif max_shared_mem < _REF_MEDIUM_SHARED_MEM:
            block_n = 32
    warp_specialized = warp_specialized and hopper and block_h == 64
    waves = 2 if block_h <= 32 and two_per_sm else 1
    min_slots = 128 if warp_specialized and num_tokens > 1 else 64
    splits = _ref_num_splits(num_tokens, num_heads, block_h, topk, kv_lora_rank,
                             waves * num_sms, min_slots, **bi)
    return {"BLOCK_H": block_h, "BLOCK_N": block_n, "num_warps": num_warps,
            "num_stages": num_stages, "splits": splits, "V_SPLITS": 1,
            "V_RELOAD": v_reload, "K_DEQUANT": False,
            "WARP_SPECIALIZED": warp_specialized, "ROWS_IN_M": False}


def _ref_gluon_takes(cfg, q_dtype, kv_dtype, on_gpu):
    """The dispatch's `_warp_specialized_ops` / `_rows_in_m_ops` conditions."""
    sixteen_bit = q_dtype in (torch.bfloat16, torch.float16)
    if cfg["WARP_SPECIALIZED"]:
        return (on_gpu and kv_dtype in (q_dtype, torch.float8_e4m3fn)
                and cfg["BLOCK_H"] == 64 and sixteen_bit)
    if cfg["ROWS_IN_M"]:
        return on_gpu and sixteen_bit and kv_dtype == torch.float8_e4m3fn
    return True


def effective(cfg: dict) -> dict:
    """What a launch dict ran: the tile and the parameters that tile reads."""
    if cfg["ROWS_IN_M"] or cfg["WARP_SPECIALIZED"]:
        tile = "gluon_fp8_rows" if cfg["ROWS_IN_M"] else "gluon_warp_specialized"
        return {"tile": tile, "block_h": cfg["BLOCK_H"], "block_n": 64,
                "splits": cfg["splits"]}
    return {"tile": "triton_v_reload" if cfg["V_RELOAD"] else "triton",
            "block_h": cfg["BLOCK_H"], "block_n": cfg["BLOCK_N"],
            "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"],
            "splits": cfg["splits"]}


def reference_launch(gpu, num_tokens, num_heads, topk, q_dtype, kv_dtype, on_gpu,
                     batch_invariant) -> dict:
    capability, shared_mem, num_sms = gpu
    args = (num_tokens, num_heads, topk, KV_LORA, num_sms, shared_mem, kv_dtype in FP8,
            capability)
    cfg = _ref_launch_config(*args, True, batch_invariant=batch_invariant)
    if not _ref_gluon_takes(cfg, q_dtype, kv_dtype, on_gpu):
        cfg = _ref_launch_config(*args, False, batch_invariant=batch_invariant)
    return effective(cfg)


# (capability, opt-in shared memory per block, SMs): A100, RTX A6000, RTX 4090, H200,
# H20, B200, RTX PRO 6000, DGX Spark, and the capability 12.0 reported on an H200 (the
# test hook without VLLM_TEST_REPORT_SHARED_MEM)
GPUS = [(80, 163 * 1024, 108), (86, 99 * 1024, 84), (89, 99 * 1024, 128),
        (90, 227 * 1024, 132), (90, 227 * 1024, 78), (100, 227 * 1024, 148),
        (120, 99 * 1024, 188), (121, 99 * 1024, 48), (120, 227 * 1024, 132)]
HEADS = (1, 5, 8, 9, 16, 17, 20, 32, 33, 40, 63, 64, 96, 128)
TOKENS = (1, 2, 3, 4, 7, 8, 9, 16, 32, 33, 64, 65, 128, 132, 256, 264, 1024, 8192)
TOPK = (128, 2048, 4096)
DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
          (torch.float16, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn),
          (torch.float16, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e5m2)]


def current_launch(gpu, num_tokens, num_heads, topk, q_dtype, kv_dtype, on_gpu) -> dict:
    """The launch `sparse_mla_launch` makes (the environment gives batch invariance),
    in `effective`'s terms."""
    from vllm.v1.attention.ops import sparse_mla_launch as sml

    capability, shared_mem, num_sms = gpu
    device = sml.SparseMLADevice(capability, shared_mem, num_sms, gluon=on_gpu)
    launch = sml.sparse_mla_launch(device, num_tokens, num_heads, KV_LORA + ROPE, KV_LORA,
                                   topk, q_dtype, kv_dtype)
    got = {"tile": launch.tile.value, "block_h": launch.block_h, "block_n": launch.block_n,
           "num_warps": launch.num_warps, "num_stages": launch.num_stages,
           "splits": launch.splits}
    if launch.tile in sml.GLUON_TILES:
        del got["num_warps"], got["num_stages"]
    return got


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_launch_matches_the_reference(monkeypatch, batch_invariant):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1" if batch_invariant else "0")
    tiles = set()
    for gpu, heads, tokens, topk, (q_dtype, kv_dtype), on_gpu in itertools.product(
            GPUS, HEADS, TOKENS, TOPK, DTYPES, (True, False)):
        case = (gpu, tokens, heads, topk, q_dtype, kv_dtype, on_gpu)
        want = reference_launch(*case, batch_invariant)
        assert current_launch(*case) == want, case
        tiles.add(want["tile"])
    # the grid reaches every tile
    assert tiles == {"triton", "triton_v_reload", "gluon_warp_specialized", "gluon_fp8_rows"}


def test_launch_is_chosen_once_per_shape(monkeypatch):
    """`sparse_mla_attention` asks for its launch per layer and step outside CUDA graphs
    (eager, piecewise graphs: attention splits the graph): the rules run once for each
    set of arguments and batch-invariant mode, and give what they give uncached."""
    from vllm.v1.attention.ops import sparse_mla_launch as sml

    ruled = []
    rules = sml._launch

    def counted(*args):
        ruled.append(args)
        return rules(*args)

    monkeypatch.setattr(sml, "_launch", counted)
    sml._cached_launch.cache_clear()
    hopper = sml.SparseMLADevice(90, sml.HOPPER_SHARED_MEM, 132)
    args = (hopper, 1, 64, KV_LORA + ROPE, KV_LORA, 2048, torch.bfloat16, torch.bfloat16)
    try:
        for batch_invariant in (False, True):
            monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1" if batch_invariant else "0")
            ruled.clear()
            launches = {sml.sparse_mla_launch(*args) for _ in range(50)}
            assert len(ruled) == 1 and len(launches) == 1
            uncached = sml._cached_launch.__wrapped__(*args, batch_invariant)
            assert launches == {uncached}
            assert (uncached.splits == 1) == batch_invariant  # the mode is in the key
    finally:
        sml._cached_launch.cache_clear()
