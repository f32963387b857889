# SPDX-License-Identifier: Apache-2.0
"""MTP speculative decoding from a glm-dsa GGUF, on the CPU.

The model is the trained tiny GLM-5 (glm5_trained.py: main model and MTP head
trained together on a corpus with a known rule), as llama.cpp writes it: bf16 and
q8_0 from its converter; Q4_K_M, Q2_K and IQ2_M (with an importance matrix from
llama-imatrix) from llama-quantize, which quantizes the embedding and the nextn
tensors too; bf16 with the converter's --no-mtp; and q8_0 of a checkpoint whose MTP
block has its own embedding (GLM-5's has none). vLLM's draft for
`--speculative-config '{"method": "mtp", ...}'` (SpeculativeConfig's deepseek_mtp
config, DeepSeekMTP) is built by vLLM's MTP proposer (EagleProposer.load_model:
the GGUF plugin's loader, then what it shares of the target's modules) in a
subprocess (glm5_mtp_cpu.py), after the target model, as the engine does.
References:
- the HF checkpoint the files were converted from: every draft parameter holds the
  checkpoint's tensors (in vLLM's fused layout), exactly for tensors the file stores
  in bf16/f32, within the quant type's error otherwise (quantized parameters
  dequantized by gguf-py); which GGUF tensors a parameter comes from is looked up in
  gguf-py's own name map, and every tensor of the file's MTP block is used;
- what the proposer shares: the target's embedding and head where the file's draft
  tensor is the target's (the checkpoint's MTP head is a copy of lm_head, so its
  nextn copy in the file is the same bytes exactly when llama.cpp gave both the
  same type; the checkpoint has no MTP embedding), the file's own tensor otherwise;
- the draft's logits on the CPU (vLLM's modules, the device kernels replaced by
  PyTorch) against the nextn block written here from the architecture (DeepSeek-V3's
  MTP module as vLLM runs it): the embedding of token t+1 (zero at position 0) and
  the main model's final hidden state of token t, enorm/hnorm, eh_proj over their
  concatenation, one GLM-5 decoder layer (transformers' GlmMoeDsaDecoderLayer), the
  shared head (its norm, its head), on the checkpoint's weights in fp32;
- the corpus rule: the draft's greedy token t+2 is mostly the rule's S1[token t+1].
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.models import glm5_trained
from tests.models.quantization import gguf_reference as gr
from tests.models.quantization.test_gguf_glm_dsa import REL_ERR as GLM_DSA_REL_ERR

N = glm5_trained.N_LAYERS  # the MTP block is layer N (blk.N in the GGUF)
KINDS = ("bf16", "q8_0", "Q4_K_M", "Q2_K", "IQ2_M")
# the MTP block's own embedding (not in GLM-5's checkpoint): the main one with rows
# changed, so that its file tensor is not the target's
OWN_EMBED = "own-embed-q8_0"
EXACT = {"F32", "BF16"}  # types that hold the bf16 checkpoint's values exactly
# relative error bounds of the other types llama-quantize writes here, about 1.35x
# the largest measured on this model's draft (Q2_K 0.30, IQ3_S 0.17, Q3_K 0.15,
# IQ4_XS 0.077, IQ4_NL with IQ4_XS 0.075); Q4_0 holds only some kv_b heads here
REL_ERR = {**GLM_DSA_REL_ERR, "Q4_0": 0.12, "IQ4_NL": 0.1, "IQ4_XS": 0.1, "Q3_K": 0.2,
           "IQ3_S": 0.22, "Q2_K": 0.4}
T = 48  # corpus tokens for the logits check (<= index_topk: the top-k is every token)
# vLLM parameters that fuse checkpoint tensors (row blocks, in this order)
FUSED = {"fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
         "gate_up_proj": ("gate_proj", "up_proj"),
         "indexer.wk_weights_proj": ("indexer.wk", "indexer.weights_proj")}


@pytest.fixture(scope="module")
def trained():
    """The trained checkpoint (trained once, cached; see glm5_trained.py)."""
    return glm5_trained.trained_glm5()


@pytest.fixture(scope="module")
def checkpoint(trained) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(trained / "model.safetensors").items()}


@pytest.fixture(scope="module")
def mtp_ggufs(trained, tmp_path_factory):
    """(llama.cpp tree, {kind: GGUF}) of the trained model."""
    from safetensors.torch import load_file, save_file

    llama_cpp = gr.llama_cpp_dir(tmp_path_factory.getbasetemp() / "llama-cpp")
    tmp = tmp_path_factory.mktemp("gguf-mtp")
    files = {k: gr.convert(llama_cpp, trained, tmp / f"glm5-trained-{k}.gguf", k)
             for k in ("bf16", "q8_0")}
    for k in ("Q4_K_M", "Q2_K", "IQ2_M"):
        files[k] = gr.quantize(files["bf16"], tmp / f"glm5-trained-{k}.gguf", k)
    files["no-mtp"] = gr.convert(llama_cpp, trained, tmp / "glm5-trained-no-mtp-bf16.gguf",
                                 "bf16", "--no-mtp")
    own = tmp / "glm5-trained-own-embed"
    shutil.copytree(trained, own)
    tensors = load_file(own / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"].clone()
    embed[::2] = -embed[::2]
    tensors[f"model.layers.{N}.embed_tokens.weight"] = embed
    save_file(tensors, own / "model.safetensors", metadata={"format": "pt"})
    files[OWN_EMBED] = gr.convert(llama_cpp, own, tmp / "glm5-trained-own-embed-q8_0.gguf",
                                  "q8_0")
    return llama_cpp, files


def reference_config(trained: Path):
    """transformers' config of the checkpoint with the MTP block as its layer N (a
    MoE layer with its own indexer, as GLM-5's MTP layer)."""
    from transformers import GlmMoeDsaConfig

    cfg = json.loads((trained / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}
    cfg.update(num_hidden_layers=N + 1, mlp_layer_types=cfg["mlp_layer_types"] + ["sparse"],
               indexer_types=cfg["indexer_types"] + ["full"],
               layer_types=cfg["layer_types"] + ["deepseek_sparse_attention"])
    config = GlmMoeDsaConfig(**cfg)
    config._attn_implementation = "sdpa"
    return config


@torch.no_grad()
def main_hidden(trained: Path, ids: torch.Tensor) -> torch.Tensor:
    """The main model's final (normed) hidden states, transformers fp32: what vLLM's
    target hands its MTP draft."""
    from transformers import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
    with glm5_trained._AllTokensIndexer():
        return model.model(input_ids=ids[None]).last_hidden_state[0]


@torch.no_grad()
def mtp_reference(hf: dict, config, input_ids, positions, hidden) -> torch.Tensor:
    """The nextn block's logits: input_ids[i] is token t+1, hidden[i] the main
    model's hidden state of token t = positions[i]."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
        GlmMoeDsaDecoderLayer,
        GlmMoeDsaRotaryEmbedding,
    )

    p, eps = f"model.layers.{N}.", config.rms_norm_eps

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    # the main model's embedding (the checkpoint has no MTP copy); vLLM's MTP layer
    # masks it at position 0, where there is no token t
    e = hf["model.embed_tokens.weight"][input_ids]
    e = torch.where(positions[:, None] == 0, torch.zeros_like(e), e)
    x = torch.cat([rms(e, hf[p + "enorm.weight"]), rms(hidden, hf[p + "hnorm.weight"])], -1)
    x = x @ hf[p + "eh_proj.weight"].T
    layer = GlmMoeDsaDecoderLayer(config, N).eval()
    own = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")
    state = {k[len(p):]: v for k, v in hf.items() if k.startswith(p) and k[len(p):].startswith(own)
             and ".experts." not in k}
    # transformers holds the routed experts stacked ([gate; up] rows per expert), the
    # checkpoint per expert
    experts = range(config.n_routed_experts)
    ex = p + "mlp.experts"
    state["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([hf[f"{ex}.{i}.gate_proj.weight"], hf[f"{ex}.{i}.up_proj.weight"]])
         for i in experts])
    state["mlp.experts.down_proj"] = torch.stack([hf[f"{ex}.{i}.down_proj.weight"]
                                                  for i in experts])
    layer.load_state_dict(state, strict=True)
    t = x.shape[0]
    pos = positions[None]
    rotary = GlmMoeDsaRotaryEmbedding(config)(x[None], position_ids=pos)
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
    with glm5_trained._AllTokensIndexer():
        x, _ = layer(x[None], attention_mask=mask, position_embeddings=rotary, position_ids=pos)
    return rms(x[0], hf[p + "shared_head.norm.weight"]) @ hf[p + "shared_head.head.weight"].T


@pytest.fixture(scope="module")
def mtp_inputs(trained, tmp_path_factory) -> dict:
    """A held-out corpus sequence as the draft sees it: tokens t+1, positions t,
    the main model's hidden states of tokens t."""
    ids = glm5_trained.sample(1, T + 1, seed=2 * 10 ** 6)[0]
    return {"input_ids": ids[1:], "positions": torch.arange(T),
            "hidden_states": main_hidden(trained, ids)[:T], "sequence": ids}


@pytest.fixture(scope="module")
def drafts(run_without_gpu, mtp_ggufs, mtp_inputs, tmp_path_factory) -> dict:
    """{kind: (glm5_mtp_cpu.py's summary, its OUT.pt)}; the bf16 draft also runs on
    mtp_inputs (float32)."""
    tmp = tmp_path_factory.mktemp("mtp-drafts")
    torch.save({k: mtp_inputs[k] for k in ("input_ids", "positions", "hidden_states")},
               tmp / "inputs.pt")
    out = {}
    for kind in (*KINDS, OWN_EMBED):
        extra = ["--inputs", tmp / "inputs.pt"] if kind == "bf16" else []
        summary = run_without_gpu("tests.models.quantization.glm5_mtp_cpu", mtp_ggufs[1][kind],
                                  "--out", tmp / f"{kind}.pt", *extra)
        out[kind] = (summary, torch.load(tmp / f"{kind}.pt"))
    return out


def checkpoint_sources(name: str, n_experts: int) -> tuple[list[list[str]], int]:
    """The checkpoint tensors vLLM draft parameter `name` (a shard: `name:i`) holds:
    (per expert, or one group, the tensors concatenated on dim 0; stacked on dim 0
    per expert when there are several groups), from the names DeepSeekMTP gives its
    layer N (`mtp_block.` is the decoder layer)."""
    base, _, shard = name.partition(":")
    base = base.replace(".mtp_block.", ".").replace("qweight", "weight")
    if ".experts.routed_experts." in base:
        head = base.split(".experts.")[0] + ".experts"
        parts = ("gate_proj", "up_proj") if base.endswith("w13_weight") else ("down_proj",)
        return [[f"{head}.{e}.{p}.weight" for p in parts] for e in range(n_experts)], 1
    for fused, parts in FUSED.items():
        if base.endswith(f".{fused}.weight"):
            names = [base.replace(f".{fused}.", f".{p}.") for p in parts]
            return [[names[int(shard)]] if shard else names], 0
    return [[base]], 0


def gguf_names(tmap, hf_name: str) -> list[str]:
    """The GGUF tensors of checkpoint tensor `hf_name`, by gguf-py's name map (the
    converter's), and its MLA split of kv_b_proj."""
    base, suffix = hf_name.rsplit(".", 1)
    if suffix == "e_score_correction_bias":
        base, suffix = f"{base}.e_score_correction", "bias"
    if base.endswith(".self_attn.kv_b_proj"):
        i = base.split(".")[2]
        return [f"blk.{i}.attn_k_b.weight", f"blk.{i}.attn_v_b.weight"]
    if ".mlp.experts." in base:
        head, _, proj = base.rsplit(".", 2)
        base = f"{head}.{proj}"
    return [f"{tmap.get_name(base)}.{suffix}"]


def loaded_value(gguf, params: dict, name: str) -> tuple[torch.Tensor, set[str]]:
    """(draft parameter `name` as float32, the GGUF types of its quantized data as the
    loader recorded them); quantized blocks are dequantized by gguf-py."""
    import numpy as np

    data = params[name]
    if data.is_floating_point():
        return data.float(), set()
    base, _, shard = name.partition(":")
    types_of = base.replace("qweight", "qweight_type")
    if ".experts.routed_experts." in base:  # per projection: w1 (gate), w3 (up); w2
        shards = ("w1", "w3") if "w13" in base else ("w2",)
        kinds = [int(params[f"{types_of}:{s}"]) for s in shards]
        rows = np.split(data.numpy(), len(shards), axis=1)
    else:
        kinds = [int(params[f"{types_of}:{shard}" if shard else types_of])]
        rows = [data.numpy()]
    parts = [gguf.quants.dequantize(r, gguf.GGMLQuantizationType(k)) for r, k in zip(rows, kinds)]
    value = np.concatenate(parts, axis=1 if len(parts) > 1 else 0)
    return torch.from_numpy(value.astype(np.float32)), {
        gguf.GGMLQuantizationType(k).name for k in kinds}


@pytest.mark.parametrize("kind", KINDS)
def test_nextn_tensors_fill_every_draft_parameter(drafts, mtp_ggufs, checkpoint, trained, kind):
    summary, out = drafts[kind]
    config = json.loads((trained / "config.json").read_text())
    # the draft vLLM builds for method "mtp" from nothing but the file
    assert summary["model_class"] == "DeepSeekMTP"
    assert summary["target_model_type"] == "glm_moe_dsa"
    draft = summary["draft"]
    assert (draft["model_type"], draft["n_predict"], draft["num_hidden_layers"],
            draft["runner_type"], draft["quantization"]) == (
        "deepseek_mtp", config["num_nextn_predict_layers"], N, "draft", "gguf")
    assert draft["hf_config_path"] == draft["model_weights"] == str(mtp_ggufs[1][kind])
    gguf = gr.gguf_module(mtp_ggufs[0])
    tensors = {t.name: t for t in gguf.GGUFReader(mtp_ggufs[1][kind]).tensors}
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM_DSA, N + 1)
    params = out["params"]
    used, errors = set(), {}
    for name in summary["params"]:  # every parameter of the draft
        keys = [k for k in params if k == name or k.startswith(name + ":")]
        if name.endswith("qweight_type"):
            continue  # read with its qweight below
        assert keys, f"{name}: no data loaded"
        for key in keys:
            groups, dim = checkpoint_sources(key, config["n_routed_experts"])
            ref = torch.stack([torch.cat([checkpoint[n] for n in g]) for g in groups]) \
                if dim else torch.cat([checkpoint[n] for n in groups[0]])
            got, loaded_types = loaded_value(gguf, params, key)
            sources = [g for group in groups for n in group for g in gguf_names(tmap, n)]
            assert set(sources) <= tensors.keys(), (key, sorted(set(sources) - tensors.keys()))
            used.update(sources)
            types = {tensors[g].tensor_type.name for g in sources}
            if loaded_types:  # held quantized: the file's blocks and type
                assert loaded_types == types, (key, loaded_types, types)
            assert got.shape == ref.shape, (key, got.shape, ref.shape)
            if types <= EXACT:
                torch.testing.assert_close(got, ref, rtol=0, atol=0, msg=key)
            else:
                assert types <= EXACT | REL_ERR.keys(), (key, types)
                errors[key] = err = ((got - ref).norm() / ref.norm()).item()
                assert err <= max(REL_ERR.get(t, 0) for t in types), (key, types, err)
    # every tensor of the file's MTP block went into the draft (the trained checkpoint
    # has no MTP copy of the embedding: the draft takes the main model's, token_embd)
    block = {g for g in tensors if g.startswith(f"blk.{N}.")}
    assert block - used == set()
    assert used - block == {"token_embd.weight"}
    if kind == "bf16":
        assert errors == {}
    else:
        assert errors, "no tensor of the draft was quantized"


