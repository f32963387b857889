# SPDX-License-Identifier: Apache-2.0
"""The layout of llama.cpp's `glm-dsa` GGUF, checked against the HF checkpoint it
was converted from. This is what vLLM's GGUF loader has to invert: the split MLA
`attn_k_b`/`attn_v_b`, stacked experts, the indexer tensors and the metadata
keys a config is built from. Runs on CPU (conversion of the tiny model: seconds).
"""


import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.models.quantization import gguf_reference as gr


@pytest.fixture(scope="module")
def reference(glm5_gguf):
    llama_cpp, model, out = glm5_gguf
    gguf = gr.gguf_module(llama_cpp)
    reader = gguf.GGUFReader(out)
    hf = {k: v.float() for k, v in load_file(model / "model.safetensors").items()}
    return gguf, reader, hf, gr.config(model)


def tensor(reader, name, gguf):
    t = next(t for t in reader.tensors if t.name == name)
    data = np.array(t.data)
    if t.tensor_type == gguf.GGMLQuantizationType.BF16:
        data = torch.from_numpy(data.view(np.uint16).astype(np.int32) << 16).view(torch.float32)
        return data.reshape([int(d) for d in reversed(t.shape)])
    return torch.from_numpy(data.astype(np.float32)).reshape([int(d) for d in reversed(t.shape)])


def field(reader, key):
    return reader.fields[key].contents()


def test_metadata_carries_the_config(reference):
    gguf, reader, hf, cfg = reference
    a = "glm-dsa"
    assert field(reader, "general.architecture") == a
    expect = {
        # llama.cpp counts the MTP (nextn) blocks as blocks
        f"{a}.block_count": cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"],
        f"{a}.nextn_predict_layers": cfg["num_nextn_predict_layers"],
        f"{a}.embedding_length": cfg["hidden_size"],
        f"{a}.attention.head_count": cfg["num_attention_heads"],
        f"{a}.attention.q_lora_rank": cfg["q_lora_rank"],
        f"{a}.attention.kv_lora_rank": cfg["kv_lora_rank"],
        f"{a}.attention.key_length_mla": cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"],
        f"{a}.attention.value_length_mla": cfg["v_head_dim"],
        f"{a}.rope.dimension_count": cfg["qk_rope_head_dim"],
        f"{a}.expert_count": cfg["n_routed_experts"],
        f"{a}.expert_used_count": cfg["num_experts_per_tok"],
        f"{a}.expert_shared_count": cfg["n_shared_experts"],
        f"{a}.expert_feed_forward_length": cfg["moe_intermediate_size"],
        f"{a}.leading_dense_block_count": cfg["first_k_dense_replace"],
        f"{a}.attention.indexer.head_count": cfg["index_n_heads"],
        f"{a}.attention.indexer.key_length": cfg["index_head_dim"],
        f"{a}.attention.indexer.top_k": cfg["index_topk"],
        f"{a}.vocab_size": cfg["vocab_size"],
    }
    assert {k: field(reader, k) for k in expect} == expect
    assert field(reader, f"{a}.expert_weights_scale") == pytest.approx(cfg["routed_scaling_factor"])
    assert field(reader, f"{a}.expert_gating_func") == int(gguf.ExpertGatingFuncType.SIGMOID)
    # MLA is written as MQA over the latent: one KV head of 512 + 64.
    assert field(reader, f"{a}.attention.key_length") == cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    assert field(reader, "tokenizer.ggml.pre") == "glm4"


def test_split_kv_b_rebuilds_hf_kv_b_proj(reference):
    """kv_b_proj[h] = [attn_k_b[h]^T ; attn_v_b[h]] exactly, for every layer."""
    gguf, reader, hf, cfg = reference
    H, nope, v, lora = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"],
                        cfg["v_head_dim"], cfg["kv_lora_rank"])
    names = {t.name for t in reader.tensors}
    assert not any("attn_kv_b" in n for n in names)
    for layer in range(cfg["num_hidden_layers"]):
        k_b = tensor(reader, f"blk.{layer}.attn_k_b.weight", gguf)  # [H, lora, nope]
        v_b = tensor(reader, f"blk.{layer}.attn_v_b.weight", gguf)  # [H, v, lora]
        assert k_b.shape == (H, lora, nope) and v_b.shape == (H, v, lora)
        rebuilt = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(H * (nope + v), lora)
        ref = hf[f"model.layers.{layer}.self_attn.kv_b_proj.weight"]
        torch.testing.assert_close(rebuilt, ref, rtol=0, atol=0)


def test_experts_indexer_and_router(reference):
    gguf, reader, hf, cfg = reference
    E = cfg["n_routed_experts"]
    for layer in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        for g_name, hf_name in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            stacked = tensor(reader, f"blk.{layer}.ffn_{g_name}_exps.weight", gguf)
            ref = torch.stack([hf[f"{p}.mlp.experts.{e}.{hf_name}.weight"] for e in range(E)])
            torch.testing.assert_close(stacked, ref, rtol=0, atol=0)
        torch.testing.assert_close(tensor(reader, f"blk.{layer}.exp_probs_b.bias", gguf),
                                   hf[f"{p}.mlp.gate.e_score_correction_bias"], rtol=0, atol=0)
        torch.testing.assert_close(tensor(reader, f"blk.{layer}.ffn_gate_inp.weight", gguf),
                                   hf[f"{p}.mlp.gate.weight"], rtol=0, atol=0)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.self_attn.indexer"
        for gg, hh in (("indexer.attn_k", "wk"), ("indexer.proj", "weights_proj"),
                       ("indexer.attn_q_b", "wq_b"), ("indexer.k_norm", "k_norm")):
            torch.testing.assert_close(tensor(reader, f"blk.{layer}.{gg}.weight", gguf),
                                       hf[f"{p}.{hh}.weight"], rtol=0, atol=0)
        torch.testing.assert_close(tensor(reader, f"blk.{layer}.indexer.k_norm.bias", gguf),
                                   hf[f"{p}.k_norm.bias"], rtol=0, atol=0)


def test_every_hf_tensor_lands_in_the_gguf(reference):
    """Counting parameters: the GGUF holds exactly the HF checkpoint's numbers."""
    gguf, reader, hf, cfg = reference
    gguf_numel = sum(int(np.prod([int(d) for d in t.shape])) for t in reader.tensors)
    assert gguf_numel == sum(v.numel() for v in hf.values())
