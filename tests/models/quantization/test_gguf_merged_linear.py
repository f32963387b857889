# SPDX-License-Identifier: Apache-2.0
"""GGUF merged linear layers put each shard's output where the layer's output
sizes say, whatever order the shards were loaded in.

llama.cpp's glm-dsa files store `attn_kv_a_mqa` before `attn_q_a`, so vLLM loads
shard 1 of `fused_qkv_a_proj` before shard 0; vLLM 0.23's in-tree GGUFLinearMethod.apply
concatenated in load order and swapped q and kv (found on the H200: a tiny GLM-5
whose q_a/kv_a alone were q8_0 was 4.5 nats off; every other group ~0.1-0.4; the
overlay fixed it there). vllm-gguf-plugin orders the shards itself (0.0.3); this
checks its GGUFLinearMethod on shards loaded in both orders. Runs on CPU with F16
shards (the kernel is then a plain matmul on the padded stack); with a second type
declared for one shard, the layer runs a product per shard (its slice of the padded
stack) and concatenates them.
"""

from unittest.mock import patch

import pytest
import torch
from gguf import GGMLQuantizationType as T

from vllm_gguf_plugin.quantization import GGUFConfig, GGUFLinearMethod


@pytest.mark.parametrize("types", [(T.F16, T.F16), (T.F16, T.F32)])
@pytest.mark.parametrize("load_order", [(0, 1), (1, 0)])
def test_merged_shards_in_output_order(load_order, types):
    torch.manual_seed(0)
    sizes, in_features = (4, 6), 8
    weights = [torch.randn(n, in_features, dtype=torch.float16) for n in sizes]
    method = GGUFLinearMethod(GGUFConfig())
    layer = torch.nn.Module()

    def merged_column_loader(param, loaded_weight, shard_id=None):
        # what MergedColumnParallelLinear.weight_loader_v2 does at TP 1
        if shard_id is None:
            param._store(loaded_weight)
        else:
            param.load_merged_column_weight(loaded_weight, shard_id=shard_id)

    method.create_weights(layer, in_features, list(sizes), in_features, sum(sizes),
                          torch.float16, weight_loader=merged_column_loader)
    qweight, qtype = layer.qweight, layer.qweight_type
    for shard in load_order:
        qweight.weight_loader(qweight, weights[shard], shard)
        qtype.weight_loader(qtype, torch.tensor(int(types[shard])), shard)
    with (patch("vllm.model_executor.parameter.get_tensor_model_parallel_rank", lambda: 0),
          patch("vllm.model_executor.parameter.get_tensor_model_parallel_world_size",
                lambda: 1)):  # a single process, no distributed groups
        method.process_weights_after_loading(layer)
    x = torch.randn(3, in_features, dtype=torch.float16)
    expect = torch.cat([x @ w.T for w in weights], dim=1)
    torch.testing.assert_close(method.apply(layer, x), expect)
