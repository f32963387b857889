# SPDX-License-Identifier: Apache-2.0
"""Q4_K linear layers on vLLM's Marlin GEMM (vllm_gguf_plugin.quantization.linear_marlin).

CPU: which layers convert (types, output rows, capability, the switch, batch invariance);
the conversion in row slices against one slice, and its form s * (q - 8) + b against
gguf-py's dequantization; a converted layer's product with float32 stand-ins for the CUDA
ops against gguf-py's dequantization (a bias, leading dimensions, the float32 identity
that dequantizes a layer at load); GGUFLinearMethod's hooks. GPU: the product against
float32 products of gguf-py's dequantization, float16 and bfloat16, 1 to 300 tokens.
"""

from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType as T

from benchmarks.kernels import benchmark_gguf_ops as bench
from tests.models.quantization.test_gguf_moe_marlin import dequantize, q4_k_blocks


@pytest.mark.parametrize("types,n,cap,converts", [
    ({T.Q4_K}, 2624, 90, True),  # GLM-5's qkv_a
    ({T.Q4_K}, 2624, 120, True),
    ({T.Q4_K}, 2624, 80, True),
    ({T.Q4_K}, 2624, 75, False),  # Marlin: SM80 on
    ({T.Q4_K}, 2600, 90, False),  # not whole tiles of Marlin's 64 outputs
    ({T.Q4_K, T.Q6_K}, 2624, 90, False),  # shards of two types
    ({T.Q6_K}, 2624, 90, False),  # scales per 16 values: no Marlin form
    ({T.Q8_0}, 2624, 90, False),
])
def test_which_layers_convert(monkeypatch, types, n, cap, converts):
    from vllm_gguf_plugin.quantization import gguf_kernels

    monkeypatch.setenv(gguf_kernels.DENSE_MARLIN_ENV, "1")
    assert gguf_kernels.dense_marlin({int(t) for t in types}, n, capability=cap,
                                     batch_invariant=False) == converts


def test_weight_types_are_each_shards():
    from vllm_gguf_plugin.quantization.linear_marlin import weight_types

    merged = SimpleNamespace(qweight_type=SimpleNamespace(
        weight_type=int(T.Q4_K), shard_weight_type={0: int(T.Q4_K), 1: int(T.Q6_K)}))
    single = SimpleNamespace(qweight_type=SimpleNamespace(weight_type=int(T.Q4_K),
                                                          shard_weight_type={}))
    assert weight_types(merged) == {int(T.Q4_K), int(T.Q6_K)}
    assert weight_types(single) == {int(T.Q4_K)}


def test_off_unless_asked(monkeypatch):
    """Off with VLLM_GGUF_DENSE_MARLIN unset or 0: convert_layer leaves every layer to the
    GGUF kernels without reading it; with 1 on, except under batch invariance."""
    from vllm_gguf_plugin.quantization import gguf_kernels

    def converts():
        return gguf_kernels.dense_marlin({int(T.Q4_K)}, 2624, capability=90,
                                         batch_invariant=bi)

    bi = False
    monkeypatch.delenv(gguf_kernels.DENSE_MARLIN_ENV, raising=False)
    assert not gguf_kernels.dense_marlin_enabled() and not converts()
    monkeypatch.setenv(gguf_kernels.DENSE_MARLIN_ENV, "0")
    assert not gguf_kernels.dense_marlin_enabled() and not converts()
    monkeypatch.setenv(gguf_kernels.DENSE_MARLIN_ENV, "1")
    assert gguf_kernels.dense_marlin_enabled() and converts()
    bi = True
    assert not converts()


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """[k / 8, n] int32 -> [k, n] codes, by vLLM's own unpacking of GPTQ's layout."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        unpack_quantized_values_into_int32,
    )
    from vllm.scalar_type import scalar_types

    return unpack_quantized_values_into_int32(packed, scalar_types.uint4b8, packed_dim=0)


def _cpu_stand_ins(monkeypatch):
    """The CUDA parts as float32 stand-ins: the repack and the scales' permutation leave
    GPTQ's layout as it is, Marlin's GEMM reads it unpacked, the workspace is a zero."""
    import vllm._custom_ops as ops
    from vllm_gguf_plugin.quantization import gguf_kernels, linear_marlin

    def marlin_linear(a, qweight, scales, zp, g_idx, perm, workspace, wtype, n, k, is_k_full):
        assert (qweight.shape, scales.shape, is_k_full) == ((k // 8, n), (k // 32, n), True)
        w = scales.float().repeat_interleave(32, 0) * (unpack_int4_rows(qweight).float() - 8)
        return (a.float() @ w).to(a.dtype)

    monkeypatch.setattr(ops, "gptq_marlin_repack", lambda q, perm, k, n, bits: q, raising=False)
    monkeypatch.setattr(linear_marlin, "marlin_permute_scales", lambda s, k, n, g: s)
    monkeypatch.setattr(linear_marlin, "marlin_make_workspace_new", lambda d: torch.zeros(1))
    monkeypatch.setattr(linear_marlin, "apply_gptq_marlin_linear", marlin_linear)
    monkeypatch.setattr(gguf_kernels, "device_capability", lambda: 90)


@pytest.mark.parametrize("dtype,eps", [(torch.float16, 2.0**-11), (torch.bfloat16, 2.0**-8)])
def test_marlin_weight_in_slices_is_the_files(monkeypatch, dtype, eps):
    """marlin_weight unpacks a few rows at a time: the result is one slice's, and its
    s * (q - 8) + b is gguf-py's dequantization within the rounding of s and b."""
    from vllm_gguf_plugin.quantization import linear_marlin

    _cpu_stand_ins(monkeypatch)
    blocks = q4_k_blocks(192, 512, 2)
    whole = linear_marlin.marlin_weight(blocks, dtype)
    monkeypatch.setattr(linear_marlin, "PACK_VALUES", 512 * 5)  # 5 rows a slice, the last 2
    sliced = linear_marlin.marlin_weight(blocks, dtype)
    for a, b in zip(whole, sliced):
        assert torch.equal(a, b)
    qweight, scales, b = whole
    assert qweight.shape == (64, 192) and scales.shape == (16, 192) and b.shape == (192, 16)
    w = (scales.float().T.repeat_interleave(32, 1) * (unpack_int4_rows(qweight).T.float() - 8)
         + b.float().repeat_interleave(32, 1))
    ref = dequantize(blocks)
    # s's rounding moves a weight by up to 15 * |s| * eps / 2 (its code's share), b's by
    # |b| * eps / 2: bounded here with room
    bound = (16 * scales.float().T.abs() + b.float().abs()).repeat_interleave(32, 1) * eps
    assert bool(((w - ref).abs() <= bound + 1e-12).all())