@pytest.mark.parametrize("kind", (*KINDS, OWN_EMBED))
def test_proposer_shares_only_what_the_file_holds_once(drafts, mtp_ggufs, kind):
    """vLLM's MTP proposer after loading the draft (EagleProposer.load_model; with a
    quantized embedding it failed there, reading `.weight` of a module that holds
    `qweight`): the draft has the target's embedding and head exactly where the
    file's draft tensor is the target's, and the file's own tensor otherwise."""
    from safetensors.torch import load_file

    summary, out = drafts[kind]
    sharing = summary["sharing"]
    gguf = gr.gguf_module(mtp_ggufs[0])
    reader = gguf.GGUFReader(mtp_ggufs[1][kind])
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    if kind != "bf16":  # the files people serve: the embedding and head in blocks
        assert types["token_embd.weight"] not in EXACT | {"F16"}
        assert types[f"blk.{N}.nextn.shared_head_head.weight"] not in EXACT | {"F16"}
    if kind == "IQ2_M":
        assert reader.fields["general.file_type"].contents() == int(
            gguf.LlamaFileType.MOSTLY_IQ2_M)
        assert "IQ2_S" in types.values()
    head, embed = f"blk.{N}.nextn.shared_head_head.weight", f"blk.{N}.nextn.embed_tokens.weight"
    # the checkpoint's MTP head is a copy of lm_head: one tensor where stored alike
    same_head = types[head] == types["output.weight"]
    assert sharing["target_head_source"] == "output.weight"
    assert sharing["head_source"] == {str(N): "output.weight" if same_head else head}
    assert sharing["head_shared"] == {str(N): same_head}
    assert sharing["target_embed_source"] == "token_embd.weight"
    if kind != OWN_EMBED:
        # no MTP embedding in GLM-5's checkpoint: the draft's is the target's
        assert embed not in types
        assert sharing["embed_source"] == "token_embd.weight" and sharing["embed_shared"]
        return
    assert sharing["embed_source"] == embed and not sharing["embed_shared"]
    # the draft's own embedding holds the file's copy, not the main one
    hf = load_file(Path(mtp_ggufs[1][kind]).parent / "glm5-trained-own-embed" / "model.safetensors")
    own, main = hf[f"model.layers.{N}.embed_tokens.weight"].float(), \
        hf["model.embed_tokens.weight"].float()
    got = out["params"]["model.embed_tokens.weight"].float()
    assert ((got - own).norm() / own.norm()).item() <= REL_ERR["Q8_0"]
    assert ((got - main).norm() / main.norm()).item() > 0.5


