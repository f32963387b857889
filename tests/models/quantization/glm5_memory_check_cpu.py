# SPDX-License-Identifier: Apache-2.0
"""The GGUF plugin's loader on CPU (glm5_vllm_cpu: vLLM's GlmMoeDsaForCausalLM built
from a glm-dsa GGUF) with a GPU of `--gpu-bytes` reported to its memory check, to see
whether a model that cannot fit stops before any weight is read.

    python -m tests.models.quantization.glm5_memory_check_cpu FILE.gguf --gpu-bytes N
        [--max-model-len L] [--gpu-memory-utilization U] [--kv-cache-memory-bytes B]

Prints JSON on its last line: {"error": the load's ValueError or null, "tensors_read":
how many tensors the adapter yielded to load_weights, "need": the check's MemoryNeed
(null if it raised), "kv_pages": {layer: page bytes per block} of every KV cache the
model declares, "block_size": the cache's block size}.
"""

import argparse
import dataclasses
import json

from tests.models.quantization import glm5_vllm_cpu


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("gguf")
    p.add_argument("--gpu-bytes", type=int, required=True)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    args = p.parse_args()
    from vllm.config import CacheConfig
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    glm5_vllm_cpu.stub_device_selection()
    glm5_vllm_cpu.init_single_process()

    import vllm_gguf_plugin.memory_check as memory_check
    from vllm_gguf_plugin.weights_adapter.glm_dsa import GlmDsaGGUF

    memory_check.device_memory_bytes = lambda device: args.gpu_bytes
    checked, read = [], [0]
    check = memory_check.check_memory_before_loading

    def check_and_keep(*a, **kw):
        checked.append(check(*a, **kw))
        return checked[-1]

    import vllm_gguf_plugin.loader as loader

    loader.check_memory_before_loading = check_and_keep  # the name the loader calls
    weights = GlmDsaGGUF.weights

    def counted(self):
        for item in weights(self):
            read[0] += 1
            yield item

    GlmDsaGGUF.weights = counted
    cache = CacheConfig(gpu_memory_utilization=args.gpu_memory_utilization,
                        kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    error, kv_pages, block_size = None, {}, cache.block_size
    try:
        config, model = glm5_vllm_cpu.build(args.gguf, max_model_len=args.max_model_len,
                                            cache_config=cache)
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        kv_pages = {n: layer.get_kv_cache_spec(config).page_size_bytes for n, layer in
                    get_layers_from_vllm_config(config, AttentionLayerBase).items()}
        block_size = config.cache_config.block_size
    except ValueError as e:
        error = str(e)
    need = dataclasses.asdict(checked[0]) if checked and checked[0] is not None else None
    print(json.dumps({"error": error, "tensors_read": read[0], "need": need,
                      "kv_pages": kv_pages, "block_size": block_size}))


if __name__ == "__main__":
    main()
