# SPDX-License-Identifier: Apache-2.0
"""In float16 vLLM's DeepSeek decoder layers carry the residual stream divided by
routed_scaling_factor s, and the model, after loading its weights, divides the eps of that
stream's RMSNorms by s^2 (vllm/model_executor/models/deepseek_fp16_residual_scale.py, from
DeepseekV2Model.load_weights and, for an MTP draft, DeepSeekMTP.load_weights), whatever the
loader. So the tiny GLM-5 in float16 computes the same from its safetensors checkpoint
(vLLM's DefaultModelLoader) as from the bf16 GGUF that holds that checkpoint exactly (the
GGUF plugin's loader): the reference here is the GGUF's run. Both are vLLM's
GlmMoeDsaForCausalLM (and its DeepSeekMTP draft) built and run on the CPU (glm5_vllm_cpu.py,
glm5_mtp_cpu.py: vLLM's modules, with MLA attention and the routed experts in PyTorch);
on the CPU where this was written both gave bit-equal logits."""

import json

import pytest
import torch

T = 128  # prompt tokens: the tiny GLM-5's index_topk, so its top-k is every token
RUNS = {  # name: (the fixture's model, glm5_vllm_cpu.py's extra arguments)
    "safetensors": ("checkpoint", ()),
    "gguf": ("bf16", ()),
    # the safetensors model with every RMSNorm back at the file's eps: no fix
    "safetensors, file's eps": ("checkpoint", ("--file-eps",)),
}


@pytest.fixture(scope="module")
def runs(run_without_gpu, glm5_gguf, tmp_path_factory) -> dict:
    """{run: (glm5_vllm_cpu.py's summary, float32 logits [T, vocab])} of one prompt,
    the model loaded in float16, and "config": the checkpoint's config.json."""
    from tests.models.glm5_generate import prompts

    _, checkpoint, bf16 = glm5_gguf
    paths = {"checkpoint": checkpoint, "bf16": bf16}
    config = json.loads((checkpoint / "config.json").read_text())
    tmp = tmp_path_factory.mktemp("fp16-as-safetensors")
    ids = torch.tensor(prompts(config["vocab_size"])[0][:T])
    assert len(ids) == T
    torch.save(ids, tmp / "ids.pt")
    out = {"config": config}
    for i, (name, (model, extra)) in enumerate(RUNS.items()):
        summary, = run_without_gpu("tests.models.quantization.glm5_vllm_cpu", paths[model],
                                   "--dtype", "float16", "--inputs", tmp / "ids.pt",
                                   "--out", tmp / f"{i}.pt", *extra)
        out[name] = summary, torch.load(tmp / f"{i}.pt")
    return out


def test_both_loaders_match_the_stream_norms(runs):
    """The same norms take eps / s^2 after either loader: those of the scaled stream."""
    config = runs["config"]
    eps, s = config["rms_norm_eps"], config["routed_scaling_factor"]
    assert s != 1.0
    st, gguf = runs["safetensors"][0]["norm_eps"], runs["gguf"][0]["norm_eps"]
    assert st == gguf
    layers = range(config["num_hidden_layers"])
    stream = ({f"model.layers.{i}.post_attention_layernorm" for i in layers}
              | {f"model.layers.{i}.input_layernorm" for i in layers if i > 0}
              | {"model.norm"})
    assert {name for name, e in st.items() if e != eps} == stream
    assert all(st[name] == pytest.approx(eps / s**2, rel=1e-12) for name in stream)


def test_same_weights(runs):
    """Both loaders fill the same parameters (names, dtypes, shapes)."""
    assert runs["safetensors"][0]["params"] == runs["gguf"][0]["params"]


def test_safetensors_computes_what_the_gguf_does(runs):
    """The safetensors model's float16 logits are the GGUF model's within a tolerance
    far below what the fix moves them: without it (the file's eps on the scaled stream)
    they are more than 100x further off."""
    st, gguf, unfixed = (runs[name][1] for name in RUNS)
    assert st.shape == gguf.shape == (T, runs["config"]["vocab_size"])
    assert torch.isfinite(st).all()
    tol = 1e-3 * gguf.abs().max().item()
    torch.testing.assert_close(st, gguf, rtol=0, atol=tol)
    off = (unfixed - gguf).abs().max().item()
    assert off > 100 * tol, (off, tol)
    assert off > 100 * (st - gguf).abs().max().item()


@pytest.fixture(scope="module")
def drafts(run_without_gpu, glm5_gguf, tmp_path_factory) -> dict:
    """{loader: (glm5_mtp_cpu.py's summary, its OUT.pt)} of the MTP draft in float16,
    from the checkpoint and from the bf16 GGUF, run on the same random inputs."""
    _, checkpoint, bf16 = glm5_gguf
    config = json.loads((checkpoint / "config.json").read_text())
    tmp = tmp_path_factory.mktemp("fp16-drafts")
    gen = torch.Generator().manual_seed(0)
    n = 32
    torch.save({"input_ids": torch.randint(3, config["vocab_size"], (n,), generator=gen),
                "positions": torch.arange(n),
                "hidden_states": torch.randn(n, config["hidden_size"], generator=gen)},
               tmp / "inputs.pt")
    out = {}
    for name, path in (("safetensors", checkpoint), ("gguf", bf16)):
        summary = run_without_gpu("tests.models.quantization.glm5_mtp_cpu", path,
                                  "--dtype", "float16", "--inputs", tmp / "inputs.pt",
                                  "--out", tmp / f"{name}.pt")
        out[name] = summary, torch.load(tmp / f"{name}.pt")
    return out


def test_mtp_draft_the_same_from_both_loaders(drafts, glm5_gguf):
    """DeepSeekMTP.load_weights matches the draft's stream norms (its block's
    post-attention norm, the shared head's) after either loader, and the float16
    draft's hidden states from the checkpoint, before and after the shared head's norm,
    are the GGUF's. (Not its logits: for an MTP draft upstream's proposer takes the
    target's head in place of the checkpoint's shared_head.head, the GGUF path keeps a
    draft head that is its own tensor in the file, and the tiny GLM-5's is.)"""
    config = json.loads((glm5_gguf[1] / "config.json").read_text())
    eps, s = config["rms_norm_eps"], config["routed_scaling_factor"]
    n = config["num_hidden_layers"]
    st, gguf = drafts["safetensors"], drafts["gguf"]
    assert st[0]["model_class"] == gguf[0]["model_class"] == "DeepSeekMTP"
    assert st[0]["norm_eps"] == gguf[0]["norm_eps"]
    stream = {f"model.layers.{n}.mtp_block.post_attention_layernorm",
              f"model.layers.{n}.shared_head.norm"}
    assert {name for name, e in st[0]["norm_eps"].items() if e != eps} == stream
    assert all(st[0]["norm_eps"][name] == pytest.approx(eps / s**2, rel=1e-12)
               for name in stream)
    for key in ("hidden_states", "normed_hidden_states"):
        got, ref = st[1][key], gguf[1][key]
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-3 * ref.abs().max().item())
