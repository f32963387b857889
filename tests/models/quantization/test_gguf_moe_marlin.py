# SPDX-License-Identifier: Apache-2.0
"""Q4_K routed experts on vLLM's Marlin MoE (vllm_gguf_plugin.quantization.moe_marlin).

CPU: the Q4_K blocks' codes and group values against gguf-py's dequantization (exactly,
in float32), Marlin's form s * (q - 8) + b within the 16-bit rounding of s and b, the
GPTQ packing against vLLM's gptq_pack, the b-part's product on vLLM's Triton fused-MoE
kernel under the interpreter against a float32 loop (one pair a block, the pairs sorted
by expert, an expert group), the whole routed MoE with float32 stand-ins for the CUDA ops
(the b-parts' places in fused_marlin_moe's hooks; with a Q6_K down product, Marlin's
gate_up alone before it), which layers and products convert and which GGUF bytes go.
GPU: the routed MoE against float32 products of gguf-py's dequantization, float16 and
bfloat16, 1 to 3100 tokens, with a Q4_K and a Q6_K down product.
"""

import pytest
import torch
from gguf import GGMLQuantizationType as T

from benchmarks.kernels import benchmark_gguf_ops as bench
from tests.models.quantization.test_gguf_moe_large_experts import _align
from tests.models.quantization.test_gguf_moe_prefill import (
    _float32_moe,
    _gguf_dequantize,
    _random_blocks,
)


# a block's bytes, and the offset and count of its float16 fields (Q4_K: d, dmin; Q6_K: d)
K_QUANT_BLOCKS = {T.Q4_K: (144, 0, 2), T.Q6_K: (210, 208, 1)}


def k_quant_blocks(qtype, rows: int, cols: int, seed: int) -> torch.Tensor:
    """[rows, cols / 256 * bytes] blocks of qtype: every bit of the codes and scales
    random, the float16 fields finite values of a real file's size."""
    nbytes, at, halves = K_QUANT_BLOCKS[qtype]
    gen = torch.Generator().manual_seed(seed)
    nb = rows * cols // 256
    raw = torch.randint(0, 256, (nb, nbytes), dtype=torch.uint8, generator=gen)
    d = (torch.rand(nb, halves, generator=gen) * 2e-4 + 1e-5).half()
    raw[:, at:at + 2 * halves] = d.view(torch.uint8)
    return raw.view(rows, -1)


