# SPDX-License-Identifier: Apache-2.0
"""GPU: the tiny GLM-5 from llama.cpp GGUFs in vLLM (TRITON_MLA_SPARSE, the
portable indexer, fp16 as on SM>=100), with nothing but the GGUF file.

References:
- the same model from its safetensors checkpoint in vLLM with the same settings:
  the bf16 GGUF holds the same numbers, so the outputs must be the same;
- transformers fp32 on the GGUF's weights dequantized by gguf-py
  (gguf_reference.dequantized_checkpoint), for bf16, q8_0 and Q4_K_M.
Prompts of 300-1000 tokens exceed index_topk (128).
"""

import json

import pytest

import gguf_reference as gr
from glm5_runs import compare, generate, hf_reference

SETTINGS = {"attention_backend": "TRITON_MLA_SPARSE", "indexer": "triton", "dtype": "float16"}


@pytest.mark.gpu
def test_glm5_gguf_in_vllm(glm5_gguf, glm5_ggufs, tmp_path):
    llama_cpp, model, _ = glm5_gguf
    gguf = gr.gguf_module(llama_cpp)
    st = generate(model, tmp_path / "safetensors.json", **SETTINGS)
    ref_st = hf_reference(model, tmp_path / "hf-safetensors.json")
    # what fp16 vLLM kernels do to this model, against transformers fp32
    floor = compare(ref_st, st)
    report = {"safetensors_vs_hf_fp32": floor}
    for kind in ("bf16", "q8_0", "Q4_K_M"):
        run = generate(glm5_ggufs[kind], tmp_path / f"gguf-{kind}.json", **SETTINGS)
        assert run["indexer_backend"] == "triton"
        assert run["triton_indexer_calls"]["prefill"] > 0
        deq = gr.dequantized_checkpoint(gguf, glm5_ggufs[kind], model, tmp_path / f"deq-{kind}")
        ref = hf_reference(deq, tmp_path / f"hf-{kind}.json")
        report[f"gguf_{kind}_vs_safetensors"] = compare(st, run)
        report[f"gguf_{kind}_vs_hf_fp32_dequantized"] = compare(ref, run)
    print("GGUF_ENGINE_REPORT " + json.dumps(report))
    # bf16 GGUF = the safetensors weights. Measured on the H200 (2026-11-29): mean
    # 0.076 nats, not 0 (the GGUF quant config changes which kernels run; the cause
    # is not pinned down), against 4.5 for the q/kv shard swap this test found.
    same = report["gguf_bf16_vs_safetensors"]
    assert same["mean"] <= 0.2, same
    # Against transformers fp32 on the file's own (dequantized) weights, each GGUF
    # run stays within the error the fp16 engine shows on the safetensors model
    # (x2, and 0.05 nats): vLLM's GGUF kernels also quantize activations to 8 bits.
    for kind in ("bf16", "q8_0", "Q4_K_M"):
        got = report[f"gguf_{kind}_vs_hf_fp32_dequantized"]
        assert got["mean"] <= 2 * floor["mean"] + 0.05, (kind, got, floor)
