# SPDX-License-Identifier: Apache-2.0
"""Routed GGUF experts of a long prefill (vllm_gguf_plugin.quantization.moe_prefill).

From dequant_moe_min_tokens tokens on the experts are dequantized a group at a time and
run through vLLM's 16-bit fused MoE, with an expert map per group, instead of the
plugin's MMQ or one-pair kernels, whose time grows with every token.

CPU: which path each token count takes, by quant type (the kernels are recorded, not
run; moe_triton_tiles' Triton tiles among them); the groups' outputs add up to the MoE
of every expert at once, with gguf-py's dequantization and a float32 loop standing in
for the CUDA ops and vLLM's fused experts. GPU: the plugin's MoE op from
dequant_moe_min_tokens tokens on, in several groups, against float32 products of
gguf-py's dequantization.
"""

from unittest.mock import patch

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from benchmarks.kernels import benchmark_gguf_ops as bench
from tests.models.quantization.test_gguf_moe_large_experts import _align


def _moe_mapped(x, w13, w2, topk_weights, topk_ids, expert_map) -> torch.Tensor:
    """vLLM's fused_experts with an expert map (None: every expert), in float32 token by
    token: the experts the map sends to -1 contribute nothing."""
    out = torch.zeros(x.shape[0], w2.shape[1])
    for t in range(x.shape[0]):
        for k, e in enumerate(topk_ids[t].tolist()):
            e = int(expert_map[e]) if expert_map is not None else e
            if e < 0:
                continue
            a = bench._silu_and_mul(x[t].float() @ w13[e].float().T)
            out[t] += topk_weights[t, k].float() * (a @ w2[e].float().T)
    return out


def _gguf_dequantize(w, qtype, rows, cols, dtype):
    import gguf

    return torch.from_numpy(gguf.quants.dequantize(w.cpu().numpy(), qtype)
                            .astype(np.float32)).view(rows, cols).to(w.device, dtype)


def _random_blocks(qtype, rows, cols, seed):
    return bench.random_blocks(qtype.name, rows, cols, torch.Generator().manual_seed(seed))


def _float32_moe(x, w13, w2, types, topk_weights, topk_ids) -> torch.Tensor:
    """The benchmark's float32 MoE reference on gguf-py's dequantization of both stacks."""
    e, rows, _ = w13.shape
    h, i = w2.shape[1], rows // 2
    w13_32 = _gguf_dequantize(w13.reshape(e * rows, -1), types[0], e * rows, h,
                              torch.float32).view(e, rows, h)
    w2_32 = _gguf_dequantize(w2.reshape(e * h, -1), types[1], e * h, i,
                             torch.float32).view(e, h, i)
    return bench._moe_reference(x, w13_32, w2_32, topk_weights, topk_ids)


# the calls of each product at 1, 16, 32, 65, 384, 768, dequant_moe_min_tokens, 3072 and
# 6144 tokens (the one-pair and MMQ kernels and the Triton tiles run each product, the
# dequantized experts both at once)
COUNTS = (1, 16, 32, 65, 384, 768, 1024, 3072, 6144)
PATHS = {
    (T.Q4_K, T.Q6_K): [["vec", "vec"]] * 2 + [["mmq", "mmq"]] * 2
                      + [["triton-bm32", "mmq"], ["triton-bm64"] * 2, ["triton-bm64"] * 2,
                         ["dequant"], ["dequant"]],
    (T.Q4_K, T.Q4_K): [["vec", "vec"]] * 2 + [["mmq", "mmq"]] * 2
                      + [["triton-bm32"] * 2, ["triton-bm64"] * 2, ["triton-bm64"] * 2,
                         ["triton-bm64"] * 2, ["dequant"]],
    (T.Q6_K, T.Q6_K): [["vec", "vec"]] + [["mmq", "mmq"]] * 4 + [["triton-bm64"] * 2] * 2
                      + [["dequant"]] * 2,
    (T.Q8_0, T.Q8_0): [["vec", "vec"]] * 2 + [["mmq", "mmq"]] * 4 + [["dequant"]] * 3,
    (T.Q5_K, T.Q5_K): [["vec", "vec"]] * 3 + [["mmq", "mmq"]] * 3 + [["dequant"]] * 3,
    (T.IQ2_S, T.IQ3_S): [["vec", "vec"]] * 6 + [["dequant"]] * 3,
}