def test_draft_logits_equal_the_nextn_block(drafts, mtp_inputs, checkpoint, trained):
    """The bf16 file's draft (float32) through vLLM's DeepSeekMTP on the CPU against
    the nextn block computed here; its greedy tokens are the corpus rule's."""
    _, out = drafts["bf16"]
    ref = mtp_reference(checkpoint, reference_config(trained), mtp_inputs["input_ids"],
                        mtp_inputs["positions"], mtp_inputs["hidden_states"])
    got = out["logits"]
    assert got.shape == ref.shape == (T, checkpoint["lm_head.weight"].shape[0])
    # fp32 both, summed in other orders: within 1e-4 of the logits' scale
    scale = ref.abs().max().item()
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4 * scale)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # after position 0 (no token t there) the draft predicts token t+2 by the rule,
    # S1[token t+1], in most positions (the rule's token is p_current = 0.7 likely)
    s1, _ = glm5_trained.corpus_rules()
    rule = torch.from_numpy(s1)[mtp_inputs["input_ids"]]
    assert (got.argmax(-1) == rule)[1:].float().mean().item() >= 0.5


SCALE = 2.5  # GLM-5's routed_scaling_factor (the trained model's is 1)


@pytest.fixture(scope="module")
def scaled(trained, mtp_ggufs, tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, its bf16 GGUF): the trained model with GLM-5's routed_scaling_factor
    and its routed experts' down projections divided by it (the same function, up to
    bf16 rounding): where vLLM's float16 layers divide the residual stream by it."""
    from safetensors.torch import load_file, save_file

    tmp = tmp_path_factory.mktemp("gguf-mtp-scaled")
    ckpt = tmp / "glm5-trained-scaled"
    shutil.copytree(trained, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "routed_scaling_factor": SCALE}))
    tensors = load_file(ckpt / "model.safetensors")
    for name, t in tensors.items():
        if ".mlp.experts." in name and name.endswith("down_proj.weight"):
            tensors[name] = (t.float() / SCALE).bfloat16()
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    return ckpt, gr.convert(mtp_ggufs[0], ckpt, tmp / "glm5-trained-scaled-bf16.gguf", "bf16")


