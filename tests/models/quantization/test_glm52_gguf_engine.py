# SPDX-License-Identifier: Apache-2.0
"""GPU: the tiny GLM-5.2 (IndexShare: shared layers reuse the previous full layer's
top-k and have no indexer) from llama.cpp GGUFs in vLLM (TRITON_MLA_SPARSE, the
portable indexer, fp16 as on SM>=100), with nothing but the GGUF file, against
transformers fp32.

The model is glm5_tiny.make_tiny_glm52 (schedule "FSFSSF", rope_theta 8e6, a 1M
context, nonzero routing and indexer key-norm biases), the files the conftest's
glm52_ggufs: bf16 and q8_0 from llama.cpp's converter, Q4_K_M from llama-quantize,
and "copies-bf16", converted from a checkpoint whose shared layers carry copies of
the previous full layer's indexer weights. References:
- the same model from its safetensors checkpoint in vLLM with the same settings:
  the bf16 GGUF holds the same numbers, so vLLM must build the same model (same
  parameters, quant methods and config, an indexer on the full layers only) and
  the outputs may differ only as much as two runs of the safetensors model do;
  the copies file must load exactly the bf16 file's parameters;
- transformers fp32 (its GlmMoeDsa runs the shared layers on the previous full
  layer's top-k) on each GGUF's weights dequantized by gguf-py
  (gguf_reference.dequantized_checkpoint), for bf16, q8_0 and Q4_K_M.
Prompts of 300-1000 tokens exceed index_topk (128), so the selection matters.

Needs a CUDA GPU, the overlay wheels installed, transformers 5.17, and the pinned
llama.cpp tools (offline: VLLM_OVERLAY_LLAMA_CPP, VLLM_OVERLAY_LLAMA_QUANTIZE);
about 12 vLLM and transformers runs of the tiny model, a few minutes on an H200.
"""

import json

import pytest

from tests.models.glm5_runs import compare, generate, hf_reference, within_rerun
from tests.models.glm5_tiny import GLM52_INDEXER_TYPES
from tests.models.quantization import gguf_reference as gr
from tests.models.quantization.test_glm5_gguf_engine import SETTINGS, model_differences

FULL = [i for i, t in enumerate(GLM52_INDEXER_TYPES) if t == "full"]

def indexer_layers(run: dict) -> list[int]:
    """The layers of the engine's model that have an indexer (--inspect dump)."""
    return sorted({int(n.split(".")[2]) for n in run["model"]["params"] if ".indexer." in n})


@pytest.mark.gpu
def test_glm52_gguf_in_vllm(glm52_gguf, glm52_ggufs, tmp_path):
    llama_cpp, model, _ = glm52_gguf
    gguf = gr.gguf_module(llama_cpp)
    st = generate(model, tmp_path / "safetensors.json", inspect="", **SETTINGS)
    rerun = generate(model, tmp_path / "safetensors-rerun.json", **SETTINGS)
    ref_st = hf_reference(model, tmp_path / "hf-safetensors.json")
    # what fp16 vLLM kernels do to this model, against transformers fp32
    floor = compare(ref_st, st)
    report = {"safetensors_vs_hf_fp32": floor, "safetensors_rerun": compare(st, rerun),
              "safetensors_indexer_layers": indexer_layers(st)}
    runs = {}
    for kind in ("bf16", "copies-bf16", "q8_0", "Q4_K_M"):
        inspect = {"inspect": ""} if kind.endswith("bf16") else {}
        run = runs[kind] = generate(glm52_ggufs[kind], tmp_path / f"gguf-{kind}.json",
                                    **inspect, **SETTINGS)
        assert run["indexer_backend"] == "triton"
        assert run["triton_indexer_calls"]["prefill"] > 0
        report[f"gguf_{kind}_vs_safetensors"] = compare(st, run)
        if kind.endswith("bf16"):
            report[f"gguf_{kind}_loaded_vs_safetensors"] = model_differences(st, run)
            report[f"gguf_{kind}_indexer_layers"] = indexer_layers(run)
        if kind != "copies-bf16":  # its numbers are the bf16 file's
            deq = gr.dequantized_checkpoint(gguf, glm52_ggufs[kind], model,
                                            tmp_path / f"deq-{kind}")
            ref = hf_reference(deq, tmp_path / f"hf-{kind}.json")
            report[f"gguf_{kind}_vs_hf_fp32_dequantized"] = compare(ref, run)
    report["copies_vs_bf16_params_differ"] = sorted(
        n for n, v in runs["copies-bf16"]["model"]["params"].items()
        if runs["bf16"]["model"]["params"].get(n) != v)
    print("GGUF52_ENGINE_REPORT " + json.dumps(report))
    # vLLM builds the indexer on the full layers only, from safetensors and from GGUF
    assert report["safetensors_indexer_layers"] == FULL
    for kind in ("bf16", "copies-bf16"):
        assert report[f"gguf_{kind}_indexer_layers"] == FULL, kind
        # the bf16 GGUF holds the checkpoint's numbers: the same parameters, methods
        # and config as the safetensors model
        assert report[f"gguf_{kind}_loaded_vs_safetensors"] == {
            "params_differ": [], "params_only_in_one": [], "quant_methods_differ": {},
            "config_differs": {}}, kind
    assert report["copies_vs_bf16_params_differ"] == []
    # same model, so the runs may differ only as much as two runs of one model do
    for kind in ("bf16", "copies-bf16"):
        same = report[f"gguf_{kind}_vs_safetensors"]
        assert within_rerun(same, report["safetensors_rerun"]), (kind, same)
    # against transformers fp32 on the file's own (dequantized) weights, each GGUF run
    # stays within the error the fp16 engine shows on the safetensors model (x2, and
    # 0.05 nats), the bound of the GLM-5 engine test
    for kind in ("bf16", "q8_0", "Q4_K_M"):
        got = report[f"gguf_{kind}_vs_hf_fp32_dequantized"]
        assert got["mean"] <= 2 * floor["mean"] + 0.05, (kind, got, floor)
