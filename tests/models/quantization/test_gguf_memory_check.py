# SPDX-License-Identifier: Apache-2.0
"""A GGUF model that cannot fit the GPU memory vLLM is given stops before any weight
is read, with a message naming the setting to change (vllm_gguf_plugin/memory_check.py,
called by the plugin's loader once the model is built).

The tiny GLM-5's Q4_K_M file loads on the CPU through the plugin's loader
(glm5_memory_check_cpu.py, with a GPU of a given size reported to the check). The
references: the file's tensor bytes as gguf-py reads them (the main model's layers, not
the MTP block), the KV cache's pages the model's layers declare, MLA's latent from the
config (kv_lora_rank + qk_rope_head_dim bfloat16 values a token).
"""

import gguf
import pytest
import regex as re

from vllm_gguf_plugin.memory_check import MemoryNeed

GiB = 1 << 30
MAX_LEN = 2048
UTIL = 0.9


@pytest.fixture(scope="module")
def q4_k_m(glm5_ggufs):
    return glm5_ggufs["Q4_K_M"]


@pytest.fixture(scope="module")
def check(run_without_gpu, q4_k_m):
    def run(gpu_bytes: int, *extra):
        return run_without_gpu("tests.models.quantization.glm5_memory_check_cpu", q4_k_m,
                               "--gpu-bytes", gpu_bytes, "--max-model-len", MAX_LEN,
                               "--gpu-memory-utilization", UTIL, *extra)
    return run


@pytest.fixture(scope="module")
def fits(check):
    return check(64 * GiB)


def test_a_model_that_fits_loads(fits, q4_k_m):
    assert fits["error"] is None and fits["tensors_read"] > 0
    need = fits["need"]
    reader = gguf.GGUFReader(q4_k_m)
    layers = reader.fields["glm-dsa.block_count"].contents()
    mtp = reader.fields["glm-dsa.nextn_predict_layers"].contents()
    main = [t for t in reader.tensors
            if not (t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers - mtp)]
    assert need["weight_bytes"] == sum(int(t.n_bytes) for t in main)
    assert any(t.tensor_type == gguf.GGMLQuantizationType.Q4_K for t in main)
    # one sequence of MAX_LEN tokens: that many tokens' blocks of every layer's caches
    pages, block = fits["kv_pages"], fits["block_size"]
    assert need["kv_bytes"] == -(-MAX_LEN // block) * sum(pages.values())
    kv_lora = reader.fields["glm-dsa.attention.kv_lora_rank"].contents()
    rope = reader.fields["glm-dsa.rope.dimension_count"].contents()
    latents = [v for name, v in pages.items() if ".indexer." not in name]
    assert len(latents) == layers - mtp and len(pages) == 2 * len(latents)
    assert set(latents) == {block * (kv_lora + rope) * 2}
    assert need["max_model_len"] == MAX_LEN and need["fitting_len"] >= MAX_LEN


def test_a_context_that_cannot_fit_stops_before_loading(fits, check, q4_k_m):
    weights, cache = fits["need"]["weight_bytes"], fits["need"]["kv_bytes"]
    # what vLLM may use leaves the weights half of one MAX_LEN sequence's cache
    out = check(int((weights + cache // 2) / UTIL) + 1)
    assert out["tensors_read"] == 0 and out["need"] is None
    message = out["error"]
    assert message.startswith(f"{q4_k_m}: ")  # the file named, not its folder
    assert "checked before loading its weights" in message
    assert f"max_model_len {MAX_LEN} tokens" in message
    for setting in ("--max-model-len", "--gpu-memory-utilization", "--tensor-parallel-size"):
        assert setting in message
    # half the cache holds half the tokens: whole blocks of the cache
    assert int(re.search(r"at most (\d+) tokens fit", message)[1]) == MAX_LEN // 2


def test_weights_that_cannot_fit_stop_before_loading(fits, check):
    out = check(fits["need"]["weight_bytes"])  # UTIL of it is less than the weights
    assert out["tensors_read"] == 0
    assert "raise --gpu-memory-utilization" in out["error"]
    assert "--tensor-parallel-size" in out["error"]
    assert "--max-model-len" not in out["error"]


def test_the_kv_cache_size_set_is_checked(fits, check):
    cache = fits["need"]["kv_bytes"]
    out = check(64 * GiB, "--kv-cache-memory-bytes", cache - 1)
    assert out["tensors_read"] == 0
    assert "--kv-cache-memory-bytes gives" in out["error"] and "--max-model-len" in out["error"]
    assert check(64 * GiB, "--kv-cache-memory-bytes", cache)["error"] is None


def need(**kw) -> MemoryNeed:
    base = dict(gpu_bytes=32 * GiB, utilization=0.9, kv_cache_memory_bytes=None,
                weight_bytes=20 * GiB, max_model_len=202752, kv_bytes=4 * GiB,
                fitting_len=202752)
    return MemoryNeed(**{**base, **kw})


def test_memory_need_problems():
    assert need().problem() is None  # 20 + 4 GiB of 28.8
    assert "at most 1000 tokens fit" in need(kv_bytes=10 * GiB, fitting_len=1000).problem()
    assert "no token's cache fits" in need(kv_bytes=10 * GiB, fitting_len=0).problem()
    # --max-model-len -1: vLLM fits the context after profiling; the weights still count
    assert need(max_model_len=None, kv_bytes=10 * GiB).problem() is None
    assert "raise --gpu-memory-utilization" in need(max_model_len=None,
                                                    weight_bytes=30 * GiB).problem()
    # --kv-cache-memory-bytes replaces the utilization's share
    assert need(kv_cache_memory_bytes=4 * GiB, utilization=0.1).problem() is None
    assert "more than the GPU's" in need(kv_cache_memory_bytes=13 * GiB).problem()
