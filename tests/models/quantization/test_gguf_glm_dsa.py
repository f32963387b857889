# SPDX-License-Identifier: Apache-2.0
"""vLLM's GGUF path for GLM-5 (`glm-dsa`), on CPU, against the HF checkpoint the
reference GGUFs were converted from by llama.cpp's own converter and quantizer.

- The config built from GGUF metadata equals the HF config on every field vLLM
  reads; the tokenizer built from `tokenizer.ggml.*` encodes like the HF one.
- Every GGUF tensor maps (by our table, cross-checked against gguf-py's own
  tensor-name map) and the weights the loader yields equal the HF weights: exactly
  for bf16, exactly to fp16 rounding for f16, within the format's error for
  q8_0 and the K-quants; kv_b_proj is rebuilt from attn_k_b/attn_v_b.
- Split files load as the single file; bad input fails with the name of the
  problem. (The GPU test loads the same files into the engine.)
"""

import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.models.quantization import gguf_reference as gr
from vllm_gguf_plugin import gguf_model as gg
from vllm_gguf_plugin.weights_adapter.glm_dsa import GlmDsaGGUF

TYPES = ("bf16", "f16", "q8_0", "Q4_K_M")
# Relative Frobenius error of a dequantized tensor against the bf16 original, by
# GGUF type: measured on the tiny model (Q4_K 0.072, Q5_K 0.036, Q6_K 0.018,
# Q8_0 0.0054) plus margin. A wrong layout (transposed, experts out of order,
# k/v halves swapped) gives errors around 1.4.
REL_ERR = {"Q8_0": 0.008, "Q6_K": 0.03, "Q5_K": 0.05, "Q5_0": 0.05, "Q4_K": 0.1}

# Config fields DeepseekV2/GlmMoeDsa in vLLM read (models/deepseek_v2.py, mla.py).
CONFIG_FIELDS = (
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
    "moe_intermediate_size", "num_hidden_layers", "first_k_dense_replace",
    "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
    "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group",
    "routed_scaling_factor", "norm_topk_prob", "topk_method", "scoring_func", "index_topk",
    "index_n_heads", "index_head_dim", "indexer_rope_interleave", "num_nextn_predict_layers",
    "max_position_embeddings", "rms_norm_eps", "rope_parameters", "tie_word_embeddings",
    "hidden_act", "mlp_layer_types", "indexer_types",
)


@pytest.fixture(scope="module")
def hf(glm5_gguf):
    _, model, _ = glm5_gguf
    return {k: v.float() for k, v in load_file(model / "model.safetensors").items()}


def yielded(files, config) -> dict[str, torch.Tensor]:
    """What the loader hands to DeepseekV2ForCausalLM.load_weights, quantized
    tensors dequantized by gguf-py (the reference implementation of the formats)."""
    import gguf

    out, types = {}, {}
    for name, t in GlmDsaGGUF(files, config).weights():
        if name.endswith(".qweight_type"):
            types[name.removesuffix("_type")] = gguf.GGMLQuantizationType(int(t))
        else:
            out[name] = t
    for name in [n for n in out if n.endswith(".qweight")]:
        data = gguf.quants.dequantize(out.pop(name).numpy(), types[name])
        out[name.removesuffix("qweight") + "weight"] = torch.from_numpy(np.array(data))
    return {k: v.float() for k, v in out.items()}


def stack_name(name: str) -> str:
    """The loader's name for the stacked experts tensor an expert's weight is in:
    ...mlp.experts.<e>.<proj>.weight -> ...mlp.experts.0.<proj>.weight."""
    return name.split(".experts.")[0] + ".experts.0." + name.rsplit(".", 2)[1] + ".weight"


def stored_types(reader) -> dict[str, set[str]]:
    """{vLLM name: the GGUF types of the tensors it is made of}."""
    stored = {}
    for g, h in reader.gguf_to_hf.items():
        stored.setdefault(h, set()).add(reader.tensors[g].tensor_type.name)
    return stored


def assert_checkpoint_values(name, w, ref, types):
    """A yielded tensor holds the checkpoint's values as its GGUF types store them:
    bf16/f32 exactly, f16 exactly rounded, quantized within the type's error."""
    if types <= {"F32", "BF16"}:  # the bf16 checkpoint's values, exactly
        torch.testing.assert_close(w, ref, rtol=0, atol=0, msg=name)
    elif types == {"F16"}:  # exactly the checkpoint's values rounded to fp16
        torch.testing.assert_close(w, ref.half().float(), rtol=0, atol=0, msg=name)
    else:
        err = ((w - ref).norm() / ref.norm()).item()
        assert err <= max(REL_ERR[t] for t in types if t in REL_ERR), (name, types, err)


