# SPDX-License-Identifier: Apache-2.0
"""GGUF products under VLLM_BATCH_INVARIANT=1 (vllm_gguf_plugin.quantization.batch_invariant).

The plugin picks kernels by token count (int8-activation MMVQ for a few rows, MMQ or
dequantize + GEMM beyond), so a token's logits depend on how many tokens share its step;
on the H200 the Q4_K_M and IQ2_M tiny GLM-5 gave other greedy text alone than batched,
and with MTP than without (docs/results.md#4-mtp). Under batch invariance
every token count takes one fixed-tile Triton kernel.

CPU: which kernel each product reaches at each token count, with and without the mode
(the kernels are recorded, not run: the plugin's kernels need CUDA tensors). GPU: the
property itself, each row of a batch bitwise equal to the row computed alone, for the
dense product and the routed experts, and the plugin's default path shown to differ
(so the comparison can fail)."""

from unittest.mock import patch

import pytest
import torch
from gguf import GGMLQuantizationType as T

TOKEN_COUNTS = (1, 2, 7, 16, 17, 65, 300)


class Recorder:
    """Stands in for the plugin's kernels: records (kernel, rows) and returns zeros of
    the product's shape."""

    def __init__(self):
        self.calls = []

    def dense(self, name):
        def kernel(*args):
            w, x = (args[0], args[1]) if args[0].dtype == torch.uint8 else (args[1], args[0])
            self.calls.append((name, x.shape[0]))
            return torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype)
        return kernel

    def dequantize(self, w, qtype, m, n, dtype):
        self.calls.append(("dequantize", m))
        return torch.zeros(m, n, dtype=dtype)


@pytest.fixture
def recorder():
    from vllm_gguf_plugin import ops
    from vllm_gguf_plugin.quantization import batch_invariant, dequant_triton

    rec = Recorder()
    with (patch.object(ops, "ggml_mul_mat_vec_a8", rec.dense("mmvq")),
          patch.object(ops, "ggml_mul_mat_a8", rec.dense("mmq")),
          patch.object(ops, "ggml_dequantize", rec.dequantize),
          patch.object(dequant_triton, "dequantize", rec.dequantize),
          patch.object(batch_invariant, "ggml_mul_mat_a8_triton", rec.dense("triton"))):
        yield rec


def _mul_mat(qtype, rows, out=64, k=256):
    import gguf
    from vllm_gguf_plugin.quantization.linear import _fused_mul_mat_gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    w = torch.zeros(out, k // block * size, dtype=torch.uint8)
    return _fused_mul_mat_gguf(torch.zeros(rows, k, dtype=torch.float16), w, int(qtype))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K, T.IQ2_S, T.IQ4_XS])
def test_dense_one_kernel_under_batch_invariance(recorder, monkeypatch, qtype):
    monkeypatch.setattr("vllm.envs.VLLM_BATCH_INVARIANT", True, raising=False)
    for rows in TOKEN_COUNTS:
        assert _mul_mat(qtype, rows).shape == (rows, 64)
    assert recorder.calls == [("triton", rows) for rows in TOKEN_COUNTS]


@pytest.mark.parametrize("qtype,big", [(T.Q8_0, 256), (T.Q4_K, 16), (T.Q6_K, 16),
                                       (T.IQ2_S, 256)])
def test_dense_default_picks_by_token_count(recorder, monkeypatch, qtype, big):
    """Without the mode: MMVQ for few rows, then MMQ (legacy and K-quants) below
    dequant_gemm_min_tokens (a prefill's 256 tokens; Q4_K and Q6_K, measured faster
    dequantized at GLM-5's shapes from 16) and dequantize + GEMM from there on
    (I-quants: from past MMVQ)."""
    from vllm_gguf_plugin.quantization.gguf_kernels import dequant_gemm_min_tokens

    assert dequant_gemm_min_tokens(int(qtype)) == big
    monkeypatch.setattr("vllm.envs.VLLM_BATCH_INVARIANT", False, raising=False)
    for rows in (1, min(17, big - 1), big - 1, big, 4 * big):
        _mul_mat(qtype, rows)
    mid = "dequantize" if qtype == T.IQ2_S else "mmq"
    assert [name for name, _ in recorder.calls] == [
        "mmvq", mid, mid, "dequantize", "dequantize"]


def test_unquantized_weights_stay_a_plain_product(recorder, monkeypatch):
    from vllm_gguf_plugin.quantization.linear import _fused_mul_mat_gguf

    monkeypatch.setattr("vllm.envs.VLLM_BATCH_INVARIANT", True, raising=False)
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    torch.testing.assert_close(_fused_mul_mat_gguf(x, w, int(T.F32)), x @ w.T)
    assert recorder.calls == []


def test_moe_one_kernel_under_batch_invariance(monkeypatch):
    """The routed experts reach batch_invariant.fused_moe for every token count, with
    each product's own quant type, and its result is returned as is."""
    from vllm_gguf_plugin.quantization import batch_invariant
    from vllm_gguf_plugin.quantization.fused_moe import _fused_moe_gguf

    seen = []

    def fake(x, w1, w2, topk_weights, topk_ids, t1, t2, act):
        seen.append((x.shape[0], t1, t2))
        return torch.full_like(x, float(x.shape[0]))

    monkeypatch.setattr("vllm.envs.VLLM_BATCH_INVARIANT", True, raising=False)
    monkeypatch.setattr(batch_invariant, "fused_moe", fake)
    for rows in TOKEN_COUNTS:
        x = torch.zeros(rows, 32, dtype=torch.float16)
        ids = torch.zeros(rows, 2, dtype=torch.int32)
        out = _fused_moe_gguf(x, torch.zeros(4, 16, 8, dtype=torch.uint8),
                              torch.zeros(4, 32, 4, dtype=torch.uint8), torch.ones(rows, 2),
                              ids, int(T.Q4_K), int(T.Q6_K), "silu")
        assert torch.equal(out, torch.full_like(x, float(rows)))
    assert seen == [(rows, int(T.Q4_K), int(T.Q6_K)) for rows in TOKEN_COUNTS]