@pytest.mark.parametrize("types", list(PATHS))
def test_kernel_by_token_count(monkeypatch, types):
    """Below dequant_moe_min_tokens the plugin's own choice (its one-pair kernel up to 64
    tokens, MMQ beyond for K-quants and legacy quants, the one-pair kernel at every count
    for I-quants), except that MMQ starts at 32 tokens for Q4_K and Q8_0 and at 16 for
    Q6_K (the later of a layer's two types), and where moe_triton_tiles has a Triton tile
    for a product's type (Q4_K: 32 token rows from 384 tokens, 64 from 768 to 6143; Q6_K:
    64 from 768 to 3071; when both products have one, also past dequant_moe_min_tokens);
    from there on dequant_fused_moe, whose result is returned."""
    from vllm_gguf_plugin import ops
    from vllm_gguf_plugin.quantization import (fused_moe, gguf_kernels, moe_prefill,
                                               moe_triton_tiles)

    calls = []

    def kernel(name, top_k_at):
        def run(x, w, *args):  # (..., top_k, tokens) or (topk_ids, top_k, ..., tokens)
            calls.append(name)
            return torch.zeros(args[-1] * args[top_k_at], w.shape[1], dtype=x.dtype)
        return run

    def triton(x, w, qweight_type, block_m, topk_ids, rows, top_k, tokens):
        calls.append(f"triton-bm{block_m}")
        return torch.zeros(tokens * top_k, rows, dtype=x.dtype)

    def dequant(x, *args):
        calls.append("dequant")
        return torch.full_like(x, 7.0)

    monkeypatch.setattr("vllm.envs.VLLM_BATCH_INVARIANT", False, raising=False)
    monkeypatch.setattr(ops, "ggml_moe_a8", kernel("mmq", -2))
    monkeypatch.setattr(ops, "ggml_moe_a8_vec", kernel("vec", 1))
    monkeypatch.setattr(ops, "moe_sum", lambda out, hidden: hidden.copy_(out.sum(1)))
    monkeypatch.setattr(moe_prefill, "dequant_fused_moe", dequant)
    monkeypatch.setattr(moe_triton_tiles, "triton_moe_product", triton)
    monkeypatch.setattr(fused_moe, "apply_moe_activation",
                        lambda act, out, inp: out.copy_(bench._silu_and_mul(inp)))
    big = gguf_kernels.TABLE.dequant_moe_min_tokens
    align = "vllm.model_executor.layers.fused_moe.fused_moe.moe_align_block_size"
    with patch(align, lambda ids, block, e: (torch.zeros(1), torch.zeros(1), torch.zeros(1))):
        assert big == 1024
        for rows, expected in zip(COUNTS, PATHS[types], strict=True):
            calls.clear()
            x = torch.zeros(rows, 32, dtype=torch.float16)
            ids = torch.zeros(rows, 2, dtype=torch.int32)
            out = fused_moe._fused_moe_gguf(
                x, torch.zeros(4, 16, 8, dtype=torch.uint8),
                torch.zeros(4, 32, 4, dtype=torch.uint8), torch.ones(rows, 2), ids,
                int(types[0]), int(types[1]), "silu")
            assert calls == expected, rows
            assert torch.equal(out, torch.full_like(x, 7.0)) == (expected == ["dequant"])


# the down product alone, after a gate_up on Marlin (moe_marlin), at COUNTS: its own
# type's choice (MMQ from 16 tokens for Q6_K, not the layer's later of two types)
DOWN_PATHS = {
    T.Q6_K: ["vec"] + ["mmq"] * 4 + ["triton-bm64"] * 2 + ["dequant"] * 2,
    T.Q5_K: ["vec"] * 3 + ["mmq"] * 3 + ["dequant"] * 3,
    T.IQ3_S: ["vec"] * 6 + ["dequant"] * 3,
}


@pytest.mark.parametrize("qtype", list(DOWN_PATHS))
def test_down_kernel_by_token_count(monkeypatch, qtype):
    """A layer whose gate_up runs on Marlin keeps its down product on the kernel
    _fused_moe_gguf would pick for that type alone, a row per (token, expert) pair:
    the one-pair kernel, MMQ, a Triton tile, or from dequant_moe_min_tokens on the
    dequantized experts (dequant_moe_product), whose result is returned."""
    from vllm_gguf_plugin import ops
    from vllm_gguf_plugin.quantization import fused_moe, moe_prefill, moe_triton_tiles

    calls = []

    def kernel(name, top_k_at):
        def run(x, w, *args):
            calls.append(name)
            assert args[top_k_at] == 1 and args[-1] == x.shape[0]  # a row per pair
            return torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype)
        return run

    def triton(x, w, qweight_type, block_m, topk_ids, rows, top_k, tokens):
        calls.append(f"triton-bm{block_m}")
        assert top_k == 1 and tokens == x.shape[0]
        return torch.zeros(tokens, rows, dtype=x.dtype)

    def dequant(x, w, qweight_type, topk_ids):
        calls.append("dequant")
        return torch.full((x.shape[0], w.shape[1]), 7.0, dtype=x.dtype)

    monkeypatch.setattr(ops, "ggml_moe_a8", kernel("mmq", -2))
    monkeypatch.setattr(ops, "ggml_moe_a8_vec", kernel("vec", 1))
    monkeypatch.setattr(moe_prefill, "dequant_moe_product", dequant)
    monkeypatch.setattr(moe_triton_tiles, "triton_moe_product", triton)
    align = "vllm.model_executor.layers.fused_moe.fused_moe.moe_align_block_size"
    with patch(align, lambda ids, block, e: (torch.zeros(1), torch.zeros(1), torch.zeros(1))):
        for tokens, expected in zip(COUNTS, DOWN_PATHS[qtype], strict=True):
            calls.clear()
            a = torch.zeros(tokens * 2, 16, dtype=torch.float16)
            out = fused_moe._gguf_moe_down(a, torch.zeros(4, 32, 4, dtype=torch.uint8),
                                           int(qtype), torch.zeros(tokens, 2, dtype=torch.int32))
            assert calls == [expected], tokens
            assert out.shape == (tokens * 2, 32)
            assert bool((out == 7.0).all()) == (expected == "dequant")