def hf_view(hf, name, config, stacked):
    """The HF weight for a yielded name (experts.0 of a stacked tensor = all experts)."""
    if stacked:
        return torch.stack([hf[name.replace(".experts.0.", f".experts.{e}.")]
                            for e in range(config.n_routed_experts)])
    return hf[name]


@pytest.mark.parametrize("kind", TYPES + ("split",))
def test_config_from_gguf_equals_hf_config(glm5_gguf, glm5_ggufs, kind):
    from transformers import AutoConfig

    _, model, _ = glm5_gguf
    ref = AutoConfig.from_pretrained(model)
    config = gg.config_from_gguf(glm5_ggufs[kind])
    for f in CONFIG_FIELDS:
        assert getattr(config, f, None) == getattr(ref, f, None), f
    # vLLM's layer schedule of the indexer reads index_topk_pattern
    assert config.index_topk_pattern == "".join("F" if t == "full" else "S"
                                                for t in ref.indexer_types)
    # token ids come from the GGUF's tokenizer metadata
    tok = gg.tokenizer_from_gguf(glm5_ggufs[kind])
    assert tok.convert_ids_to_tokens(config.eos_token_id) == "<|endoftext|>"
    assert (config.eos_token_id, config.pad_token_id) == (ref.eos_token_id, ref.pad_token_id)


def test_config_through_vllm_get_config(glm5_ggufs):
    """vLLM's get_config on the .gguf path (config format "gguf", the plugin's parser)
    builds it from metadata, with overrides."""
    from vllm.transformers_utils.config import get_config

    config = get_config(str(glm5_ggufs["bf16"]), trust_remote_code=False,
                        config_format="gguf", hf_overrides_kw={"index_topk": 64})
    assert config.model_type == "glm_moe_dsa" and config.index_topk == 64
    assert config.architectures == ["GlmMoeDsaForCausalLM"]


TEXTS = [
    "GLM-5 sparse attention test sentence number 12345: the quick brown fox",
    "你好, мир! It's DON'T   spaces\n\n\ttabs 3.14159 and 1000000 dogs",
    "<|system|>be brief<|user|>hi<|assistant|> ok<|endoftext|>",
    "",
]


def test_tokenizer_from_gguf_encodes_like_hf(glm5_gguf, glm5_ggufs):
    from transformers import AutoTokenizer

    from vllm.tokenizers import get_tokenizer

    _, model, _ = glm5_gguf
    ref = AutoTokenizer.from_pretrained(model)
    tok = gg.tokenizer_from_gguf(glm5_ggufs["bf16"])
    via_vllm = get_tokenizer(str(glm5_ggufs["bf16"]), tokenizer_mode=gg.TOKENIZER_MODE)
    for text in TEXTS:
        ids = ref.encode(text)
        assert tok.encode(text) == ids, text
        assert via_vllm.encode(text) == ids, text
        assert tok.decode(ids) == text
        assert (tok.decode(ids, skip_special_tokens=True)
                == ref.decode(ids, skip_special_tokens=True))
    assert tok.eos_token == ref.eos_token
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tok.chat_template == gr.GLM_CHAT_TEMPLATE
    assert (tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    for special in gr.GLM_SPECIAL_TOKENS:  # single, unsplittable tokens
        assert tok.encode(special) == ref.encode(special) == [ref.convert_tokens_to_ids(special)]


def test_table_agrees_with_gguf_py(glm5_gguf, glm5_ggufs, hf):
    """Our glm-dsa table against gguf-py's tensor-name map (the converter's own):
    every HF tensor of the main model goes to the GGUF tensor gguf-py names."""
    import gguf

    config = gg.config_from_gguf(glm5_ggufs["bf16"])
    mapping = GlmDsaGGUF([glm5_ggufs["bf16"]], config).gguf_to_hf
    inverse = {}
    for g, h in mapping.items():
        inverse.setdefault(h, set()).add(g)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM_DSA, config.num_hidden_layers + 1)
    checked = 0
    for name in hf:
        if name.startswith(f"model.layers.{config.num_hidden_layers}."):
            continue  # MTP block
        base, suffix = name.rsplit(".", 1)
        if suffix == "e_score_correction_bias":  # gguf-py: ...e_score_correction + ".bias"
            base, suffix = f"{base}.e_score_correction", "bias"
        target = name
        if ".mlp.experts." in name:
            base = base.rsplit(".experts.", 1)[0] + ".experts." + base.rsplit(".", 1)[1]
            target = stack_name(name)
        if name.endswith("kv_b_proj.weight"):
            layer = name.split(".")[2]
            assert inverse[name] == {f"blk.{layer}.attn_k_b.weight", f"blk.{layer}.attn_v_b.weight"}
            checked += 1
            continue
        assert f"{tmap.get_name(base)}.{suffix}" in inverse[target], name
        checked += 1
    assert checked == len(set(mapping.values())) + sum(
        config.n_routed_experts - 1 for h in mapping.values() if ".experts.0." in h)


