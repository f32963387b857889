# SPDX-License-Identifier: Apache-2.0
"""GPU: the tiny GLM-5 from a GGUF file with no flags at all, on an H200 that
reports compute capability 12.0 (tests/plugins/vllm_report_capability, installed
and enabled by VLLM_TEST_REPORT_CAPABILITY=12.0): automatic selection must pick
TRITON_MLA_SPARSE, DeepGEMM's indexer (vLLM 0.26.0 ships its SM120 kernels; on the
H200 it compiles them for the real SM90) and dtype auto must give fp16, as on an
RTX PRO 6000 / RTX 5090; reported as 8.9 (RTX 40xx, L40), TRITON_MLA_SPARSE with the
portable Triton indexer in bf16. Outputs are compared with the same file forced onto
those paths without the hook, within the run-to-run difference of that setting.

A second test does the same with 64 attention heads (GLM-5's count at TP1): with
SM120's 99 KiB of shared memory reported as well, the sparse MLA kernel runs the
smaller 64-head tiles of such GPUs, which must give the outputs of the H200's. A
third does it with an fp8 KV cache (per-tensor scale): SM120's Triton fp8 tiles
against the H200's warp-specialized fp8 tile; a fourth with 8 and 16 heads (GLM-5 at
TP8 and TP4) against the H200's 8/16-head fp8 tile, which runs all its steps."""

import importlib.util
import os

import pytest
import torch

from tests.models.glm5_runs import compare, generate, within_rerun
from tests.models.glm5_tiny import make_tiny_glm5
from tests.models.quantization import gguf_reference as gr


# the H200's own paths and tiles, forced (no capability reported)
FORCED = dict(dtype="float16", attention_backend="TRITON_MLA_SPARSE", indexer="triton")


def gguf_with_heads(glm5_gguf, tmp_path, heads=64):
    """The tiny GLM-5 with `heads` attention heads, as a bf16 GGUF from llama.cpp."""
    llama_cpp = glm5_gguf[0]
    model = make_tiny_glm5(tmp_path / f"tiny-{heads}-heads", num_attention_heads=heads,
                           num_key_value_heads=heads)
    gr.write_tokenizer(model, gr.config(model)["vocab_size"])
    return gr.convert(llama_cpp, model, tmp_path / f"tiny-{heads}-heads-bf16.gguf", "bf16")


def sm120_env(capability: str = "12.0"):
    """SM120's (or SM89's) capability and shared memory per block (99 KiB: the
    kernels' small tiles), reported by the test plugin."""
    if importlib.util.find_spec("vllm_report_capability") is None:
        pytest.skip("pip install --no-deps tests/plugins/vllm_report_capability first")
    env = dict(os.environ, VLLM_TEST_REPORT_CAPABILITY=capability,
               VLLM_TEST_REPORT_SHARED_MEM="101376")
    env.pop("VLLM_TEST_REPORT_DEEP_GEMM", None)  # the platform's own DeepGEMM choice
    return env


def fp8_cache_runs(gguf, tmp_path, env, gluon_calls: str):
    """With an fp8 KV cache, one run as on SM120 (`env`: its Triton fp8 tiles, so the
    Gluon tile counted by `gluon_calls` never launches) and two with the H200's own
    tiles (that tile launched where the GPU is a Hopper one)."""
    sm120 = generate(gguf, tmp_path / "sm120-fp8.json", env=env, dtype="auto",
                     kv_cache_dtype="fp8")
    assert sm120["attention_backend"] == "TRITON_MLA_SPARSE"
    assert sm120["kv_cache_dtype"] == "fp8" and sm120[gluon_calls] == 0
    hopper = [generate(gguf, tmp_path / f"h200-fp8-{i}.json", kv_cache_dtype="fp8", **FORCED)
              for i in range(2)]
    gpu_hopper = torch.cuda.get_device_capability()[0] == 9
    assert all((run[gluon_calls] > 0) == gpu_hopper for run in hopper)
    return sm120, hopper


@pytest.mark.gpu
@pytest.mark.parametrize("capability,indexer,dtype", [
    ("12.0", "deepgemm", "float16"), ("8.9", "triton", "bfloat16")])