@pytest.mark.parametrize("group_values,groups", [(1 << 28, 1), (3 * 256 * 256, 3)])
def test_down_expert_groups_add_up(monkeypatch, group_values, groups):
    """dequant_moe_product: each group's pairs on vLLM's Triton fused-MoE kernel
    (interpreted on the CPU) with the group's expert map, zeros for the other pairs, the
    groups added: every pair's row a[p] @ w[expert].T of gguf-py's dequantization."""
    from vllm_gguf_plugin import ops
    from vllm_gguf_plugin.quantization import moe_prefill

    e, h, i, top_k, m = 8, 256, 256, 3, 4
    w2 = _random_blocks(T.Q6_K, e * h, i, 1).view(e, h, -1)
    gen = torch.Generator().manual_seed(3)
    a = (torch.randn(m * top_k, i, generator=gen) * i ** -0.5).to(torch.float16)
    topk_ids = torch.rand(m, e, generator=gen).topk(top_k, dim=1).indices.to(torch.int32)
    maps = []

    def align(ids, block, experts, expert_map):  # moe_align_block_size's, mapped
        maps.append(expert_map)
        sorted_ids, expert_ids, padded = _align(ids, block, experts)
        return sorted_ids, expert_map[expert_ids.long()].to(expert_ids.dtype), padded

    config = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}
    monkeypatch.setattr(ops, "ggml_dequantize", _gguf_dequantize)
    monkeypatch.setattr(moe_prefill, "moe_align_block_size", align)
    monkeypatch.setattr(moe_prefill, "try_get_optimal_moe_config", lambda *args: config)
    monkeypatch.setattr(moe_prefill, "DEQUANT_MOE_GROUP_VALUES", group_values)
    out = moe_prefill.dequant_moe_product(a, w2, int(T.Q6_K), topk_ids)
    assert len(maps) == groups and sum(int((mp >= 0).sum()) for mp in maps) == e
    w32 = _gguf_dequantize(w2.reshape(e * h, -1), T.Q6_K, e * h, i, torch.float32).view(e, h, i)
    ref = torch.stack([a[p].float() @ w32[ex].T
                       for p, ex in enumerate(topk_ids.flatten().tolist())])
    torch.testing.assert_close(out.float(), ref, rtol=0.01, atol=0.01 * ref.abs().max().item())


def test_triton_tiles_cover_rising_counts():
    # each type's tiles in rising, disjoint token counts, all past the one-pair
    # kernel's 64, each tile a power of two of at least 16 rows (tensor-core dots)
    from vllm_gguf_plugin.quantization import gguf_kernels as mtt
    from vllm_gguf_plugin.quantization.moe_triton_tiles import TRITON_MOE_KERNELS

    assert set(mtt.TABLE.triton_moe_tiles) == set(TRITON_MOE_KERNELS)
    for qtype, tiles in mtt.TABLE.triton_moe_tiles.items():
        assert tiles[0].first > 64, qtype
        for a, b in zip(tiles, tiles[1:]):
            assert a.first <= a.last < b.first <= b.last, qtype
        assert all(t.block_m >= 16 and t.block_m & (t.block_m - 1) == 0 for t in tiles)
        for t in tiles:
            assert mtt.triton_tile(qtype, t.first) == mtt.triton_tile(qtype, t.last) == t
        assert mtt.triton_tile(qtype, tiles[0].first - 1) is None
        assert mtt.triton_tile(qtype, tiles[-1].last + 1) is None
    assert mtt.triton_tile(int(T.Q8_0), 512) is None


