# SPDX-License-Identifier: Apache-2.0
"""The sparse MLA kernel benchmark as on another GPU (`--as-gpu`): it times the
launches the table gives that GPU, and on an H200 with DISABLE_MMA_V3=1 Triton
compiles them as it does for that GPU (mma.sync dots, the same shared memory),
not as Hopper's wgmma tiles (checked on a 64-head tile, SM100's: sm_90 makes a
64-row M tile a wgmma tile)."""

import itertools
import json
import sys

import pytest
import torch

from benchmarks.kernels import benchmark_triton_mla_sparse as bench
from tests.v1.attention import test_triton_mla_sparse_targets as targets
from vllm.v1.attention.ops import sparse_mla_launch as sml

H200 = sml.SparseMLADevice(90, sml.HOPPER_SHARED_MEM, 132)


@pytest.mark.parametrize("gpu", sorted(bench.AS_GPUS))
def test_as_gpu_times_that_gpus_launches(monkeypatch, gpu):
    # the benchmark on an H200 plans what the engine plans on that GPU (its
    # capability and opt-in shared memory from the CUDA guide's table, the H200's SMs)
    monkeypatch.setattr(sml, "sparse_mla_device", lambda device: H200)
    device = bench.bench_device(gpu)
    arch = device.capability
    assert device.shared_mem == targets.SHARED_MEM[arch]
    assert bench.bench_device(None) == H200
    there = sml.SparseMLADevice(arch, targets.SHARED_MEM[arch], H200.num_sms)
    kvs = ("bf16", "fp8") if arch >= targets.FP8_FROM else ("bf16",)
    for tokens, heads, kv, q in itertools.product((1, 8, 64, 4096), (8, 16, 32, 64, 128),
                                                  kvs, ("bf16", "fp16")):
        kv_dtype = torch.float8_e4m3fn if kv == "fp8" else bench.Q_DTYPES[q]
        planned = sml.sparse_mla_launch(there, tokens, heads, bench.HEAD, bench.KV_LORA, 2048,
                                        bench.Q_DTYPES[q], kv_dtype)
        launch, triton_launch = bench.table_launches(tokens, heads, 2048, kv, q, device)
        assert launch == triton_launch == planned, (tokens, heads, kv, q)
        assert launch.tile not in sml.GLUON_TILES


def compile_tile(arch: int) -> dict:
    """The 64-head bf16 Triton tile that SM100 runs, compiled for `arch` (run in a plain
    process)."""
    device = sml.SparseMLADevice(100, targets.SHARED_MEM[100], 132)
    launch = sml.sparse_mla_launch(device, 4096, 64, bench.HEAD, bench.KV_LORA, 2048,
                                   torch.bfloat16, torch.bfloat16)
    kernel = targets.compile_binary(arch, {
        "BLOCK_H": launch.block_h, "BLOCK_N": launch.block_n, "num_warps": launch.num_warps,
        "num_stages": launch.num_stages, "V_RELOAD": False, "kv": "bf16", "PARTIAL": False})
    ttgir = kernel.asm["ttgir"]
    return {"shared": kernel.metadata.shared, "wgmma": ttgir.count("ttng.warp_group_dot "),
            "mma_sync": ttgir.count("versionMajor = 2")}


def test_mma_sync_on_hopper_compiles_the_other_gpus_tile(run_without_gpu, monkeypatch):
    module = "tests.benchmarks.test_benchmark_triton_mla_sparse_as_gpu"
    monkeypatch.delenv("DISABLE_MMA_V3", raising=False)
    sm80 = run_without_gpu(module, 80)
    hopper = run_without_gpu(module, 90)
    monkeypatch.setenv("DISABLE_MMA_V3", "1")
    as_sm80 = run_without_gpu(module, 90)
    assert sm80["wgmma"] == 0 and sm80["mma_sync"] > 0
    # by default sm_90 makes it a wgmma tile, of other shared memory
    assert hopper["wgmma"] > 0 and hopper["shared"] != sm80["shared"]
    assert as_sm80 == sm80


if __name__ == "__main__":
    print(json.dumps(compile_tile(int(sys.argv[1]))))