def _gguf_layer(blocks: torch.Tensor, types: dict | None = None,
                kind: type = torch.nn.Module) -> torch.nn.Module:
    layer = kind.__new__(kind)  # the class alone: vLLM's layers need a TP group to build
    torch.nn.Module.__init__(layer)
    layer.qweight = torch.nn.Parameter(blocks, requires_grad=False)
    layer.qweight_type = SimpleNamespace(weight_type=int(T.Q4_K), shard_weight_type=types or {})
    return layer


@pytest.mark.parametrize("tokens", [1, 7])
def test_converted_layer_on_the_cpu(monkeypatch, tokens):
    """A converted layer's product (Marlin's GEMM a float32 stand-in that reads the codes
    unpacked) is gguf-py's dequantization's: the b-part added once, a bias after it, the
    input's leading dimensions kept; its GGUF bytes are gone. The float32 identity that
    vLLM's get_and_maybe_dequant_weights passes comes back as the weight, in float32."""
    from vllm_gguf_plugin.quantization import linear_marlin

    _cpu_stand_ins(monkeypatch)
    monkeypatch.setenv("VLLM_GGUF_DENSE_MARLIN", "1")
    monkeypatch.setattr("vllm.envs.VLLM_BATCH_INVARIANT", False, raising=False)
    n, k, dtype = 128, 512, torch.float16
    blocks = q4_k_blocks(n, k, 3)
    layer = _gguf_layer(blocks.clone(), {0: int(T.Q4_K), 1: int(T.Q4_K)})
    assert linear_marlin.convert_layer(layer, dtype) is True
    assert layer.qweight.numel() == 0 and layer.marlin_b.dtype == dtype
    w = dequantize(blocks)
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(2, tokens, k, generator=gen) * k ** -0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    out = linear_marlin.apply(layer, x, bias)
    assert out.shape == (2, tokens, n) and out.dtype == dtype
    ref = x.float() @ w.T + bias.float()
    assert bench.rel_error(out, ref) < 0.005
    eye = torch.eye(k)
    back = linear_marlin.apply(layer, eye)
    assert back.dtype == torch.float32
    torch.testing.assert_close(back.T, w, rtol=0, atol=4e-3 * w.abs().max().item())


def test_convert_layer_leaves_other_layers(monkeypatch):
    from vllm_gguf_plugin.quantization import linear_marlin

    _cpu_stand_ins(monkeypatch)
    monkeypatch.setenv("VLLM_GGUF_DENSE_MARLIN", "1")
    monkeypatch.setattr("vllm.envs.VLLM_BATCH_INVARIANT", False, raising=False)
    layer = _gguf_layer(q4_k_blocks(128, 512, 5), {0: int(T.Q4_K), 1: int(T.Q6_K)})
    assert linear_marlin.convert_layer(layer, torch.float16) is False
    assert layer.qweight.shape == (128, 288) and not hasattr(layer, "marlin_qweight")


