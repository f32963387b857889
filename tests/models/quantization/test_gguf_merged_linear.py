# SPDX-License-Identifier: Apache-2.0
"""GGUF merged linear layers put each shard's output where the layer's output
sizes say, whatever order the shards were loaded in.

llama.cpp's glm-dsa files store `attn_kv_a_mqa` before `attn_q_a`, so vLLM loads
shard 1 of `fused_qkv_a_proj` before shard 0; upstream's GGUFLinearMethod.apply
concatenated in load order and swapped q and kv (found on the H200: a tiny GLM-5
whose q_a/kv_a alone were q8_0 was 4.5 nats off; every other group ~0.1-0.4).
Runs on CPU with F16 shards (the kernel is then a plain matmul).
"""

import pytest
import torch
from gguf import GGMLQuantizationType as T

from vllm.model_executor.layers.quantization.gguf import GGUFConfig, GGUFLinearMethod


@pytest.mark.parametrize("load_order", [(0, 1), (1, 0)])
def test_merged_shards_in_output_order(load_order):
    torch.manual_seed(0)
    sizes, in_features = (4, 6), 8
    weights = [torch.randn(n, in_features, dtype=torch.float16) for n in sizes]
    method = GGUFLinearMethod(GGUFConfig())
    layer = torch.nn.Module()
    method.create_weights(layer, in_features, list(sizes), in_features, sum(sizes),
                          torch.float16)
    qweight, qtype = layer.qweight, layer.qweight_type
    # what MergedColumnParallelLinear's GGUF weight loader records per shard
    for shard in load_order:
        qweight.shard_id.append(shard)
        qweight.shard_id_map[shard] = len(qweight.data_container)
        qweight.data_container.append(weights[shard])
        qtype.shard_weight_type[shard] = int(T.F16)
    qtype.weight_type = int(T.F16)
    method.process_weights_after_loading(layer)
    x = torch.randn(3, in_features, dtype=torch.float16)
    expect = torch.cat([x @ w.T for w in weights], dim=1)
    torch.testing.assert_close(method.apply(layer, x), expect)