def q4_k_blocks(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Q4_K blocks: every bit of the codes and of the packed 6-bit scales and mins
    random, d and dmin finite."""
    return k_quant_blocks(T.Q4_K, rows, cols, seed)


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """gguf-py's float32 values of Q4_K blocks [rows, bytes]."""
    rows, nbytes = blocks.shape
    return _gguf_dequantize(blocks, T.Q4_K, rows, nbytes // 144 * 256, torch.float32)


def test_q4_k_parts_are_gguf_pys_values():
    from vllm_gguf_plugin.quantization.moe_marlin import q4_k_parts

    blocks = q4_k_blocks(6, 512, 0)
    q, d_sc, dmin_m = q4_k_parts(blocks)
    assert q.shape == (6, 512) and d_sc.shape == dmin_m.shape == (6, 16)
    assert q.dtype == torch.uint8 and int(q.max()) == 15 and int(q.min()) == 0
    w = (d_sc.repeat_interleave(32, 1) * q.float() - dmin_m.repeat_interleave(32, 1))
    torch.testing.assert_close(w, dequantize(blocks), rtol=0, atol=0)


@pytest.mark.parametrize("dtype,eps", [(torch.float16, 2.0**-11), (torch.bfloat16, 2.0**-8)])
def test_marlin_form_within_its_rounding(dtype, eps):
    from vllm_gguf_plugin.quantization.moe_marlin import marlin_parts, q4_k_parts

    blocks = q4_k_blocks(8, 1024, 1)
    q, s, b = marlin_parts(blocks, dtype)
    assert s.dtype == b.dtype == dtype
    w = (s.float().repeat_interleave(32, 1) * (q.float() - 8)
         + b.float().repeat_interleave(32, 1))
    ref = dequantize(blocks)
    _, d_sc, dmin_m = q4_k_parts(blocks)
    # s's rounding times a code (up to 15), b's rounding: half an ulp each
    bound = (eps * (15 * d_sc + (8 * d_sc - dmin_m).abs())).repeat_interleave(32, 1)
    err = (w - ref).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    assert float(err.max()) > 0  # the rounding is there: the bound is what is tested


def test_pack_int4_rows_is_gptqs_packing():
    from vllm.model_executor.layers.quantization.utils.quant_utils import gptq_pack
    from vllm_gguf_plugin.quantization.moe_marlin import pack_int4_rows

    q = torch.randint(0, 16, (2, 64, 24), generator=torch.Generator().manual_seed(1),
                      dtype=torch.uint8)
    packed = pack_int4_rows(q)
    assert packed.dtype == torch.int32 and packed.shape == (2, 8, 24)
    for e in range(2):
        assert torch.equal(packed[e], gptq_pack(q[e].int(), 4, 64, 24))


@pytest.mark.parametrize("experts,sorted_pairs,group", [(64, False, None), (8, True, None),
                                                       (8, True, (2, 5))])
@pytest.mark.parametrize("weighted", [False, True])
def test_routed_product_matches_float32(experts, sorted_pairs, group, weighted):
    """The b-part: gs[p // top_k] @ b[expert].T per pair, on upstream's Triton kernel
    (interpreted on the CPU), gate_up-like (top_k 2) and down-like (weighted); with an
    expert group (the dequantized down product's, moe_prefill), the group's experts by
    their local ids and zeros for the other pairs."""
    from vllm.model_executor.layers.fused_moe.fused_moe import _prepare_expert_assignment
    from vllm_gguf_plugin.quantization import moe_marlin

    gen = torch.Generator().manual_seed(2)
    tokens, top_k, n, groups = 3, 2, 80, 24  # n, groups: not whole tiles
    topk_ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k]
                            for _ in range(tokens)]).to(torch.int32)
    gs = torch.randn(tokens, groups, generator=gen).half()
    bias = torch.randn(experts, n, groups, generator=gen).half()
    topk_w = torch.rand(tokens, top_k, generator=gen) if weighted else None
    if sorted_pairs:  # as moe_align_block_size returns them, for 16-row blocks
        assignment = _align(topk_ids, moe_marlin.BIAS_CONFIG["BLOCK_SIZE_M"], experts)
    else:  # the tokens touch few experts: one pair a block
        assignment = _prepare_expert_assignment(topk_ids, moe_marlin.BIAS_CONFIG, tokens,
                                                top_k, experts, None)
        assert assignment[0] is None
    first, end = group or (0, experts)
    if group:  # as moe_align_block_size marks them with an expert map
        ids = assignment[1]
        local = torch.where((ids >= first) & (ids < end), ids - first, -1)
        assignment = (assignment[0], local.to(ids.dtype), assignment[2])
    out = moe_marlin.routed_product(gs, bias[first:end], assignment, top_k, topk_w)
    ref = torch.stack([gs[p // top_k].float() @ bias[e].float().T
                       * (topk_w.flatten()[p] if weighted else 1) * (first <= e < end)
                       for p, e in enumerate(topk_ids.flatten().tolist())])
    assert out.shape == (tokens * top_k, n) and out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())


@pytest.mark.parametrize("types,cap,converts", [  # (the layer, its down product)
    ((T.Q4_K, T.Q4_K), 90, (True, True)),
    ((T.Q4_K, T.Q4_K), 120, (True, True)),
    ((T.Q4_K, T.Q4_K), 80, (True, True)),
    ((T.Q4_K, T.Q4_K), 75, (False, False)),  # Marlin's MoE: SM80 on
    ((T.Q4_K, T.Q6_K), 90, (True, False)),  # half of a Q4_K_M file's layers
    ((T.Q4_K, T.Q6_K), 75, (False, False)),
    ((T.Q4_K, T.BF16), 90, (False, False)),  # a down type the one-pair kernel lacks
    ((T.Q6_K, T.Q4_K), 90, (False, False)),  # gate_up routes the layer: Marlin or none
    ((T.Q8_0, T.Q8_0), 90, (False, False)),
])
def test_which_layers_convert(monkeypatch, types, cap, converts):
    from vllm_gguf_plugin.quantization import gguf_kernels

    monkeypatch.delenv(gguf_kernels.MOE_MARLIN_ENV, raising=False)
    assert gguf_kernels.moe_marlin(*map(int, types), capability=cap,
                                   batch_invariant=False) == converts