def test_input_embedding_keeps_its_gguf_rows(monkeypatch):
    """GGUFEmbeddingMethod runs GGUFLinearMethod's hook too: the input embedding, whose
    lookup reads the GGUF rows, stays as loaded; the output head (a product) converts."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )
    from vllm_gguf_plugin.quantization import linear_marlin

    _cpu_stand_ins(monkeypatch)
    monkeypatch.setenv("VLLM_GGUF_DENSE_MARLIN", "1")
    monkeypatch.setattr("vllm.envs.VLLM_BATCH_INVARIANT", False, raising=False)
    blocks = q4_k_blocks(128, 512, 8)
    embedding = _gguf_layer(blocks.clone(), kind=VocabParallelEmbedding)
    assert linear_marlin.convert_layer(embedding, torch.float16) is False
    assert torch.equal(embedding.qweight, blocks) and not hasattr(embedding, "marlin_qweight")
    head = _gguf_layer(blocks.clone(), kind=ParallelLMHead)
    assert linear_marlin.convert_layer(head, torch.float16) is True
    assert head.qweight.numel() == 0 and head.marlin_b.shape == (128, 16)


def _loaded_method(monkeypatch, dtype: torch.dtype):
    """A GGUFLinearMethod whose process_weights_after_loading takes a layer as it is
    (its parameters already materialized, no shards to pad)."""
    from vllm_gguf_plugin.quantization import linear

    monkeypatch.setattr(linear.GGUFLinearMethod, "_materialize_gguf_parameters",
                        lambda self, layer: None)
    monkeypatch.setattr(linear.GGUFLinearMethod, "_create_padded_weight_param",
                        lambda self, layer: None)
    method = linear.GGUFLinearMethod(None)
    method.params_dtype = dtype
    return method


def test_gguf_linear_method_hooks(monkeypatch):
    """GGUFLinearMethod converts after loading (with the layer's dtype) and sends a
    converted layer to linear_marlin.apply; an unconverted one to the GGUF op."""
    from vllm_gguf_plugin.quantization import linear_marlin

    seen = []
    monkeypatch.setattr(linear_marlin, "convert_layer", lambda *a: seen.append(a) or False)
    monkeypatch.setattr(linear_marlin, "apply", lambda *a: ("marlin",) + a)
    method = _loaded_method(monkeypatch, torch.bfloat16)
    layer = _gguf_layer(q4_k_blocks(64, 256, 6))
    method.process_weights_after_loading(layer)
    assert seen == [(layer, torch.bfloat16)]
    layer.marlin_qweight = "converted"
    assert method.apply(layer, "x", "bias") == ("marlin", layer, "x", "bias")


def test_the_accuracy_runs_count_converted_layers(monkeypatch):
    """glm5_generate's count (the accuracy stage fails a `-dense-marlin` row without one)
    sees each layer GGUFLinearMethod converts, and none where the switch is off."""
    from tests.models.glm5_generate import count_dense_marlin_layers
    from vllm_gguf_plugin.quantization import linear_marlin

    converts = iter([True, False, True])
    monkeypatch.setattr(linear_marlin, "convert_layer", lambda *a: next(converts))
    monkeypatch.delenv("VLLM_GGUF_DENSE_MARLIN", raising=False)
    assert count_dense_marlin_layers() is None
    monkeypatch.setenv("VLLM_GGUF_DENSE_MARLIN", "1")
    counted = count_dense_marlin_layers()
    method = _loaded_method(monkeypatch, torch.float16)
    for _ in range(3):
        method.process_weights_after_loading(_gguf_layer(q4_k_blocks(64, 256, 9)))
    assert counted == {"converted": 2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,limit", [(torch.float16, 0.005), (torch.bfloat16, 0.02)])
@pytest.mark.parametrize("tokens", [1, 8, 33, 300])
@pytest.mark.parametrize("n,k", [(192, 512), (2624, 6144)])  # and GLM-5's qkv_a
def test_marlin_linear_matches_float32(monkeypatch, dtype, limit, tokens, n, k):
    """A layer converted by convert_layer against float32 products of gguf-py's
    dequantization of the same blocks: within the 16-bit rounding, where the GGUF kernels'
    int8 activations are 0.5% off (docs/results.md)."""
    from vllm_gguf_plugin.quantization import linear_marlin

    monkeypatch.setenv("VLLM_GGUF_DENSE_MARLIN", "1")
    blocks = q4_k_blocks(n, k, 7)
    layer = _gguf_layer(blocks.cuda())
    assert linear_marlin.convert_layer(layer, dtype) is True
    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(tokens, k, generator=gen) * k ** -0.5).to(dtype).cuda()
    out = linear_marlin.apply(layer, x)
    ref = x.float() @ dequantize(blocks).cuda().T
    assert out.shape == (tokens, n) and out.dtype == dtype
    assert bench.rel_error(out, ref) < limit
