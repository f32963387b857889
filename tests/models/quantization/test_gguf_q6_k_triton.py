# SPDX-License-Identifier: Apache-2.0
"""Q6_K products of a few tokens on Triton GEMMs (vllm_gguf_plugin.quantization.q6_k_triton).

CPU: the kernels (Triton interpreter) against float32 products of gguf-py's
dequantization of random blocks (every bit of the codes and scales random): token and
weight row tails, K splits, launches of 16-64 token rows, padded rows, routed rows in
moe_align_block_size's padded blocks; the launches; where the GGUF products take them
(the switch, token counts, dtypes, types, batch invariance); the tile compiled for
SM80, SM90 and SM120 without register spills and with asynchronous loads. GPU: the same products at GLM-5's shapes
(256 experts for the routed one: offsets past 2^31 bytes), float16 and bfloat16, 2 to
255 tokens.
"""

import json
import re
import sys

import pytest
import torch
from gguf import GGMLQuantizationType as T

from benchmarks.kernels import benchmark_gguf_ops as bench
from tests.models.quantization.test_gguf_moe_large_experts import _align
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


def routed_reference(x, blocks, topk_ids, k):
    """Each row of x times the float32 dequantization of its expert's blocks."""
    flat = topk_ids.flatten().tolist()
    out = torch.empty(x.shape[0], blocks.shape[1], device=x.device)
    for e in set(flat):
        rows = [r for r, ex in enumerate(flat) if ex == e]
        out[rows] = x[rows].float() @ dequantize(blocks[e], k).T
    return out


def _align_in_vllms_buffer(topk_ids, block_m, experts):
    """_align's sort in a buffer of vLLM's size (each expert's padding at most), its tail
    invalid ids in blocks of no expert."""
    sorted_ids, block_experts, padded = _align(topk_ids, block_m, experts)
    size = topk_ids.numel() + experts * (block_m - 1)
    tail = size - sorted_ids.numel()
    return (torch.cat([sorted_ids, torch.full((tail,), topk_ids.numel(), dtype=torch.int32)]),
            torch.cat([block_experts, torch.full((tail // block_m + 1,), -1,
                                                 dtype=torch.int32)]), padded)


@pytest.mark.parametrize("align", [_align, _align_in_vllms_buffer])
@pytest.mark.parametrize("tokens,top_k,experts", [(3, 2, 4), (9, 2, 3), (20, 2, 2)])
def test_routed_product_is_gguf_pys(monkeypatch, tokens, top_k, experts, align):
    """Rows of a down product (row r of expert topk_ids.flatten()[r]) in 16-row blocks
    of one expert, padded with invalid ids, as moe_align_block_size sorts them."""
    from vllm.model_executor.layers.fused_moe import fused_moe as upstream
    from vllm_gguf_plugin.quantization import q6_k_triton

    monkeypatch.setattr(upstream, "moe_align_block_size", align)
    n, k = 64, 512
    blocks = torch.stack([q6_k_blocks(n, k, 10 + e) for e in range(experts)])
    gen = torch.Generator().manual_seed(tokens)
    topk_ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k]
                            for _ in range(tokens)]).int()
    x = (torch.randn(tokens * top_k, k, generator=gen) * k ** -0.5).half()
    out = q6_k_triton.moe_mul_mat(x, blocks, topk_ids)
    assert out.shape == (tokens * top_k, n) and out.dtype == torch.float16
    assert bench.rel_error(out, routed_reference(x, blocks, topk_ids, k)) < 2e-3
    with pytest.raises(ValueError, match="routed rows"):
        q6_k_triton.moe_mul_mat(x[1:], blocks, topk_ids)


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
    """8-64 tokens here, 65 up to the prefill's count dequantized for a 16-bit GEMM, fewer
    than 8 the plugin's MMVQ (6144 rows: up to 2 tokens) and MMQ; off, or another type or
    dtype, the plugin's kernels."""
    from vllm_gguf_plugin.quantization.linear import DEQUANT_GEMM_MIN_TOKENS

    assert [product(t) for t in (8, 16, 32, 33, 64)] == ["q6_k"] * 5
    assert product(8, dtype=torch.bfloat16) == "q6_k"
    assert [product(t) for t in (1, 2, 4, 7)] == ["mmvq", "mmvq", "mmq", "mmq"]
    assert [product(t) for t in (65, DEQUANT_GEMM_MIN_TOKENS - 1)] == ["dequant"] * 2
    assert product(DEQUANT_GEMM_MIN_TOKENS) == "dequant"
    assert product(8, on=False) == product(65, on=False) == "mmq"
    assert product(8, qtype=T.Q4_K) == product(65, qtype=T.Q4_K) == "mmq"
    assert product(8, dtype=torch.float32) == product(65, dtype=torch.float32) == "mmq"
    monkeypatch.setattr("vllm.envs.VLLM_BATCH_INVARIANT", True, raising=False)
    assert product(8) == product(65) == "batch-invariant"