# --------------------------------------------------------------------------------------
# GPU: the property
# --------------------------------------------------------------------------------------
def _alone_vs_batched(fn, x) -> float:
    """Largest difference between fn(x) and fn on each row alone."""
    batched = fn(x)
    return max((batched[i:i + 1] - fn(x[i:i + 1])).abs().max().item()
               for i in range(x.shape[0]))


def _random_blocks(qtype, rows, cols):
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    g = torch.Generator().manual_seed(int(qtype))
    raw = torch.randint(0, 256, (rows, cols // block * size), dtype=torch.uint8, generator=g)
    return (raw & 0x8F).cuda()  # finite, small float16 scales


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K, T.IQ2_S, T.IQ3_S])
def test_dense_rows_alone_equal_batched(monkeypatch, qtype):
    from vllm_gguf_plugin.quantization.linear import _fused_mul_mat_gguf

    w = _random_blocks(qtype, 2048, 2048)
    x = torch.randn(40, 2048, device="cuda", dtype=torch.float16)

    def product(v):
        return _fused_mul_mat_gguf(v, w, int(qtype))

    monkeypatch.setattr("vllm.envs.VLLM_BATCH_INVARIANT", False, raising=False)
    default = _alone_vs_batched(product, x)
    monkeypatch.setattr("vllm.envs.VLLM_BATCH_INVARIANT", True, raising=False)
    assert _alone_vs_batched(product, x) == 0.0
    # the plugin's own choice (MMVQ alone, another kernel for 40 rows) differs
    assert default > 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("types,default_varies", [
    ((T.Q4_K, T.Q6_K), True), ((T.Q8_0, T.Q8_0), True),
    # I-quants have no MMQ kernel: the plugin runs its one-pair kernel at every count
    ((T.IQ2_S, T.IQ3_S), False)])
def test_experts_rows_alone_equal_batched(monkeypatch, types, default_varies):
    from vllm_gguf_plugin.quantization.fused_moe import _fused_moe_gguf

    e, h, i, top_k, m = 16, 512, 256, 4, 80
    w13 = _random_blocks(types[0], e * 2 * i, h).view(e, 2 * i, -1)
    w2 = _random_blocks(types[1], e * h, i).view(e, h, -1)
    x = torch.randn(m, h, device="cuda", dtype=torch.float16)
    ids = torch.rand(m, e, device="cuda").topk(top_k, dim=1).indices.to(torch.int32)
    wts = torch.rand(m, top_k, device="cuda").softmax(dim=1)

    def experts(rows: slice):
        return _fused_moe_gguf(x[rows], w13, w2, wts[rows], ids[rows], int(types[0]),
                               int(types[1]), "silu")

    def differs() -> float:
        batched = experts(slice(None))
        return max((batched[r:r + 1] - experts(slice(r, r + 1))).abs().max().item()
                   for r in range(m))

    monkeypatch.setattr("vllm.envs.VLLM_BATCH_INVARIANT", False, raising=False)
    default = differs()
    monkeypatch.setattr("vllm.envs.VLLM_BATCH_INVARIANT", True, raising=False)
    assert differs() == 0.0
    # the plugin's choice: the one-pair kernel alone, MMQ for 80 tokens (K/legacy quants)
    assert (default > 0.0) == default_varies


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K])
def test_prefill_product_matches_dequantized_weights(monkeypatch, qtype):
    """From dequant_gemm_min_tokens on, a quantized product is x times the weight as gguf-py
    dequantizes it, and MMQ's result below it agrees within its int8 activations' error."""
    import gguf
    import numpy as np
    from vllm_gguf_plugin.quantization.gguf_kernels import dequant_gemm_min_tokens
    from vllm_gguf_plugin.quantization.linear import _fused_mul_mat_gguf

    monkeypatch.setattr("vllm.envs.VLLM_BATCH_INVARIANT", False, raising=False)
    gen = np.random.default_rng(0)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    # random blocks, float16 scales kept small (bits 4-6 of every byte cleared): finite
    packed = (gen.integers(0, 256, (512, 2048 // block * size), dtype=np.uint8) & 0x8F)
    weight = torch.from_numpy(gguf.quants.dequantize(packed, qtype)).cuda()
    tokens = dequant_gemm_min_tokens(int(qtype))
    x = torch.randn(tokens, 2048, device="cuda", dtype=torch.float16) / 45
    ref = x.float() @ weight.T
    w = torch.from_numpy(packed).cuda()
    big = _fused_mul_mat_gguf(x, w, int(qtype)).float()
    small = _fused_mul_mat_gguf(x[:tokens - 1], w, int(qtype)).float()
    scale = ref.abs().max()
    assert (big - ref).abs().max() / scale < 2e-3
    assert (small - ref[:-1]).abs().max() / scale < 5e-2