def test_on_unless_turned_off(monkeypatch):
    """On with VLLM_GGUF_MOE_MARLIN unset or 1; with 0, or batch invariance asked for,
    convert_layer leaves every layer to the GGUF kernels without reading it."""
    from vllm_gguf_plugin.quantization import gguf_kernels

    def converts(bi=False):
        return gguf_kernels.moe_marlin(int(T.Q4_K), int(T.Q4_K), capability=90,
                                       batch_invariant=bi)

    monkeypatch.delenv(gguf_kernels.MOE_MARLIN_ENV, raising=False)
    assert gguf_kernels.moe_marlin_enabled() and converts() == (True, True)
    monkeypatch.setenv(gguf_kernels.MOE_MARLIN_ENV, "0")
    assert not gguf_kernels.moe_marlin_enabled() and converts() == (False, False)
    monkeypatch.setenv(gguf_kernels.MOE_MARLIN_ENV, "1")
    assert gguf_kernels.moe_marlin_enabled() and converts() == (True, True)
    # batch invariance keeps the GGUF kernels: Marlin's tiles follow the token count
    assert converts(bi=True) == (False, False)


@pytest.mark.parametrize("down_type", [T.Q4_K, T.Q6_K])
def test_convert_layer_keeps_a_gguf_down_product(monkeypatch, down_type):
    """A converted layer's GGUF bytes are released product by product: a Q6_K down
    product keeps its stack (the GGUF kernels read it after Marlin's gate_up)."""
    from types import SimpleNamespace

    from vllm_gguf_plugin.quantization import gguf_kernels, moe_marlin

    monkeypatch.delenv(gguf_kernels.MOE_MARLIN_ENV, raising=False)
    monkeypatch.setattr("vllm.envs.VLLM_BATCH_INVARIANT", False, raising=False)
    monkeypatch.setattr(gguf_kernels, "device_capability", lambda: 90)
    monkeypatch.setattr(moe_marlin, "marlin_experts", lambda w, dtype: ("marlin", w.shape))

    def param(*shape):
        return torch.nn.Parameter(torch.ones(*shape, dtype=torch.uint8), requires_grad=False)

    layer = SimpleNamespace(w13_qweight=param(2, 512, 144), w2_qweight=param(2, 256, 288),
                            w13_qweight_type=SimpleNamespace(weight_type=int(T.Q4_K)),
                            w2_qweight_type=SimpleNamespace(weight_type=int(down_type)))
    w13, w2 = moe_marlin.convert_layer(layer, torch.float16)
    assert w13 == ("marlin", (2, 512, 144)) and layer.w13_qweight.numel() == 0
    if down_type == T.Q4_K:
        assert w2 == ("marlin", (2, 256, 288)) and layer.w2_qweight.numel() == 0
    else:
        assert w2 is None and layer.w2_qweight.shape == (2, 256, 288)