def test_marlin_layers_down_product_takes_it_where_asked(monkeypatch):
    """fused_moe._gguf_moe_down (the down product of a layer whose gate_up runs on
    Marlin) runs a Q6_K down product of 8-255 tokens here where asked, by the layer's
    token count (its rows are tokens x top_k), else the plugin's kernels."""
    from vllm_gguf_plugin.quantization import fused_moe, q6_k_triton

    calls = []
    monkeypatch.setattr(q6_k_triton, "moe_mul_mat", lambda *a: calls.append("q6_k"))
    monkeypatch.setattr(fused_moe.ops, "ggml_moe_a8_vec", lambda *a: calls.append("vec"))
    monkeypatch.setattr(fused_moe, "moe_by_expert_group", lambda *a: calls.append("mmq"))
    monkeypatch.setattr("vllm.model_executor.layers.fused_moe.fused_moe.moe_align_block_size",
                        lambda *a: (None, None, None))
    monkeypatch.setattr(fused_moe.ops, "ggml_moe_get_block_size", lambda t: 16, raising=False)

    def down(tokens, qtype=T.Q6_K, on=True):
        monkeypatch.setattr(q6_k_triton, "enabled", lambda: on)
        calls.clear()
        fused_moe._gguf_moe_down(torch.zeros(tokens * 8, 256, dtype=torch.float16),
                                 torch.zeros(4, 64, 210, dtype=torch.uint8), int(qtype),
                                 torch.zeros(tokens, 8, dtype=torch.int32))
        return calls

    assert down(8) == down(32) == down(255) == ["q6_k"]
    assert down(1) == ["vec"] and down(7) == down(256) == down(32, on=False)
    assert down(32, on=False) == ["mmq"]
    assert down(32, qtype=T.Q4_K) == ["mmq"]


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
    each product the GGUF op runs here, none of the others, and the routed products, and
    is off with the switch."""
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
    monkeypatch.setattr(q6_k_triton, "moe_mul_mat", q6_k_triton.moe_mul_mat)  # restored after
    monkeypatch.setattr("vllm.model_executor.layers.fused_moe.fused_moe.moe_align_block_size",
                        _align)
    counted = count_q6_k_triton_calls()
    q6_k_triton.moe_mul_mat(torch.randn(4, 256).half(), torch.stack([blocks, blocks]),
                            torch.tensor([[0, 1], [1, 0]], dtype=torch.int32))
    assert counted == {"q6_k": 1}


def compile_tiles(arch: int) -> list[dict]:
    """The tile, float16 and bfloat16, one K split and several, and the routed kernel,
    compiled for `arch` (in a plain process): registers, spills, asynchronous copies."""
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
            ["x_ptr", "y_ptr", "stride_xm", "stride_ys", "stride_ym"],
            {"num_warps": tile.num_warps})
        out.append({"kernel": "linear", "dtype": dtype, "split": split,
                    "async_copies": async_copies(kernel.asm["ptx"]),
                    **resource_usage(kernel.asm["cubin"])})
    for dtype in ("fp16", "bf16"):
        sig = {"x_ptr": f"*{dtype}", "w_ptr": "*u8", "y_ptr": f"*{dtype}",
               "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "padded_ptr": "*i32"}
        sig.update({name: "i32" for name in ("M", "N", "K_BLOCKS", "stride_xm", "stride_we",
                                             "stride_wn", "stride_ym")})
        kernel = compile_kernel(
            q6._q6_k_moe_kernel, arch, sig, {"BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n},
            ["x_ptr", "y_ptr", "sorted_ids_ptr", "expert_ids_ptr", "stride_xm", "stride_ym"],
            {"num_warps": tile.num_warps})
        out.append({"kernel": "routed", "dtype": dtype,
                    "async_copies": async_copies(kernel.asm["ptx"]),
                    **resource_usage(kernel.asm["cubin"])})
    return out


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
    assert len(compiled) == 4 + 2  # the linear kernel's four, the routed kernel's two
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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,limit", [(torch.float16, 0.002), (torch.bfloat16, 0.01)])
@pytest.mark.parametrize("tokens", [2, 8, 33, 255])
def test_routed_product_matches_float32(dtype, limit, tokens):
    """GLM-5's down experts (256 of 6144 x 2048, 2.6 GB: offsets past 2^31 bytes), top-8
    of 16 of them."""
    from vllm_gguf_plugin.quantization import q6_k_triton

    experts, n, k, top_k = 256, 6144, 2048, 8
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    blocks = torch.randint(0, 256, (experts, n, k // 256 * 210), dtype=torch.uint8,
                           device="cuda", generator=gen)
    d = (torch.rand(experts, n, k // 256, 1, device="cuda", generator=gen) * 2e-4
         + 1e-5).half()
    blocks.view(experts, n, k // 256, 210)[..., 208:210] = d.view(torch.uint8)
    # from 16 experts (the reference dequantizes each on the CPU), the last one past
    # 2^31 bytes among them
    pool = torch.tensor([*range(15), experts - 1], device="cuda")
    topk_ids = torch.stack([pool[torch.randperm(16, device="cuda", generator=gen)[:top_k]]
                            for _ in range(tokens)]).int()
    x = (torch.randn(tokens * top_k, k, device="cuda", generator=gen) * k ** -0.5).to(dtype)
    out = q6_k_triton.moe_mul_mat(x, blocks, topk_ids)
    assert out.dtype == dtype
    assert bench.rel_error(out, routed_reference(x, blocks, topk_ids, k)) < limit


if __name__ == "__main__":
    print(json.dumps(compile_tiles(int(sys.argv[1]))))
