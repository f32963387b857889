# SPDX-License-Identifier: Apache-2.0
"""A quantized GGUF tensor bound for a ReplicatedLinear (DeepSeek-V3.2/GLM-5's indexer
`wq_b`) loads: ReplicatedLinear has no v2 weight loader, and since vLLM 0.24 its v1
loader no longer materializes GGUF parameters; with the plugin's GGUF linear method
the q8_0 and Q4_K_M tiny GLM-5 failed at engine start on the H200 ("Tried to load
weights of size [4096, 272] to a parameter of size [0]"). On CPU: the layer as vLLM
builds it, the plugin's method, the stored blocks and type compared with the file's."""

from unittest.mock import patch

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants


@pytest.fixture
def single_process():
    with (patch("vllm.model_executor.parameter.get_tensor_model_parallel_rank", lambda: 0),
          patch("vllm.model_executor.parameter.get_tensor_model_parallel_world_size",
                lambda: 1),
          patch("vllm.model_executor.layers.linear.get_tensor_model_parallel_rank", lambda: 0),
          patch("vllm.model_executor.layers.linear.get_tensor_model_parallel_world_size",
                lambda: 1)):
        yield


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0])
def test_quantized_replicated_linear_loads(single_process, qtype):
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm_gguf_plugin.quantization import GGUFConfig, GGUFLinearMethod

    rng = np.random.default_rng(0)
    out_features, in_features = 64, 256
    weight = rng.standard_normal((out_features, in_features)).astype(np.float32)
    blocks = torch.from_numpy(quants.quantize(weight, qtype))  # uint8 [out, bytes per row]
    layer = ReplicatedLinear(in_features, out_features, bias=False, quant_config=GGUFConfig(),
                             prefix="model.layers.0.self_attn.indexer.wq_b")
    assert isinstance(layer.quant_method, GGUFLinearMethod)
    params = dict(layer.named_parameters())
    params["qweight_type"].weight_loader(params["qweight_type"], torch.tensor(int(qtype)))
    params["qweight"].weight_loader(params["qweight"], blocks)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.qweight_type.weight_type == int(qtype)
    torch.testing.assert_close(layer.qweight.data, blocks, rtol=0, atol=0)
    dequantized = quants.dequantize(layer.qweight.data.numpy(), qtype)
    assert np.array_equal(dequantized, quants.dequantize(blocks.numpy(), qtype))