def test_float16_draft_computes_the_nextn_block(scaled, run_without_gpu, mtp_inputs, tmp_path):
    """In float16 vLLM's DeepSeek layers carry the residual stream divided by
    routed_scaling_factor. The MTP block divides its own (eh_proj's output) as layer 0
    does, and the model divides the eps of the norms that see it (the block's
    post-attention norm, the shared head's) by the factor squared: the float16 draft's
    logits are the nextn block's (fp32) within float16's rounding, closer than the
    bfloat16 draft's. (A block that divides only its attention and MoE outputs, as
    upstream's does, is 0.45 of the logits' scale off.)"""
    from safetensors.torch import load_file

    ckpt, gguf = scaled
    torch.save({k: mtp_inputs[k] for k in ("input_ids", "positions", "hidden_states")},
               tmp_path / "inputs.pt")
    hf = {k: v.float() for k, v in load_file(ckpt / "model.safetensors").items()}
    ref = mtp_reference(hf, reference_config(ckpt), mtp_inputs["input_ids"],
                        mtp_inputs["positions"], mtp_inputs["hidden_states"])
    scale = ref.abs().max().item()
    logits, errors, eps = {}, {}, {}
    for dtype in ("float16", "bfloat16"):
        summary = run_without_gpu("tests.models.quantization.glm5_mtp_cpu", gguf, "--out",
                                  tmp_path / f"{dtype}.pt", "--inputs", tmp_path / "inputs.pt",
                                  "--dtype", dtype)
        logits[dtype] = torch.load(tmp_path / f"{dtype}.pt")["logits"]
        errors[dtype] = (logits[dtype] - ref).abs().max().item() / scale
        eps[dtype] = summary["norm_eps"]
    assert errors["float16"] < errors["bfloat16"] / 2, errors
    assert torch.equal(logits["float16"].argmax(-1), ref.argmax(-1))
    file_eps = json.loads((ckpt / "config.json").read_text())["rms_norm_eps"]
    stream = {f"model.layers.{N}.mtp_block.post_attention_layernorm",
              f"model.layers.{N}.shared_head.norm"}
    assert {n for n, e in eps["float16"].items() if e != file_eps} == stream
    assert all(eps["float16"][n] == pytest.approx(file_eps / SCALE**2, rel=1e-12)
               for n in stream)
    assert set(eps["bfloat16"]) == set(eps["float16"])
    assert all(e == file_eps for e in eps["bfloat16"].values())