def test_gguf_as_on_sm120(glm5_ggufs, tmp_path, capability, indexer, dtype):
    env = sm120_env(capability)
    auto = generate(glm5_ggufs["bf16"], tmp_path / "auto.json", env=env, dtype="auto")
    assert auto["indexer_backend"] == indexer
    assert (auto["triton_indexer_calls"]["prefill"] > 0) == (indexer == "triton")
    assert auto["attention_backend"] == "TRITON_MLA_SPARSE"
    assert auto["dtype"] == f"torch.{dtype}"
    forced = [generate(glm5_ggufs["bf16"], tmp_path / f"forced-{i}.json",
                       **{**FORCED, "dtype": dtype, "indexer": indexer})
              for i in range(2)]
    # The same paths and dtype, so the outputs may differ only as much as two
    # runs of the forced setting do (this engine is not bitwise reproducible
    # run to run: 0.08 nats mean measured on the H200, test_glm5_gguf_engine).
    same, rerun = compare(forced[0], auto), compare(forced[0], forced[1])
    print("SM120_REPORT", {"capability": capability, "auto_vs_forced": same,
                           "forced_rerun": rerun})
    assert within_rerun(same, rerun), (same, rerun)


@pytest.mark.gpu
def test_gguf_as_on_sm120_64_heads(glm5_gguf, tmp_path):
    env = sm120_env()
    gguf = gguf_with_heads(glm5_gguf, tmp_path)
    small_tiles = generate(gguf, tmp_path / "sm120.json", env=env, dtype="auto")
    assert small_tiles["attention_backend"] == "TRITON_MLA_SPARSE"
    assert small_tiles["dtype"] == "torch.float16"
    # the same paths with the H200's own capability and shared memory (its tiles)
    hopper = [generate(gguf, tmp_path / f"h200-{i}.json", **FORCED) for i in range(2)]
    same, rerun = compare(hopper[0], small_tiles), compare(hopper[0], hopper[1])
    print("SM120_64_HEADS_REPORT", {"sm120_tiles_vs_h200_tiles": same, "h200_rerun": rerun})
    assert within_rerun(same, rerun), (same, rerun)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [8, 16])
def test_fp8_kv_cache_as_on_sm120_few_heads(glm5_gguf, tmp_path, heads):
    env = sm120_env()
    gguf = gguf_with_heads(glm5_gguf, tmp_path, heads=heads)
    # the H200's own tiles: the 8- or 16-head fp8 tile for the prefills (300-1000
    # tokens) and the decode steps, not the warp-specialized one
    sm120, hopper = fp8_cache_runs(gguf, tmp_path, env, "rows_sparse_mla_calls")
    assert all(run["ws_sparse_mla_calls"] == 0 for run in hopper)
    same, rerun = compare(hopper[0], sm120), compare(hopper[0], hopper[1])
    print("FP8_KV_FEW_HEADS_REPORT", {"heads": heads, "sm120_tiles_vs_h200_tiles": same,
                                      "h200_rerun": rerun,
                                      "h200_gluon_calls": [hopper[0]["rows_sparse_mla_calls"],
                                                           hopper[0]["ws_sparse_mla_calls"]]})
    assert within_rerun(same, rerun), (same, rerun)


@pytest.mark.gpu
def test_fp8_kv_cache_as_on_sm120_64_heads(glm5_gguf, tmp_path):
    env = sm120_env()
    gguf = gguf_with_heads(glm5_gguf, tmp_path)
    # the H200's own tiles: 64 heads of an fp8 e4m3 cache run the warp-specialized one
    sm120, hopper = fp8_cache_runs(gguf, tmp_path, env, "ws_sparse_mla_calls")
    cache16 = generate(gguf, tmp_path / "h200-16bit.json", **FORCED)
    same, rerun = compare(hopper[0], sm120), compare(hopper[0], hopper[1])
    # what the fp8 cache changes against a 16-bit one (reported, not a bound)
    print("FP8_KV_REPORT", {"sm120_tiles_vs_h200_tiles": same, "h200_rerun": rerun,
                            "fp8_vs_16bit_cache": compare(cache16, hopper[0])})
    assert within_rerun(same, rerun), (same, rerun)