@pytest.mark.parametrize("kind", TYPES)
def test_weights_equal_hf_weights(glm5_ggufs, hf, kind):
    import gguf

    f = glm5_ggufs[kind]
    config = gg.config_from_gguf(f)
    out = yielded([f], config)
    reader = GlmDsaGGUF([f], config)
    main = {k for k in hf if not k.startswith(f"model.layers.{config.num_hidden_layers}.")}
    covered = {k for k in main if k in out or (".experts." in k and stack_name(k) in out)}
    assert covered == main
    stored = stored_types(reader)
    for name, w in out.items():
        ref = hf_view(hf, name, config, stacked=w.dim() == 3)
        assert w.shape == ref.shape, name
        assert_checkpoint_values(name, w, ref, stored[name if name in stored
                                                     else stack_name(name)])
    # kv_b_proj: [k_b[h]^T ; v_b[h]] from the file's own (dequantized) halves, exactly
    for layer in range(config.num_hidden_layers):
        k_b = reader.dequantized(f"blk.{layer}.attn_k_b.weight")
        v_b = reader.dequantized(f"blk.{layer}.attn_v_b.weight")
        H = config.num_attention_heads
        kv_b = out[f"model.layers.{layer}.self_attn.kv_b_proj.weight"].view(H, -1, config.kv_lora_rank)
        torch.testing.assert_close(kv_b[:, :config.qk_nope_head_dim], k_b.transpose(1, 2),
                                   rtol=0, atol=0)
        torch.testing.assert_close(kv_b[:, config.qk_nope_head_dim:], v_b, rtol=0, atol=0)
    if kind == "Q4_K_M":  # the quantizer made a real mix, including non-GGUF targets
        names = {t.name: t.tensor_type.name for t in reader.tensors.values()}
        assert {"Q4_K", "Q6_K"} <= set(names.values())
        assert names["blk.1.indexer.proj.weight"] not in ("F32", "F16", "BF16")
        assert gguf.GGMLQuantizationType.Q4_K.name in set(names.values())


def test_quantized_types_go_to_gguf_layers(glm5_ggufs):
    """Quantized tensors bound for GGUF layers keep their blocks (qweight + type);
    those bound for unquantized modules (indexer wk/weights_proj, router) and the
    rebuilt kv_b_proj are plain weights and listed as unquantized."""
    f = glm5_ggufs["Q4_K_M"]
    reader = GlmDsaGGUF([f], gg.config_from_gguf(f))
    names = dict(reader.weights())
    types = reader.weight_type_map()
    p = "model.layers.1."
    assert names[p + "mlp.experts.0.gate_proj.qweight"].dtype == torch.uint8
    assert int(names[p + "mlp.experts.0.gate_proj.qweight_type"]) == 12  # Q4_K
    for plain in ("self_attn.indexer.weights_proj.weight", "self_attn.indexer.wk.weight",
                  "self_attn.kv_b_proj.weight", "mlp.gate.weight"):
        assert names[p + plain].dtype == torch.float32 and types[p + plain] == "F32"
    # bf16 experts are yielded per expert, for the unquantized fused-MoE method
    b = GlmDsaGGUF([glm5_ggufs["bf16"]], gg.config_from_gguf(glm5_ggufs["bf16"]))
    per_expert = [n for n, _ in b.weights() if n.startswith(p + "mlp.experts.")]
    assert len(per_expert) == 3 * 8 and p + "mlp.experts.7.down_proj.weight" in per_expert