def draft_config(gguf_file: Path):
    """The draft's ModelConfig vLLM builds for `--speculative-config '{"method":
    "mtp", "num_speculative_tokens": 1}'` on a GGUF (nothing but the file)."""
    from vllm.config import ParallelConfig, SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    target = EngineArgs(model=str(gguf_file), max_model_len=2048, skip_tokenizer_init=True,
                        dtype="float32").create_model_config()
    return SpeculativeConfig(target_model_config=target, target_parallel_config=ParallelConfig(),
                             method="mtp", num_speculative_tokens=1).draft_model_config


def test_file_without_mtp_block_is_refused(mtp_ggufs):
    """--no-mtp: no MTP tensors and no nextn_predict_layers key; asking for MTP is an
    error naming the cause, not a ZeroDivisionError or a missing-tensor error."""
    from vllm_gguf_plugin import gguf_model as gg

    gguf = gr.gguf_module(mtp_ggufs[0])
    f = mtp_ggufs[1]["no-mtp"]
    reader = gguf.GGUFReader(f)
    assert not [t.name for t in reader.tensors if t.name.startswith(f"blk.{N}.")]
    assert "glm-dsa.nextn_predict_layers" not in reader.fields
    assert gg.config_from_gguf(f).num_nextn_predict_layers == 0
    with pytest.raises(ValueError, match=r"speculative method 'mtp' needs the model's MTP "
                                         r"layers.*num_nextn_predict_layers is 0.*--no-mtp"):
        draft_config(f)


