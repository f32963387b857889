# SPDX-License-Identifier: Apache-2.0
"""In float16 vLLM's DeepSeek decoder layers carry the residual stream divided by
routed_scaling_factor s (against float16 overflow), so every RMSNorm of that stream sees
eps x s^2 relative to it; a GGUF runs float16 by default from SM 10.0 on. The model,
after loading its weights, divides those norms' eps by s^2, whatever the loader
(vllm/model_executor/models/deepseek_fp16_residual_scale.py; the safetensors checkpoint
against its GGUF: test_gguf_fp16_as_safetensors.py). Checked on vLLM's
GlmMoeDsaForCausalLM built on the CPU from the tiny GLM-5's Q4_K_M file, the way the
GGUF plugin's loader fills it (glm5_vllm_cpu.py): which norms change, by how much, and what
vLLM's own RMSNorm then computes on a stream divided by s, against the same norm with the
file's eps on the undivided stream."""

import pytest

from vllm_gguf_plugin.gguf_model import config_from_gguf


@pytest.fixture(scope="module")
def built(run_without_gpu, glm5_ggufs) -> dict:
    path = glm5_ggufs["Q4_K_M"]
    return {dtype: run_without_gpu("tests.models.quantization.glm5_vllm_cpu", path,
                                   "--dtype", dtype)[0]
            for dtype in ("float16", "bfloat16")} | {"config": config_from_gguf(path)}


def test_fp16_stream_norms_take_eps_over_scale_squared(built):
    config = built["config"]
    eps, s = config.rms_norm_eps, config.routed_scaling_factor
    assert s != 1.0
    got = built["float16"]["norm_eps"]
    layers = range(config.num_hidden_layers)
    stream = ({f"model.layers.{i}.post_attention_layernorm" for i in layers}
              | {f"model.layers.{i}.input_layernorm" for i in layers if i > 0}
              | {"model.norm"})
    assert stream <= set(got)
    changed = {name for name, e in got.items() if e != eps}
    assert changed == stream  # layer 0's input norm and the attention's own norms keep eps
    assert all(got[name] == pytest.approx(eps / s**2, rel=1e-12) for name in stream)
    assert set(built["bfloat16"]["norm_eps"]) == set(got)
    assert all(e == eps for e in built["bfloat16"]["norm_eps"].values())


def test_fp16_stream_norms_compute_the_models_norm(built):
    """On a stream of mean square near eps: within float rounding of the undivided
    stream's norm; with the file's eps on the divided stream, far from it."""
    scaled = built["float16"]["scaled_norms"]
    assert len(scaled) == 2 * built["config"].num_hidden_layers
    for name, (matched, unmatched) in scaled.items():
        assert matched < 2e-3, name
        assert unmatched > 0.1, name
    assert built["bfloat16"]["scaled_norms"] == {}


T = 128  # prompt tokens: the tiny GLM-5's index_topk, so its top-k is every token


@pytest.fixture(scope="module")
def logits(run_without_gpu, glm5_gguf, tmp_path_factory) -> dict:
    """{(engine, dtype): logits [T, vocab]} of one prompt: vLLM's model of the bf16 file
    run on the CPU (glm5_vllm_cpu.py --inputs: its modules, attention and routed experts
    in PyTorch) and transformers on the checkpoint the file holds exactly."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from tests.models.glm5_generate import prompts
    from tests.models.glm5_trained import _AllTokensIndexer

    _, checkpoint, bf16 = glm5_gguf
    tmp = tmp_path_factory.mktemp("fp16-logits")
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    ids = torch.tensor(prompts(vocab)[0][:T])
    torch.save(ids, tmp / "ids.pt")
    out = {}
    for dtype in ("float32", "float16"):
        run_without_gpu("tests.models.quantization.glm5_vllm_cpu", bf16, "--dtype", dtype,
                        "--inputs", tmp / "ids.pt", "--out", tmp / f"{dtype}.pt")
        out["vllm", dtype] = torch.load(tmp / f"{dtype}.pt")
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype))
        with torch.no_grad(), _AllTokensIndexer():
            out["transformers", dtype] = model.eval()(ids[None]).logits[0].float()
    return out


def test_fp16_model_computes_the_model(logits):
    """vLLM's model in float16 (the residual stream divided by routed_scaling_factor, the
    norms' eps matched) is the model within float16's rounding: its logprobs no further
    from transformers' float32 than a few times transformers' own float16 is; in float32
    the same as transformers'. The factor is the CPU's: PyTorch's float16 kernels differ by
    machine (0.93x transformers' error where this was written, 2.9x on an AVX2-only AMD
    EPYC), while the norms with the file's eps gave 27x."""
    ref = logits["transformers", "float32"].log_softmax(-1)

    def error(engine, dtype):
        return (logits[engine, dtype].log_softmax(-1) - ref).abs().mean().item()

    errors = {k: error(*k) for k in logits}
    assert errors["vllm", "float32"] < 1e-3, errors
    assert errors["vllm", "float16"] <= 4 * errors["transformers", "float16"], errors
