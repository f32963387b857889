# SPDX-License-Identifier: Apache-2.0
"""Tiny random GLM-5 and GLM-5.2 (`glm_moe_dsa`) checkpoints with GLM-5's attention head dims.

MLA: kv_lora 512, rope 64, nope 192, v 256; the DSA indexer: 32 heads x 128.
Few layers (dense first, then MoE), few experts, small hidden size and vocab.
`index_topk` is small so that prompts of a few hundred tokens exceed it and the
indexer's selection matters. Random weights from a fixed seed; nothing is
downloaded.
"""

import json
from pathlib import Path

import torch

TINY_GLM5 = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 2048,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 256,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "qk_head_dim": 256,
    "v_head_dim": 256,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    # vLLM 0.23 builds the router bias only for these (GLM-5 checkpoints have it)
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    # one MTP block, stored as model.layers.4.* as in GLM-5 checkpoints
    "num_nextn_predict_layers": 1,
    # the indexer applies RoPE interleaved (GLM-5's config.json, transformers' GlmMoeDsa)
    "indexer_rope_interleave": True,
    "index_topk": 128,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "indexer_types": ["full"] * 4,
    "layer_types": ["deepseek_sparse_attention"] * 4,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


# GLM-5.2/5.3 (same architecture): IndexShare, where "shared" layers reuse the
# previous "full" layer's top-k and carry no indexer weights; rope_theta 8e6, a
# 1M-token context, the router in fp32. Here 6 layers (2 dense, 4 MoE) on a
# schedule that is neither llama.cpp's default for a 1M context (GLM-5.2's,
# "FFFSSS" on 6 layers) nor all full, with a dense and a MoE shared layer; the
# MTP block copies the last layer, a full one (GLM-5.2's MTP layer has an indexer).
GLM52_INDEXER_TYPES = ["full", "shared", "full", "shared", "shared", "full"]
TINY_GLM52 = {
    **TINY_GLM5,
    "num_hidden_layers": 6,
    "first_k_dense_replace": 2,
    "mlp_layer_types": ["dense"] * 2 + ["sparse"] * 4,
    "indexer_types": GLM52_INDEXER_TYPES,
    # vLLM's DeepseekV2 reads the schedule from index_topk_pattern (else
    # index_topk_freq/index_skip_topk_offset, which cannot express this one)
    "index_topk_pattern": "".join("F" if t == "full" else "S" for t in GLM52_INDEXER_TYPES),
    "index_share_for_mtp_iteration": True,
    "layer_types": ["deepseek_sparse_attention"] * 6,
    "max_position_embeddings": 1048576,
    "rope_parameters": {"rope_theta": 8000000.0, "rope_type": "default"},
    "moe_router_dtype": "float32",
}


def make_tiny_glm5(path: Path, seed: int = 0, **overrides) -> Path:
    """Write a random tiny GLM-5 checkpoint (config.json + safetensors) to `path`."""
    return _make_tiny(path, {**TINY_GLM5, **overrides}, seed)


def make_tiny_glm52(path: Path, seed: int = 0, **overrides) -> Path:
    """Write a random tiny GLM-5.2 checkpoint (IndexShare: no indexer weights on
    shared layers) to `path`."""
    return _make_tiny(path, {**TINY_GLM52, **overrides}, seed, biases=True)


def copy_shared_indexers(src: Path, out: Path) -> Path:
    """A copy of a GLM-5.2 checkpoint whose shared layers carry indexer weights,
    those of the full layer before them, as some published GLM-5.2 GGUFs do."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = Path(out)
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    full = 0
    for i, kind in enumerate(cfg["indexer_types"]):
        if kind == "full":
            full = i
            continue
        prefix = f"model.layers.{full}.self_attn.indexer."
        for name in [n for n in tensors if n.startswith(prefix)]:
            copy = f"model.layers.{i}.self_attn.indexer." + name[len(prefix):]
            tensors[copy] = tensors[name].clone()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _make_tiny(path: Path, cfg: dict, seed: int, biases: bool = False) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    config = AutoConfig.from_pretrained(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            elif name == "lm_head.weight":
                # peaked next-token distributions (logit std ~4), so that greedy
                # comparisons are not decided by near-ties of a flat distribution
                p.normal_(0.0, 4.0 / p.shape[-1] ** 0.5)
            elif p.dim() > 1:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5)
            else:
                p.zero_()
        if biases:
            # nonzero routing biases (a buffer) and indexer key-norm biases, so
            # that both take part in what the model computes
            gen = torch.Generator().manual_seed(seed + 2)
            for name, t in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith(("e_score_correction_bias", "k_norm.bias")):
                    t.copy_(torch.randn(t.shape, generator=gen) * 0.05)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    add_mtp_block(path / "model.safetensors", cfg, seed)
    # save_pretrained rewrites config.json: keep the fields vLLM reads verbatim.
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def add_mtp_block(file: Path, cfg: dict, seed: int) -> None:
    """Append GLM-5's MTP (nextn) block, `model.layers.<N>.*`: a MoE decoder layer
    plus eh_proj, enorm, hnorm and shared_head.{norm,head}. transformers' model
    has no such module, so the tensors are made here with the shapes of the last
    decoder layer and fresh random values."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    n, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    gen = torch.Generator().manual_seed(seed + 1)
    last = f"model.layers.{n - 1}."
    for name, t in list(tensors.items()):
        if name.startswith(last):
            new = torch.randn(t.shape, generator=gen) * (0.5 / t.shape[-1] ** 0.5)
            if "norm" in name and name.endswith("weight"):
                new = torch.ones(t.shape)
            elif t.dim() == 1:
                new = torch.zeros(t.shape)
            tensors[f"model.layers.{n}." + name[len(last):]] = new.to(t.dtype)
    mtp = f"model.layers.{n}."
    tensors[mtp + "eh_proj.weight"] = (torch.randn(hidden, 2 * hidden, generator=gen)
                                       * (0.5 / (2 * hidden) ** 0.5)).bfloat16()
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[mtp + norm + ".weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    tensors[mtp + "shared_head.head.weight"] = (torch.randn(cfg["vocab_size"], hidden, generator=gen)
                                                * (4.0 / hidden ** 0.5)).bfloat16()
    save_file(tensors, file, metadata={"format": "pt"})