@pytest.mark.parametrize("drop, error", [
    # a trunk-only file: the metadata announces the block, no tensor of it is there
    (r"^blk\.{N}\.", r"declares 1 MTP block\(s\).*holds no tensor of block\(s\) {N}"),
    (r"^blk\.{N}\.nextn\.enorm\.", r"MTP block lacks 1 tensors .*blk\.{N}\.nextn\.enorm\.weight"),
    (r"^blk\.{N}\.indexer\.attn_k\.", r"MTP block lacks 1 tensors .*vLLM builds a DSA indexer"),
])
def test_incomplete_mtp_block_is_refused(mtp_ggufs, tmp_path, drop, error):
    import re

    from vllm_gguf_plugin.weights_adapter.glm_dsa import GGUFError, GlmDsaGGUF

    gguf = gr.gguf_module(mtp_ggufs[0])
    src = mtp_ggufs[1]["bf16"]
    names = [t.name for t in gguf.GGUFReader(src).tensors
             if re.search(drop.format(N=N), t.name)]
    assert names
    f = gr.rewrite(gguf, src, tmp_path / "cut.gguf", drop=tuple(names))
    config = draft_config(f).hf_config
    with pytest.raises(GGUFError, match=r"cut\.gguf: .*" + error.format(N=N)):
        GlmDsaGGUF([f], config)


