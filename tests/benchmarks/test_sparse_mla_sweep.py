# SPDX-License-Identifier: Apache-2.0
"""The kernel benchmark's launch sweep: around the table's Triton tile (its launch
without Hopper's Gluon tiles), it tries half head blocks, fewer and more splits,
deeper software pipelines and, for an fp8 cache at 64 heads, reading the rows once
or twice; every candidate runs and matches the table's launch on the same inputs."""

import dataclasses
import math

import pytest
import torch

from benchmarks.kernels import benchmark_triton_mla_sparse as bench
from vllm.v1.attention.ops import sparse_mla_launch as sml
from vllm.v1.attention.ops import triton_sparse_mla as tsm

RELOAD = sml.SparseMLATile.TRITON_V_RELOAD
# the Triton tiles of an H200 (Hopper without the Gluon tiles)
HOPPER = sml.SparseMLADevice(90, sml.HOPPER_SHARED_MEM, 132, gluon=False)


def launch(tokens, heads, topk=2048, kv_dtype=torch.bfloat16, q_dtype=torch.bfloat16):
    return sml.sparse_mla_launch(HOPPER, tokens, heads, 576, 512, topk, q_dtype, kv_dtype)


def test_sweep_candidates():
    base = launch(4096, 64)
    configs = list(bench.sweep_configs(base))
    assert {c.block_h for c in configs} == {64, 32}
    assert all(c.tile is sml.SparseMLATile.TRITON for c in configs)
    assert all(c.splits == 1 for c in configs)  # 4096 tokens fill the GPU
    assert {c.num_warps for c in configs if c.block_h == 64} == {8}
    # no copy ahead (2), after the dots (3), one or two tiles in flight (5, 7)
    assert {c.num_stages for c in configs} == {2, 3, 5, 7}
    assert {c.num_stages for c in configs if c.block_h == 64} == {3, 5, 7}
    small = list(bench.sweep_configs(launch(1, 8)))
    assert {c.block_h for c in small} == {16}
    fp8 = list(bench.sweep_configs(launch(4096, 8, kv_dtype=torch.float8_e4m3fn), "fp8"))
    assert {c.tile for c in fp8} == {RELOAD}
    fp8_64 = list(bench.sweep_configs(launch(4096, 64, kv_dtype=torch.float8_e4m3fn), "fp8"))
    assert {c.tile for c in fp8_64} == {sml.SparseMLATile.TRITON, RELOAD}
    # around the table's split count: a quarter, half, the same, double
    few = launch(8, 64)
    assert few.splits == 16
    assert {c.splits for c in bench.sweep_configs(few)} == {4, 8, 16, 32}


@pytest.mark.parametrize("kv,H", [("16-bit", 64), ("fp8", 64), ("fp8", 8)])
def test_sweep_candidates_compute_the_same(kv, H):
    # Each candidate of a shape on the same small inputs: on a GPU every binary the
    # sweep times (bf16, 16-byte aligned strides: the sweep's compiled kernels), over
    # enough slots to run its pipeline past the prologue; on the interpreter (CPU)
    # one run per kernel variant.
    g = torch.Generator().manual_seed(0)
    on_gpu = torch.cuda.is_available()
    dev = "cuda" if on_gpu else "cpu"
    dtype, tol = (torch.bfloat16, 1e-2) if on_gpu else (torch.float16, 2e-3)
    T, K = 2, (256 if on_gpu else 32)
    q = (torch.randn(T, H, 576, generator=g) * 0.5).to(dtype).to(dev)
    cache = (torch.randn(32, 16, 576, generator=g) * 0.5).to(dtype).to(dev)
    if kv == "fp8":
        cache = cache.to(torch.float8_e4m3fn)
    slots = torch.stack([torch.randperm(512, generator=g)[:K] for _ in range(T)]).int().to(dev)
    counts = torch.full((T,), K, dtype=torch.int32, device=dev)
    one = torch.ones(1, device=dev)
    args = (q, cache, slots, counts, 512, 1 / math.sqrt(256), one)
    base = launch(T, H, K, cache.dtype, dtype)
    ref = tsm.sparse_mla_attention(*args, launch=base).float()
    seen = set()
    for c in bench.sweep_configs(base, kv):
        key = (c.block_h, c.tile is RELOAD, c.splits)
        if key in seen and not on_gpu:  # tiling only, on the interpreter
            continue
        seen.add(key)
        out = tsm.sparse_mla_attention(
            *args, launch=c if on_gpu else dataclasses.replace(c, block_n=16)).float()
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol, msg=str(c))
    if H == 64:
        assert (32, kv == "fp8", base.splits) in seen
        assert (64, False, base.splits) in seen
        assert (64, True, base.splits) in seen or kv != "fp8"
    else:  # 16-head fp8 tiles: the rows read twice
        assert (16, True, base.splits) in seen