def test_mmq_from_fewer_tokens_only_for_mmq_types():
    # the table's MMQ counts only move MMQ earlier, for types the plugin has MMQ for, and
    # a layer starts MMQ at the later of its two types' counts
    from vllm_gguf_plugin.quantization import gguf_kernels as mtt
    from vllm_gguf_plugin.quantization.utils import MMQ_QUANT_TYPES

    plugin = mtt.TABLE.plugin_mmq_min_tokens
    assert plugin == 65
    for qtype, first in mtt.TABLE.mmq_min_tokens_by_type.items():
        assert qtype in MMQ_QUANT_TYPES and 1 < first < plugin, qtype
    assert mtt.mmq_min_tokens(int(T.Q4_K), int(T.Q6_K)) == 32
    assert mtt.mmq_min_tokens(int(T.Q6_K), int(T.Q6_K)) == 16
    assert mtt.mmq_min_tokens(int(T.Q6_K), int(T.Q5_K)) == 65


@pytest.mark.parametrize("group_values,groups", [(1 << 28, 1), (3 * 512 * 256, 3)])
def test_expert_groups_add_up_to_all_experts(monkeypatch, group_values, groups):
    from vllm_gguf_plugin import ops
    from vllm_gguf_plugin.quantization import moe_prefill
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    e, h, i, top_k, m = 8, 256, 256, 3, 6
    qtypes = (T.Q4_K, T.Q6_K)
    w13 = _random_blocks(qtypes[0], e * 2 * i, h, 0).view(e, 2 * i, -1)
    w2 = _random_blocks(qtypes[1], e * h, i, 1).view(e, h, -1)
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(m, h, generator=gen) * h ** -0.5).to(torch.float16)
    topk_ids = torch.rand(m, e, generator=gen).topk(top_k, dim=1).indices.to(torch.int32)
    topk_w = torch.rand(m, top_k, generator=gen).softmax(dim=1)

    seen = []

    def fused_experts(x, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                      expert_map):
        assert activation == MoEActivation.SILU and global_num_experts == e
        seen.append(w1.shape[0])
        return _moe_mapped(x, w1, w2, topk_weights, topk_ids, expert_map).to(x.dtype)

    monkeypatch.setattr(ops, "ggml_dequantize", _gguf_dequantize)
    monkeypatch.setattr(moe_prefill, "fused_experts", fused_experts)
    monkeypatch.setattr(moe_prefill, "DEQUANT_MOE_GROUP_VALUES", group_values)
    out = moe_prefill.dequant_fused_moe(x, w13, w2, topk_w, topk_ids, int(qtypes[0]),
                                        int(qtypes[1]), MoEActivation.SILU)
    assert len(seen) == groups and sum(seen) == e
    ref = _float32_moe(x, w13, w2, qtypes, topk_w, topk_ids)
    torch.testing.assert_close(out.float(), ref, rtol=0.01, atol=0.01 * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("types", [(T.Q4_K, T.Q6_K), (T.Q8_0, T.Q8_0), (T.IQ2_S, T.IQ3_S)])
def test_long_prefill_matches_float32(monkeypatch, types):
    """The plugin's MoE op at dequant_moe_min_tokens tokens, in 3 expert groups, against
    float32 products of gguf-py's dequantization."""
    from vllm_gguf_plugin.quantization import gguf_kernels, moe_prefill
    from vllm_gguf_plugin.quantization.fused_moe import _fused_moe_gguf

    e, h, i, top_k = 12, 512, 256, 4
    m = gguf_kernels.TABLE.dequant_moe_min_tokens
    monkeypatch.setattr("vllm.envs.VLLM_BATCH_INVARIANT", False, raising=False)
    monkeypatch.setattr(moe_prefill, "DEQUANT_MOE_GROUP_VALUES", 4 * 2 * i * h)
    w13 = _random_blocks(types[0], e * 2 * i, h, 0).cuda().view(e, 2 * i, -1)
    w2 = _random_blocks(types[1], e * h, i, 1).cuda().view(e, h, -1)
    x = (torch.randn(m, h, device="cuda") * h ** -0.5).to(torch.float16)
    topk_ids = torch.rand(m, e, device="cuda").topk(top_k, dim=1).indices.to(torch.int32)
    topk_w = torch.rand(m, top_k, device="cuda").softmax(dim=1)

    out = _fused_moe_gguf(x, w13, w2, topk_w, topk_ids, int(types[0]), int(types[1]),
                          "silu")
    ref = _float32_moe(x, w13, w2, types, topk_w, topk_ids)
    torch.testing.assert_close(out.float(), ref, rtol=0.02, atol=0.02 * ref.abs().max().item())