def test_unsupported_nextn_type_is_refused_before_loading(mtp_ggufs, tmp_path):
    """A nextn tensor in a type the plugin's kernels cannot run (TQ2_0, ternary, by
    llama-quantize's --tensor-type): the draft's reader (what the adapter's
    prepare_loading builds, before the model exists) names the tensor, the type and
    the file; the main model, which does not load the block, is unaffected."""
    from vllm_gguf_plugin import gguf_model as gg
    from vllm_gguf_plugin.weights_adapter.glm_dsa import GGUFError, GlmDsaGGUF

    f = gr.quantize(mtp_ggufs[1]["bf16"], tmp_path / "ternary-eh-proj.gguf", "Q8_0",
                    extra=("--tensor-type", rf"blk\.{N}\.nextn\.eh_proj=tq2_0"))
    GlmDsaGGUF([f], gg.config_from_gguf(f))
    with pytest.raises(GGUFError, match=rf"ternary-eh-proj\.gguf: GGUF tensor "
                                        rf"'blk\.{N}\.nextn\.eh_proj\.weight' has type TQ2_0, "
                                        "which the GGUF plugin's kernels do not support"):
        GlmDsaGGUF([f], draft_config(f).hf_config)


def test_missing_nextn_head_falls_back_to_output(mtp_ggufs, checkpoint, tmp_path):
    """Without nextn.shared_head_head (optional in llama.cpp's loader, whose MTP graph
    then uses the main model's head) the draft's head is the file's `output`."""
    from vllm_gguf_plugin.weights_adapter.glm_dsa import GlmDsaGGUF

    gguf = gr.gguf_module(mtp_ggufs[0])
    f = gr.rewrite(gguf, mtp_ggufs[1]["bf16"], tmp_path / "no-head.gguf",
                   drop=(f"blk.{N}.nextn.shared_head_head.weight",))
    reader = GlmDsaGGUF([f], draft_config(f).hf_config)
    weights = dict(reader.weights())
    # (names as DeepSeekMTP.load_weights takes them: its layer's embed_tokens is the
    # model's)
    head, embed = (f"model.layers.{N}.shared_head.head.weight",
                   f"model.layers.{N}.embed_tokens.weight")
    assert reader.fallbacks == {head: "output.weight", embed: "token_embd.weight"}
    assert torch.equal(weights[head].float(), checkpoint["lm_head.weight"])
    assert torch.equal(weights[embed].float(), checkpoint["model.embed_tokens.weight"])


def test_trained_model_learned_the_corpus(trained):
    """The cached metrics of the training (held-out corpus sequences) against the
    corpus rule: the best predictor of token t+1 (and, given t+1, of t+2) is the
    rule's S1, right with probability ceiling = p_current + its share of the uniform
    rest; nothing beats it (beyond sampling noise), and a model that learned the rule
    comes near it."""
    m = glm5_trained.metrics(trained)
    r = glm5_trained.RECIPE
    lo, hi = r["content_tokens"]
    ceiling = r["p_current"] + (1 - r["p_current"] - r["p_previous"]) / (hi - lo)
    assert m["chance"] == round(1 / (hi - lo), 4)
    assert m["main_accuracy_ceiling"] == round(ceiling, 4)
    assert m["eval_tokens"] == r["eval_sequences"] * (r["seq_len"] - 2)
    noise = 4 * math.sqrt(ceiling * (1 - ceiling) / m["eval_tokens"])
    for key in ("main_accuracy", "mtp_accuracy"):
        # an evaluation that beats the rule reads the targets
        assert m[key] <= ceiling + noise, (key, m)
        # learned: at least half the best accuracy (90x chance)
        assert m[key] >= ceiling / 2, (key, m)
    # the draft's token is mostly the rule's, which a greedy target accepts
    assert m["mtp_agrees_with_main_greedy_rule"] >= 0.5, m
    # confident greedy: the rule's margin is log(p_current / p_previous) nats where
    # S2's token is not S1's; at least half of it on average
    assert m["main_top1_margin_nats"] >= 0.5 * math.log(r["p_current"] / r["p_previous"]), m
