# SPDX-License-Identifier: Apache-2.0
"""Linear Q6_K products of a few tokens on a Triton GEMM
(vllm_gguf_plugin.quantization.q6_k_triton).

CPU: the kernel (Triton interpreter) against float32 products of gguf-py's
dequantization of random blocks (every bit of the codes and scales random): token and
weight row tails, K splits, launches of 16-64 token rows, padded rows; the launches;
where the GGUF products take it (the switch, token counts, dtypes, types, batch
invariance) and that a routed product does not; the tile compiled for SM80, SM90 and
SM120 without register spills and with asynchronous loads. GPU: the same products at
GLM-5's shapes, float16 and bfloat16, 2 to 255 tokens.
"""

import json
import re
import sys

import pytest
import torch
from gguf import GGMLQuantizationType as T

from benchmarks.kernels import benchmark_gguf_ops as bench
from tests.models.quantization.test_gguf_moe_marlin import k_quant_blocks
from tests.models.quantization.test_gguf_moe_prefill import _gguf_dequantize

ARCHS = (80, 90, 120)


def q6_k_blocks(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Q6_K blocks: every bit of ql, qh and the int8 scales random, d finite."""
    return k_quant_blocks(T.Q6_K, rows, cols, seed)


def dequantize(blocks: torch.Tensor, k: int) -> torch.Tensor:
    """gguf-py's float32 values of Q6_K blocks [rows, k / 256 * 210]."""
    return _gguf_dequantize(blocks, T.Q6_K, blocks.shape[0], k, torch.float32)


def _launch(*args):
    from vllm_gguf_plugin.quantization.q6_k_triton import Q6KLaunch

    return Q6KLaunch(*args)


@pytest.mark.parametrize("m,n,k,config", [
    (2, 64, 256, None),
    (5, 80, 512, None),  # a tail of weight rows
    (17, 64, 512, (16, 64, 2, 8)),  # two token tiles, two K splits
    (40, 96, 768, (32, 64, 1, 8)),  # two token tiles, a tail of each
    (3, 64, 512, (64, 32, 4, 4)),  # more splits than blocks: two of them empty
])
def test_product_is_gguf_pys(m, n, k, config):
    from vllm_gguf_plugin.quantization import q6_k_triton

    blocks = q6_k_blocks(n, k, m)
    gen = torch.Generator().manual_seed(n + k)
    x = (torch.randn(m, k, generator=gen) * k ** -0.5).half()
    out = q6_k_triton.mul_mat(x, blocks, config=config and _launch(*config))
    assert out.shape == (m, n) and out.dtype == torch.float16
    ref = x.float() @ dequantize(blocks, k).T
    assert bench.rel_error(out, ref) < 2e-3


def test_padded_rows_are_read_to_k():
    """A merged layer's rows may be padded past K's blocks: the tail is not read."""
    from vllm_gguf_plugin.quantization import q6_k_triton

    n, k = 64, 512
    blocks = q6_k_blocks(n, k, 3)
    padded = torch.full((n, blocks.shape[1] + 210), 0x7F, dtype=torch.uint8)
    padded[:, :blocks.shape[1]] = blocks
    x = (torch.randn(4, k, generator=torch.Generator().manual_seed(1)) * k ** -0.5).half()
    torch.testing.assert_close(q6_k_triton.mul_mat(x, padded), q6_k_triton.mul_mat(x, blocks),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="Q6_K product"):
        q6_k_triton.mul_mat(x[:, :500], blocks)


@pytest.mark.parametrize("m,n,k_blocks", [(2, 2624, 24), (8, 16384, 8), (32, 154880, 24),
                                          (33, 6144, 64), (64, 6144, 48), (255, 2624, 24),
                                          (4, 64, 2)])
def test_launch_fills_the_gpu_within_its_splits(m, n, k_blocks):
    from triton import cdiv
    from vllm_gguf_plugin.quantization import q6_k_triton as q6

    sms = 132
    got = q6.launch(m, n, k_blocks, sms)
    tile = q6.TILE
    assert (got.block_m, got.block_n, got.num_warps) == (tile.block_m, tile.block_n,
                                                         tile.num_warps)
    tiles = cdiv(m, got.block_m) * cdiv(n, got.block_n)
    split = got.split_k
    assert split & (split - 1) == 0
    assert split == 1 or k_blocks // split >= q6.MIN_BLOCKS_A_SPLIT
    # fewer splits would not fill the GPU; more would read too few blocks each
    assert split == 1 or tiles * (split // 2) < q6.WAVES * sms
    assert (tiles * split >= q6.WAVES * sms
            or k_blocks // (2 * split) < q6.MIN_BLOCKS_A_SPLIT)


@pytest.fixture
def product(monkeypatch):
    """linear._fused_mul_mat_gguf with each kernel a stand-in that records its name."""
    from vllm_gguf_plugin.quantization import linear, q6_k_triton

    calls = []

    def named(name):
        def kernel(*args, **kwargs):
            calls.append(name)
            return torch.zeros(1)
        return kernel

    def dequantize(w, t, n, k, dtype):
        calls.append("dequant")
        return torch.zeros(n, k, dtype=dtype)

    monkeypatch.setattr(q6_k_triton, "mul_mat", named("q6_k"))
    monkeypatch.setattr(linear.ops, "ggml_mul_mat_vec_a8", named("mmvq"))
    monkeypatch.setattr(linear.ops, "ggml_mul_mat_a8", named("mmq"))
    monkeypatch.setattr(linear.batch_invariant, "mul_mat", named("batch-invariant"))
    monkeypatch.setattr(linear.ops, "ggml_dequantize", dequantize)
    monkeypatch.setattr(linear.dequant_triton, "dequantize", dequantize)
    monkeypatch.setattr("vllm.envs.VLLM_BATCH_INVARIANT", False, raising=False)

    def run(tokens, qtype=T.Q6_K, dtype=torch.float16, on=True):
        monkeypatch.setattr(q6_k_triton, "enabled", lambda: on)
        calls.clear()
        linear._fused_mul_mat_gguf(torch.zeros(tokens, 256, dtype=dtype),
                                   torch.zeros(6144, 210, dtype=torch.uint8), int(qtype))
        assert len(calls) == 1
        return calls[0]
    return run


def test_gguf_product_takes_it_where_asked(product, monkeypatch):
    """8-64 tokens here, fewer than 8 the plugin's MMVQ (6144 rows: up to 2 tokens) and
    MMQ, from 65 the dequantized 16-bit GEMM; off, or another type or dtype, the paths
    without the switch (Q6_K and Q4_K dequantize from 16 tokens)."""
    from vllm_gguf_plugin.quantization.linear import DEQUANT_GEMM_MIN_TOKENS

    assert [product(t) for t in (8, 16, 32, 33, 64)] == ["q6_k"] * 5
    assert product(8, dtype=torch.bfloat16) == "q6_k"
    assert [product(t) for t in (1, 2, 4, 7)] == ["mmvq", "mmvq", "mmq", "mmq"]
    assert [product(t) for t in (65, DEQUANT_GEMM_MIN_TOKENS)] == ["dequant"] * 2
    for off, first in (({"on": False}, 16), ({"dtype": torch.float32}, 16),
                       ({"qtype": T.Q4_K}, 16)):
        assert [product(t, **off) for t in (8, first - 1, first, 64)] == (
            ["mmq", "mmq"] + ["dequant"] * 2)
    monkeypatch.setattr("vllm.envs.VLLM_BATCH_INVARIANT", True, raising=False)
    assert product(8) == product(65) == "batch-invariant"


def test_marlin_layers_down_product_keeps_the_plugins_kernels(monkeypatch):
    """fused_moe._gguf_moe_down (the down product of a layer whose gate_up runs on
    Marlin) runs a Q6_K down product on the plugin's kernels with the switch on as off:
    the routed rows on this tile ran slower (H200, 2026-12-04, in the history of docs/results.md)."""
    from vllm_gguf_plugin.quantization import fused_moe, q6_k_triton

    calls = []
    monkeypatch.setattr(fused_moe.ops, "ggml_moe_a8_vec", lambda *a: calls.append("vec"))
    monkeypatch.setattr(fused_moe, "moe_by_expert_group", lambda *a: calls.append("mmq"))
    monkeypatch.setattr("vllm.model_executor.layers.fused_moe.fused_moe.moe_align_block_size",
                        lambda *a: (None, None, None))
    monkeypatch.setattr(fused_moe.ops, "ggml_moe_get_block_size", lambda t: 16, raising=False)

    def down(tokens, on):
        monkeypatch.setattr(q6_k_triton, "enabled", lambda: on)
        calls.clear()
        fused_moe._gguf_moe_down(torch.zeros(tokens * 8, 256, dtype=torch.float16),
                                 torch.zeros(4, 64, 210, dtype=torch.uint8), int(T.Q6_K),
                                 torch.zeros(tokens, 8, dtype=torch.int32))
        return calls[:]

    for tokens in (1, 8, 32, 64, 255):
        on = down(tokens, on=True)
        assert len(on) == 1 and on == down(tokens, on=False)


def test_off_unless_asked(monkeypatch):
    from vllm_gguf_plugin.quantization import q6_k_triton

    for value, on in ((None, False), ("0", False), ("1", True)):
        if value is None:
            monkeypatch.delenv(q6_k_triton.Q6_K_ENV, raising=False)
        else:
            monkeypatch.setenv(q6_k_triton.Q6_K_ENV, value)
        q6_k_triton.enabled.cache_clear()
        assert q6_k_triton.enabled() is on
    q6_k_triton.enabled.cache_clear()


def test_the_accuracy_runs_count_its_calls(monkeypatch):
    """glm5_generate's count (the accuracy stage fails a `-dense` row without one) sees
    each product the GGUF op runs here, none of the others, and is off with the switch."""
    from tests.models.glm5_generate import count_q6_k_triton_calls
    from vllm_gguf_plugin.quantization import linear, q6_k_triton

    monkeypatch.setattr(q6_k_triton, "mul_mat", q6_k_triton.mul_mat)  # restored after
    monkeypatch.setattr(linear.ops, "ggml_mul_mat_vec_a8", lambda *a: torch.zeros(1))
    monkeypatch.setattr("vllm.envs.VLLM_BATCH_INVARIANT", False, raising=False)
    monkeypatch.setattr(q6_k_triton, "enabled", lambda: False)
    assert count_q6_k_triton_calls() is None
    monkeypatch.setattr(q6_k_triton, "enabled", lambda: True)
    counted = count_q6_k_triton_calls()
    blocks = q6_k_blocks(64, 256, 2)
    for tokens in (8, 1, 32):
        x = torch.randn(tokens, 256).half()
        linear._fused_mul_mat_gguf(x, blocks, int(T.Q6_K))
    assert counted == {"q6_k": 2}


def compile_tiles(arch: int) -> list[dict]:
    """The tile, float16 and bfloat16, one K split and several, compiled for `arch` (in
    a plain process): registers, spills, asynchronous copies."""
    from tests.v1.attention.test_triton_mla_sparse_targets import (
        compile_kernel,
        real_triton,
        resource_usage,
    )

    real_triton()
    from vllm_gguf_plugin.quantization import q6_k_triton as q6

    out = []
    tile = q6.TILE
    for dtype, split in ((d, s) for d in ("fp16", "bf16") for s in (1, 2)):
        sig = {"x_ptr": f"*{dtype}", "w_ptr": "*u8",
               "y_ptr": f"*{dtype}" if split == 1 else "*fp32"}
        sig.update({name: "i32" for name in ("M", "N", "K_BLOCKS", "stride_xm",
                                             "stride_wn", "stride_ys", "stride_ym")})
        kernel = compile_kernel(
            q6._q6_k_gemm_kernel, arch, sig,
            {"BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "SPLIT_K": split},
            ["x_ptr", "y_ptr", "stride_xm", "stride_ym"],
            {"num_warps": tile.num_warps})
        out.append({"kernel": "linear", "dtype": dtype, "split": split,
                    "async_copies": async_copies(kernel.asm["ptx"]),
                    **resource_usage(kernel.asm["cubin"])})
    return out


def specializations(token_counts: list[int]) -> list[str]:
    """The key Triton compiles the linear kernel under (for SM90, in a plain process) for
    an output-head-shaped product of each token count, split in two."""
    from tests.v1.attention.test_triton_mla_sparse_targets import real_triton

    real_triton()
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import create_function_from_signature
    from vllm_gguf_plugin.quantization import q6_k_triton as q6

    kernel = q6._q6_k_gemm_kernel
    bind = create_function_from_signature(kernel.signature, kernel.params,
                                          CUDABackend(GPUTarget("cuda", 90, 32)))
    n, k_blocks = 64, 24
    w = torch.empty(n, k_blocks * 210, dtype=torch.uint8)
    out = []
    for m in token_counts:
        x = torch.empty(m, k_blocks * 256, dtype=torch.float16)
        y = torch.empty(2, m, n, dtype=torch.float32)
        _, key, _ = bind(x, w, y, m, n, k_blocks, x.stride(0), w.stride(0), y.stride(0),
                         y.stride(1), BLOCK_M=q6.TILE.block_m, BLOCK_N=q6.TILE.block_n,
                         SPLIT_K=2, num_warps=q6.TILE.num_warps)
        out.append(str(key))
    return out


def test_one_compile_for_every_token_count(run_without_gpu):
    """Triton compiles a kernel again where an integer argument's value == 1 or % 16
    changes. The output head's product runs outside CUDA graphs, so a token count new to
    the process (8 after 32) would compile mid-decode: the H200's batch-8 rows of 2026-12-04
    (docs/results.md). One key for 8 to 64 tokens."""
    keys = run_without_gpu(__name__, "keys", timeout=300)
    assert len(keys) == 5 and len(set(keys)) == 1


def async_copies(ptx: str) -> int:
    """cp.async instructions: global loads that the next ones need not wait for."""
    return len(re.findall(r"cp\.async\.c[ag]\.", ptx))


@pytest.mark.parametrize("arch", ARCHS)
def test_tile_compiles_without_spills_and_loads_ahead(run_without_gpu, arch):
    """A tile that spills registers goes through local memory in its main loop; one
    whose activation loads are under 4 bytes a thread cannot copy them asynchronously and
    waits on each (16 rows on 8 warps: twice the barriers, and at 8 tokens twice the time
    of 32 rows on the H200, docs/results.md). Neither, on any GPU generation that runs
    it."""
    compiled = run_without_gpu(__name__, str(arch), timeout=900)
    assert len(compiled) == 4  # float16 and bfloat16, one K split and two
    assert [c for c in compiled if c["spills"] or not c["async_copies"]] == []


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,limit", [(torch.float16, 0.002), (torch.bfloat16, 0.01)])
@pytest.mark.parametrize("tokens", [2, 8, 33, 64, 255])
@pytest.mark.parametrize("n,k", [(2624, 6144), (6144, 16384)])  # qkv_a, o_proj
def test_product_matches_float32(dtype, limit, tokens, n, k):
    from vllm_gguf_plugin.quantization import q6_k_triton

    blocks = q6_k_blocks(n, k, tokens).cuda()
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = (torch.randn(tokens, k, device="cuda", generator=gen) * k ** -0.5).to(dtype)
    out = q6_k_triton.mul_mat(x, blocks)
    assert out.dtype == dtype
    ref = x.float() @ dequantize(blocks, k).T
    assert bench.rel_error(out, ref) < limit


if __name__ == "__main__":
    if sys.argv[1] == "keys":
        print(json.dumps(specializations([8, 16, 24, 33, 64])))
    else:
        print(json.dumps(compile_tiles(int(sys.argv[1]))))