def test_unquantized_experts_select_fused_moe_method():
    from vllm_gguf_plugin.quantization.config import is_experts_unquantized_gguf

    unquantized = ["model.layers.1.mlp.experts.0.gate_proj", "model.layers.1.mlp.experts.0.up_proj",
                   "model.layers.2.mlp.shared_experts.gate_proj"]
    assert is_experts_unquantized_gguf("model.layers.1.mlp.experts", unquantized)
    assert not is_experts_unquantized_gguf("model.layers.11.mlp.experts", unquantized)
    assert not is_experts_unquantized_gguf("model.layers.2.mlp.experts", unquantized)


def test_split_loads_like_single_file(glm5_ggufs):
    from types import SimpleNamespace
    from unittest.mock import patch

    from vllm_gguf_plugin.weights_adapter import get_weights_adapter

    first = glm5_ggufs["split"]
    parts = gg.split_files(first)
    assert len(parts) >= 3 and parts[0] == first
    # any part names the set; the plugin's glm-dsa adapter loads all of it
    assert gg.split_files(parts[-1]) == parts
    config = gg.config_from_gguf(first)
    adapter = get_weights_adapter(config)
    parallel = SimpleNamespace(tensor_parallel_size=1, enable_expert_parallel=False)
    with patch("vllm.config.get_current_vllm_config",
               lambda: SimpleNamespace(parallel_config=parallel)):
        spec = adapter.prepare_loading(str(parts[1]), SimpleNamespace(hf_config=config))
    assert spec.weights_source == [str(p) for p in parts]
    # a directory holding the set means its first part
    assert gg.resolve_gguf_dir(str(first.parent)) == str(first)
    single = yielded([glm5_ggufs["bf16"]], config)
    split = yielded(parts, config)
    assert single.keys() == split.keys()
    for k in single:
        torch.testing.assert_close(split[k], single[k], rtol=0, atol=0)


def test_split_missing_or_mismatched_part(glm5_ggufs, tmp_path):
    parts = gg.split_files(glm5_ggufs["split"])
    d = tmp_path / "broken"
    d.mkdir()
    for p in parts[:-1]:
        shutil.copy(p, d / p.name)
    with pytest.raises(gg.GGUFError, match=f"missing.*{parts[-1].name}"):
        gg.split_files(d / parts[0].name)
    # a part from another position under this part's name
    shutil.copy(parts[0], d / parts[-1].name)
    with pytest.raises(gg.GGUFError, match=f"{parts[-1].name}: split metadata says part 1"):
        gg.split_files(d / parts[0].name)
    with pytest.raises(gg.GGUFError, match="holds 2 GGUF models"):
        shutil.copy(parts[0], d / "other.gguf")
        gg.resolve_gguf_dir(str(d))


def test_vocab_size_from_the_token_list(glm5_gguf, glm5_ggufs, tmp_path):
    # a file without <arch>.vocab_size: the token list gives it
    gguf = gr.gguf_module(glm5_gguf[0])
    f = gr.rewrite(gguf, glm5_ggufs["q8_0"], tmp_path / "novocab.gguf",
                   drop_keys=("glm-dsa.vocab_size",))
    assert "glm-dsa.vocab_size" not in gguf.GGUFReader(f).fields
    assert gg.config_from_gguf(f).vocab_size == gg.config_from_gguf(glm5_ggufs["q8_0"]).vocab_size


def test_truncated_file(glm5_ggufs, tmp_path):
    src = glm5_ggufs["q8_0"]
    cut = tmp_path / "cut.gguf"
    data = src.read_bytes()
    cut.write_bytes(data[: len(data) - 4096])
    with pytest.raises(gg.GGUFError, match=r"cut\.gguf: truncated: tensor '.*' ends at byte"):
        gg.config_from_gguf(cut)
    cut.write_bytes(data[:100])  # not even the header
    with pytest.raises(gg.GGUFError, match=r"cut\.gguf: states \d+ metadata entries, more "
                                           r"than its size allows"):
        gg.config_from_gguf(cut)


def test_wrong_architecture(glm5_gguf, glm5_ggufs, tmp_path):
    llama_cpp = glm5_gguf[0]
    other = gr.rewrite(gr.gguf_module(llama_cpp), glm5_ggufs["bf16"], tmp_path / "llama.gguf",
                       arch="llama")
    assert not gg.is_glm_dsa_gguf(other)
    with pytest.raises(gg.GGUFError, match="architecture is 'llama', not 'glm-dsa'"):
        gg.config_from_gguf(other)