def test_marlin_fused_moe_passes_a_gguf_down_only_where_it_stayed(monkeypatch):
    """The engine's entry (GGUFMoEMethod.apply): a layer with both products converted runs
    moe_marlin.fused_moe with no GGUF down product; one whose down stayed GGUF hands it
    _gguf_moe_down on that stack and type."""
    from vllm_gguf_plugin.quantization import fused_moe, moe_marlin

    seen = []
    monkeypatch.setattr(moe_marlin, "fused_moe", lambda *args: seen.append(args) or "out")
    monkeypatch.setattr(fused_moe, "_gguf_moe_down", lambda x, **kw: ("down", x, kw))
    w2, ids = torch.zeros(2, 4, 8), torch.zeros(3, 2, dtype=torch.int32)
    for marlin in (("w13", "w2"), ("w13", None)):
        assert fused_moe.marlin_fused_moe("x", marlin, w2, 14, "weights", ids, "silu") == "out"
    (full, mixed) = seen
    assert full == ("x", "w13", "w2", "weights", ids, "silu", None)
    assert mixed[:6] == ("x", "w13", None, "weights", ids, "silu")
    assert mixed[6]("a") == ("down", "a", {"w": w2, "qweight_type": 14, "topk_ids": ids})


@pytest.mark.parametrize("tokens", [1, 5])  # one pair a block; pairs sorted by expert
@pytest.mark.parametrize("down_type", [T.Q4_K, T.Q6_K])
def test_marlin_moe_hooks_on_the_cpu(monkeypatch, tokens, down_type):
    """fused_moe's b-parts around vLLM's fused_marlin_moe with the CUDA ops standing in:
    Marlin's GEMM a float32 product of s * (q - 8) per pair (a stand-in that reads the
    experts unpacked), the routing alignment the tests' _align, the workspace a zero and
    the activation torch's silu-and-mul. The MoE must be gguf-py's dequantization's: each
    b-part added once, before the activation (gate_up) and with the top-k weight (down).
    A Q6_K down product stays GGUF: Marlin's gate_up alone, then `gguf_down` (here gguf-py's
    float32 product per pair) and the top-k weights."""
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.fused_moe import fused_moe as upstream_fused_moe
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts import marlin_moe
    from vllm_gguf_plugin.quantization import moe_marlin

    e, h, i, top_k, dtype = 8, 256, 256, 2, torch.float16
    stacks = {"w13": q4_k_blocks(e * 2 * i, h, 6).view(e, 2 * i, -1),
              "w2": (q4_k_blocks(e * h, i, 7) if down_type == T.Q4_K
                     else _random_blocks(T.Q6_K, e * h, i, 7)).view(e, h, -1)}
    unpacked, experts = {}, []
    for name, blocks in stacks.items():
        if name == "w2" and down_type != T.Q4_K:
            experts.append(None)
            continue
        q, s, b = moe_marlin.marlin_parts(blocks, dtype)
        # Marlin's packed shape [e, k / 16, 2n], which fused_marlin_moe checks and reads
        # its sizes from
        qweight = torch.zeros(e, q.shape[2] // 16, 2 * q.shape[1], dtype=torch.int32)
        unpacked[qweight.data_ptr()] = s.float().repeat_interleave(32, -1) * (q.float() - 8)
        experts.append(moe_marlin.MarlinExperts(qweight, s, b))

    def marlin_gemm(a, c, b_q, b_bias, b_scales, a_scales, global_scale, zeros, g_idx, perm,
                    workspace, sorted_ids, expert_ids, padded, topk_w, *, moe_block_size,
                    top_k, mul_topk_weights, size_m, size_n, size_k, **_):
        w = unpacked[b_q.data_ptr()]
        out = c.view(-1, size_n)
        for blk, ex in enumerate(expert_ids.tolist()):
            for p in sorted_ids[blk * moe_block_size:(blk + 1) * moe_block_size].tolist():
                if p < size_m * top_k:
                    row = a[p // top_k].float() @ w[ex].T
                    out[p] = row * (topk_w.flatten()[p] if mul_topk_weights else 1)
        return c

    def align(topk_ids, block_m, experts, *args, **kwargs):
        return _align(topk_ids, block_m, experts)

    def silu_and_mul(activation, output, input, **kwargs):
        output.copy_(bench._silu_and_mul(input))

    def gguf_down(a):  # float32 products of gguf-py's dequantization, a pair a row
        w = {ex: _gguf_dequantize(stacks["w2"][ex], down_type, h, i, torch.float32)
             for ex in set(topk_ids.flatten().tolist())}
        return torch.stack([a[p].float() @ w[ex].T for p, ex in
                            enumerate(topk_ids.flatten().tolist())]).to(a.dtype)

    monkeypatch.setattr(ops, "moe_wna16_marlin_gemm", marlin_gemm, raising=False)
    for module in (marlin_moe, moe_marlin):
        monkeypatch.setattr(module, "moe_align_block_size", align)
        monkeypatch.setattr(module, "marlin_make_workspace_new", lambda *a: torch.zeros(1))
    monkeypatch.setattr(upstream_fused_moe, "moe_align_block_size", align)
    monkeypatch.setattr(moe_marlin, "apply_moe_activation", silu_and_mul)
    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(tokens, h, generator=gen) * h ** -0.5).to(dtype)
    topk_ids = torch.stack([torch.randperm(e, generator=gen)[:top_k]
                            for _ in range(tokens)]).to(torch.int32)
    topk_w = torch.rand(tokens, top_k, generator=gen).softmax(dim=1)
    assignment = upstream_fused_moe._prepare_expert_assignment(
        topk_ids, moe_marlin.BIAS_CONFIG, tokens, top_k, e, None)
    assert (assignment[0] is None) == (tokens == 1)

    out = moe_marlin.fused_moe(x, *experts, topk_w, topk_ids, MoEActivation.SILU, gguf_down)
    ref = _float32_moe(x, stacks["w13"], stacks["w2"], (T.Q4_K, down_type), topk_w, topk_ids)
    assert out.shape == (tokens, h) and out.dtype == dtype
    assert bench.rel_error(out, ref) < 0.005


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,limit", [(torch.float16, 0.005), (torch.bfloat16, 0.02)])
@pytest.mark.parametrize("tokens", [1, 8, 33, 300, 1100, 3100])
@pytest.mark.parametrize("down_type", [T.Q4_K, T.Q6_K])
def test_marlin_moe_matches_float32(monkeypatch, dtype, limit, tokens, down_type):
    """The routed MoE on Marlin + the b-part against float32 products of gguf-py's
    dequantization of the same blocks; within the 16-bit rounding, far below the int8
    kernels' 1% (docs/results.md). A Q6_K down product on the GGUF kernels after
    Marlin's gate_up: the one-pair kernel, MMQ, a Triton tile and (3100 tokens) the
    dequantized experts in 3 groups; below 768 tokens int8 activations set its bound."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm_gguf_plugin.quantization import fused_moe, moe_marlin, moe_prefill

    e, h, i, top_k = 16, 512, 256, 4
    monkeypatch.setattr(moe_prefill, "DEQUANT_MOE_GROUP_VALUES", 6 * h * i)
    w13 = q4_k_blocks(e * 2 * i, h, 3).view(e, 2 * i, -1)
    w2 = (q4_k_blocks(e * h, i, 4) if down_type == T.Q4_K
          else _random_blocks(T.Q6_K, e * h, i, 4)).view(e, h, -1)
    if down_type != T.Q4_K and tokens < 768:
        limit = 0.02  # int8 activations of the one-pair kernel and MMQ
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(tokens, h, generator=gen) * h ** -0.5).to(dtype).cuda()
    topk_ids = torch.rand(tokens, e, generator=gen).topk(top_k, dim=1).indices
    topk_ids = topk_ids.to(torch.int32).cuda()
    topk_w = torch.rand(tokens, top_k, generator=gen).softmax(dim=1).cuda()

    w13, w2 = w13.cuda(), w2.cuda()
    experts = [moe_marlin.marlin_experts(w13, dtype),
               moe_marlin.marlin_experts(w2, dtype) if down_type == T.Q4_K else None]
    out = fused_moe.marlin_fused_moe(x, experts, w2, int(down_type), topk_w, topk_ids,
                                     MoEActivation.SILU)
    ref = _float32_moe(x, w13, w2, (T.Q4_K, down_type), topk_w, topk_ids)
    assert out.shape == (tokens, h) and out.dtype == dtype
    assert bench.rel_error(out, ref) < limit