def test_missing_tensor(glm5_gguf, glm5_ggufs, tmp_path):
    gguf = gr.gguf_module(glm5_gguf[0])
    f = gr.rewrite(gguf, glm5_ggufs["q8_0"], tmp_path / "missing.gguf",
                   drop=("blk.2.attn_v_b.weight",))
    with pytest.raises(gg.GGUFError, match="missing 1 tensors.*blk.2.attn_v_b.weight"):
        GlmDsaGGUF([f], gg.config_from_gguf(f))


def test_unmapped_tensor_and_shape_mismatch(glm5_gguf, glm5_ggufs, tmp_path):
    gguf = gr.gguf_module(glm5_gguf[0])
    # one block fewer in the metadata: blk.3 is now the MTP block, blk.4 maps nowhere
    # (without the indexer schedule, whose length llama.cpp checks against the blocks)
    f = gr.rewrite(gguf, glm5_ggufs["q8_0"], tmp_path / "blocks.gguf",
                   metadata={"glm-dsa.block_count": 4},
                   drop_keys=("glm-dsa.attention.indexer.types",))
    with pytest.raises(gg.GGUFError, match=r"map to no parameter.*blk\.4\."):
        GlmDsaGGUF([f], gg.config_from_gguf(f))
    f = gr.rewrite(gguf, glm5_ggufs["q8_0"], tmp_path / "shape.gguf",
                   metadata={"glm-dsa.attention.indexer.key_length": 64})
    with pytest.raises(gg.GGUFError, match=r"'blk\.0\.indexer\.[a-z_.]+' has shape "
                                           r"\[128(, 1024)?\], the config implies \[64"):
        GlmDsaGGUF([f], gg.config_from_gguf(f))


def test_unsupported_quant_type(glm5_gguf, tmp_path):
    """TQ1_0 (ternary) is a converter outtype vLLM's GGUF kernels cannot run."""
    llama_cpp, model, _ = glm5_gguf
    f = gr.convert(llama_cpp, model, tmp_path / "tq1.gguf", "tq1_0")
    with pytest.raises(gg.GGUFError, match=r"has type TQ1_0, which the GGUF plugin's kernels"):
        GlmDsaGGUF([f], gg.config_from_gguf(f))


def test_tensor_parallel_split_keeps_whole_quant_blocks(glm5_ggufs):
    """Row-parallel layers (o_proj, the down projections) split the input
    dimension, which quant types pack in blocks (32 for q8_0, 256 for K-quants).
    The tiny model's down projections have 256 inputs."""
    q8 = glm5_ggufs["q8_0"]
    config = gg.config_from_gguf(q8)
    GlmDsaGGUF([q8], config, tp_size=8)  # 256 / 8 = 32: one q8_0 block per rank
    with pytest.raises(gg.GGUFError, match=r"tensor parallel size 16: a rank would hold 16 inputs"):
        GlmDsaGGUF([q8], config, tp_size=16)
    k = glm5_ggufs["Q4_K_M"]
    with pytest.raises(gg.GGUFError, match=r"'blk\.\d+\.ffn_down(_shexp|_exps)?\.weight' \(Q\d_K, "
                                           r"256 inputs\) cannot be split over tensor parallel "
                                           r"size 2: .* blocks of 256"):
        GlmDsaGGUF([k], config, tp_size=2)
    # unquantized tensors split anywhere; tp 1 never checks
    GlmDsaGGUF([glm5_ggufs["bf16"]], config, tp_size=16)
    GlmDsaGGUF([k], config, tp_size=1)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_loader_takes_tensor_parallel_size_from_config(glm5_ggufs, expert_parallel):
    """The plugin's loader, through our adapter, checks the split with the engine's TP
    size (experts are not split along their inputs under expert parallelism; the shared
    expert is)."""
    from types import SimpleNamespace
    from unittest.mock import patch

    from vllm.config.load import LoadConfig
    from vllm_gguf_plugin.loader import GGUFModelLoader

    k = glm5_ggufs["Q4_K_M"]
    model_config = SimpleNamespace(model=str(k), model_weights=str(k), revision=None,
                                   hf_config=gg.config_from_gguf(k))
    parallel = SimpleNamespace(tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    with patch("vllm.config.get_current_vllm_config",
               lambda: SimpleNamespace(parallel_config=parallel)):
        loader = GGUFModelLoader(LoadConfig(load_format="gguf"))
        with pytest.raises(gg.GGUFError, match="tensor parallel size 2") as e:
            loader._prepare_adapter(model_config)
    if expert_parallel:  # the refused tensor is not a routed expert stack
        assert "_exps" not in e.value.args[0]
