# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GLM-5 (`glm_moe_dsa`) from llama.cpp's `glm-dsa` GGUF files alone: the config.

transformers cannot build a config from a `glm-dsa` GGUF, so without this a user
also needs `--hf-config-path` pointing to the original checkpoint. This module
reads the GGUF metadata written by llama.cpp's `convert_hf_to_gguf.py`
(`GlmMoeDsaModel`) and builds the `GlmMoeDsaConfig` (MLA ranks and head dims, the
DSA indexer and its per-layer schedule of GLM-5.2's IndexShare, experts, leading
dense blocks, the MTP/nextn blocks, RoPE), reading every key as llama.cpp's
glm-dsa loader does: a key it treats as optional takes its default.
"""

import os
from functools import cache
from pathlib import Path

from vllm.logger import init_logger

from .files import first_file
from .reader import GGUFError, check_value, field, open_gguf

logger = init_logger(__name__)

GGUF_ARCH = "glm-dsa"
MODEL_TYPE = "glm_moe_dsa"


def as_decimal(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not
    9.999999747378752e-06): float32 carries 7 significant digits."""
    return float(f"{x:.7g}")


# Plausibility bounds of a file's counts, before anything is sized by them: far
# above any GLM-5 (78 + 1 blocks, 64 heads, 256 experts, hidden 6144, 1M context)
_MAX_BLOCKS = 1024
_MAX_HEADS = 1024
_MAX_EXPERTS = 8192
_MAX_DIM = 1 << 20
MAX_CONTEXT = 1 << 27


def architecture(path: str | os.PathLike) -> str | None:
    """`general.architecture` of a GGUF file, or None if it cannot be read."""
    try:
        arch = field(open_gguf(path), "general.architecture")
    except (GGUFError, UnicodeDecodeError):
        return None
    return arch if isinstance(arch, str) else None


def is_glm_dsa_gguf(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_file() and _cached_architecture(str(p.resolve())) == GGUF_ARCH


@cache
def _cached_architecture(path: str) -> str | None:
    return architecture(path)


# llama.cpp's glm-dsa indexer schedule for a file without
# `attention.indexer.types` (src/models/glm-dsa.cpp, load_arch_hparams): every
# layer "full" below a 1M-token context (GLM-5, GLM-5.1), else GLM-5.2's pattern
# (GLM_5_2_DEFAULT_INDEXER_TYPES): layers 0 and 1, then every fourth layer from 2
# on, "shared" from layer 78 on (the array's remaining zeros).
_GLM_5_2_MIN_CONTEXT = 1048576


def _glm_5_2_default_full(layer: int) -> bool:
    return layer < 2 or (layer < 78 and (layer - 2) % 4 == 0)


# llama.cpp's expert gating functions (llama_expert_gating_func_type) vLLM's
# DeepseekV2 MoE routes with, by its scoring_func name; NONE (0) is glm-dsa's
# default, sigmoid. SOFTMAX_WEIGHT (3) and SQRT_SOFTPLUS (4) have no equivalent
# in vLLM's grouped top-k router.
_SCORING_FUNCS = {0: "sigmoid", 1: "softmax", 2: "sigmoid"}
# llama.cpp's RoPE scaling types (LLAMA_ROPE_SCALING_TYPES); others are refused.
_ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")

_REQUIRED = object()


class _Hparams:
    """`glm-dsa.*` metadata read the way llama.cpp's loader reads it
    (`llama_model_loader::get_key`, `get_key_or_arr`): a key llama.cpp requires
    is required here, an optional one takes llama.cpp's default."""

    def __init__(self, reader, path: Path):
        self.reader, self.path = reader, path

    def get(self, key: str, default=_REQUIRED, kind=int, lo=0, hi=None, above=None):
        """glm-dsa.<key> (`field`): of `kind` (int by default, >= 0) within
        [lo, hi]; `kind` None: unchecked."""
        required = default is _REQUIRED
        return field(self.reader, f"{GGUF_ARCH}.{key}", None if required else default,
                     required=required, kind=kind, lo=lo if kind in (int, float) else None,
                     hi=hi, above=above)

    def per_layer(self, key: str, n: int, default=_REQUIRED, lo=0, hi=None):
        """A key llama.cpp reads with get_key_or_arr: one integer, or one per
        block. glm-dsa's graph uses block 0's (`hparams.n_ff()`, `n_head()`,
        `n_ff_exp()`, `n_expert_used()`) for every layer, and so does vLLM."""
        value = self.get(key, default, kind=None)
        if not isinstance(value, list):
            return check_value(self.path, f"{GGUF_ARCH}.{key}", value, int, lo, hi)
        check_value(self.path, f"{GGUF_ARCH}.{key}", value, [int], lo, hi)
        if len(value) != n:
            raise GGUFError(f"{self.path}: '{GGUF_ARCH}.{key}' has {len(value)} entries, "
                            f"llama.cpp expects one per block ({n})")
        if len(set(value)) > 1:
            logger.warning_once("%s: '%s.%s' differs per block (%s); llama.cpp's glm-dsa "
                                "and vLLM use block 0's value, %s, for every layer",
                                self.path, GGUF_ARCH, key, value, value[0])
        return value[0]


def indexer_schedule(reader, path: str | os.PathLike) -> list[bool]:
    """Which main-model layers run the DSA indexer ("full", True) and which reuse
    the top-k of the full layer before them ("shared", False), as llama.cpp's
    glm-dsa loader reads `glm-dsa.attention.indexer.types` (a bool per layer, or
    one value for all; its default depends on the context length)."""
    hp = _Hparams(reader, Path(path))
    n_blocks = hp.get("block_count", lo=1, hi=_MAX_BLOCKS)
    n_layers = n_blocks - hp.get("nextn_predict_layers", 0, hi=n_blocks - 1)
    types = hp.get("attention.indexer.types", None, kind=None)
    if types is not None:
        check_value(path, f"{GGUF_ARCH}.attention.indexer.types", types,
                    [bool] if isinstance(types, list) else bool)
    if types is None:
        if hp.get("context_length", lo=1, hi=MAX_CONTEXT) < _GLM_5_2_MIN_CONTEXT:
            full = [True] * n_layers
        else:
            full = [_glm_5_2_default_full(i) for i in range(n_layers)]
    elif isinstance(types, list):
        if len(types) != n_layers:
            raise GGUFError(f"{path}: '{GGUF_ARCH}.attention.indexer.types' has {len(types)} "
                            f"entries, llama.cpp expects one per main-model layer ({n_layers})")
        full = [bool(t) for t in types]
    else:
        full = [bool(types)] * n_layers
    if full and not full[0]:
        raise GGUFError(f"{path}: '{GGUF_ARCH}.attention.indexer.types' makes layer 0 "
                        "\"shared\", but no full layer precedes it to share the top-k of")
    return full


def config_from_gguf(path: str | os.PathLike):
    """A `GlmMoeDsaConfig` built from the `glm-dsa.*` metadata of a GGUF.

    Keys and defaults follow llama.cpp (src/llama-model.cpp load_hparams,
    src/models/glm-dsa.cpp load_arch_hparams): what llama.cpp requires is
    required, an optional key takes llama.cpp's default, and what llama.cpp
    refuses (or vLLM cannot run) is a `GGUFError` naming the key.
    """
    from transformers import GlmMoeDsaConfig

    first = first_file(path)
    r = open_gguf(first)
    arch = field(r, "general.architecture", kind=str)
    if arch != GGUF_ARCH:
        raise GGUFError(f"{first}: architecture is {arch!r}, not {GGUF_ARCH!r}")
    hp = _Hparams(r, first)

    def refuse(key: str, why: str):
        raise GGUFError(f"{first}: '{arch}.{key}' {why}")

    # general hyperparameters (llama_model_base::load_hparams), each within bounds
    # before anything is sized by it
    n_ctx = hp.get("context_length", lo=1, hi=MAX_CONTEXT)
    hidden = hp.get("embedding_length", lo=1, hi=_MAX_DIM)
    n_blocks = hp.get("block_count", lo=1, hi=_MAX_BLOCKS)
    n_nextn = hp.get("nextn_predict_layers", 0, hi=n_blocks - 1)
    n_layers = n_blocks - n_nextn
    n_expert = hp.get("expert_count", 0, hi=_MAX_EXPERTS)
    n_expert_used = hp.per_layer("expert_used_count", n_blocks, 0, hi=_MAX_EXPERTS)
    n_groups = hp.get("expert_group_count", 0, hi=max(n_expert, 1))
    n_groups_used = hp.get("expert_group_used_count", 0, hi=max(n_groups, 1))
    n_ff = hp.per_layer("feed_forward_length", n_blocks, 0, hi=_MAX_DIM)
    n_head = hp.per_layer("attention.head_count", n_blocks, 0, hi=_MAX_HEADS)
    # MLA: one latent KV head
    hp.per_layer("attention.head_count_kv", n_blocks, n_head, hi=_MAX_HEADS)
    # key_length (kv_lora_rank + rope dims in a converted file) only serves as
    # llama.cpp's default for the RoPE dimensions
    head_k = hp.get("attention.key_length", hidden // n_head if n_head else 0, hi=_MAX_DIM)
    rope_dim = hp.get("rope.dimension_count", head_k, hi=_MAX_DIM)

    # glm-dsa's own (llama_model_glm_dsa::load_arch_hparams)
    n_ff_exp = hp.per_layer("expert_feed_forward_length", n_blocks, lo=1, hi=_MAX_DIM)
    rms_eps = hp.get("attention.layer_norm_rms_epsilon", kind=float, lo=None, hi=0.1,
                     above=0)
    n_shared = hp.get("expert_shared_count", hi=_MAX_EXPERTS)
    n_dense = hp.get("leading_dense_block_count", 0, hi=n_layers)
    weights_scale = hp.get("expert_weights_scale", 0.0, kind=float)
    weights_norm = hp.get("expert_weights_norm", False, kind=bool)
    q_lora = hp.get("attention.q_lora_rank", lo=1, hi=_MAX_DIM)
    kv_lora = hp.get("attention.kv_lora_rank", lo=1, hi=_MAX_DIM)
    key_mla = hp.get("attention.key_length_mla", 0, hi=_MAX_DIM)
    value_mla = hp.get("attention.value_length_mla", 0, hi=_MAX_DIM)
    index_heads = hp.get("attention.indexer.head_count", lo=1, hi=_MAX_HEADS)
    index_dim = hp.get("attention.indexer.key_length", lo=1, hi=_MAX_DIM)
    index_topk = hp.get("attention.indexer.top_k", lo=1, hi=n_ctx)
    gating = hp.get("expert_gating_func", 0)
    full = indexer_schedule(r, first)

    # what llama.cpp's glm-dsa refuses, and what vLLM cannot run
    if not n_head:
        refuse("attention.head_count", "is 0 or missing: llama.cpp then expects attention "
               "tensors without heads")
    if not (key_mla and value_mla):
        refuse("attention.key_length_mla", f"is {key_mla} and value_length_mla {value_mla}: "
               "llama.cpp's glm-dsa requires MLA (both set)")
    if not 0 < rope_dim < key_mla or rope_dim > index_dim:
        refuse("rope.dimension_count", f"is {rope_dim}; the MLA key has {key_mla} dims and "
               f"the indexer key {index_dim}")
    if n_dense < n_blocks and not (n_expert > 0 and 0 < n_expert_used <= n_expert):
        refuse("expert_count", f"is {n_expert} with {n_expert_used} used; MoE blocks need "
               "experts (llama.cpp: n_expert must be > 0)")
    if n_groups > 1 and (n_expert % n_groups or not 0 < n_groups_used < n_groups):
        refuse("expert_group_count", f"is {n_groups} with {n_groups_used} used for {n_expert} "
               "experts (llama.cpp: groups must divide the experts, 0 < used < groups)")
    if gating not in _SCORING_FUNCS:
        refuse("expert_gating_func", f"is {gating}; vLLM's DeepseekV2 MoE routes with "
               "sigmoid (2) or softmax (1)")

    theta = hp.get("rope.freq_base", 10000.0, kind=float, lo=None, above=0)
    rope = {"rope_type": "default", "rope_theta": as_decimal(theta)}
    scaling = hp.get("rope.scaling.type", "linear", kind=str)
    factor = hp.get("rope.scaling.factor", None, kind=float)
    if factor is None:
        # llama.cpp's older name
        factor = hp.get("rope.scale_linear", 0.0, kind=float)
    factor = as_decimal(factor) if factor else 1.0
    if scaling not in _ROPE_SCALING_TYPES:
        refuse("rope.scaling.type", f"is {scaling!r}, which llama.cpp does not know")
    if hp.get("rope.scaling.attn_factor", 1.0, kind=float) != 1.0:
        refuse("rope.scaling.attn_factor", "is not 1; vLLM's DeepseekV2 attention has no such "
               "RoPE scale")
    if scaling == "yarn":
        rope.update(rope_type="yarn", factor=factor, original_max_position_embeddings=hp.get(
            "rope.scaling.original_context_length", n_ctx, lo=1, hi=MAX_CONTEXT))
    elif scaling != "none" and factor != 1.0:
        # vLLM's DeepseekV2 attention turns every rope_type but "default" into YaRN
        refuse("rope.scaling.type", f"is {scaling!r} with factor {factor:g}; vLLM's "
               "DeepseekV2 attention runs no such RoPE scaling")

    tokens = vocabulary(r, first)
    tok = {"bos_token_id": token_id(r, first, "bos", len(tokens)),
           # without an eos, generation would never stop at the end of a text
           "eos_token_id": token_id(r, first, "eos", len(tokens), required=True),
           "pad_token_id": token_id(r, first, "padding", len(tokens))}
    types = ["full" if f else "shared" for f in full]
    config = GlmMoeDsaConfig(
        # llama.cpp's n_vocab is the token list's length (<arch>.vocab_size aside)
        vocab_size=len(tokens),
        hidden_size=hidden,
        intermediate_size=n_ff,
        moe_intermediate_size=n_ff_exp,
        num_hidden_layers=n_layers,
        num_attention_heads=n_head,
        num_key_value_heads=n_head,
        n_shared_experts=n_shared,
        n_routed_experts=n_expert,
        # llama.cpp scales the routing weights only by a scale set and not 1
        routed_scaling_factor=as_decimal(weights_scale) if weights_scale else 1.0,
        kv_lora_rank=kv_lora,
        q_lora_rank=q_lora,
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=key_mla - rope_dim,
        v_head_dim=value_mla,
        # llama.cpp groups experts only for more than one group
        n_group=n_groups if n_groups > 1 else 1,
        topk_group=n_groups_used if n_groups > 1 else 1,
        num_experts_per_tok=n_expert_used,
        norm_topk_prob=bool(weights_norm),
        max_position_embeddings=n_ctx,
        rms_norm_eps=as_decimal(rms_eps),
        rope_parameters=rope,
        first_k_dense_replace=n_dense,
        mlp_layer_types=["dense" if i < n_dense else "sparse" for i in range(n_layers)],
        index_topk=index_topk,
        index_head_dim=index_dim,
        index_n_heads=index_heads,
        # transformers' per-layer schedule, and vLLM's (index_topk_pattern below)
        indexer_types=types,
        tie_word_embeddings=not any(t.name == "output.weight" for t in r.tensors),
        architectures=["GlmMoeDsaForCausalLM"],
        # GLM-5's weights are bf16; vLLM's dtype "auto" starts from this
        dtype="bfloat16",
        **{k: v for k, v in tok.items() if v is not None},
    )
    # Fields GLM-5.x's config.json carries that the GlmMoeDsaConfig class does not
    # declare; vLLM reads them (router bias and dtype, indexer schedule and RoPE
    # layout, MTP blocks).
    config.update({
        "num_nextn_predict_layers": n_nextn,
        # every MoE layer has a routing bias (llama.cpp's optional exp_probs_b;
        # the loader fills an absent one with zeros, which routes the same)
        "topk_method": "noaux_tc",
        "scoring_func": _SCORING_FUNCS[gating],
        # llama.cpp computes router logits in fp32, as GLM-5.2/5.3 configs ask
        "moe_router_dtype": "float32",
        # "F" runs the indexer, "S" reuses the previous full layer's top-k
        # (vLLM's DeepseekV2 attention; transformers maps it to indexer_types)
        "index_topk_pattern": "".join("F" if f else "S" for f in full),
        # the indexer's RoPE: interleaved pairs over the first qk_rope_head_dim
        # dims of each head, as transformers' GlmMoeDsaIndexer applies it (and
        # llama.cpp's glm-dsa graph, LLAMA_ROPE_TYPE_NORM)
        "indexer_rope_interleave": True,
    })
    if not all(full):
        # GLM-5.2/5.3, the IndexShare models, also share the MTP layer's top-k
        # across draft steps (their config.json; vLLM's MTP proposer reads it from
        # the draft's config). llama.cpp has no key for it: its MTP graph runs
        # dense attention.
        config.update({"index_share_for_mtp_iteration": True})
    return config


def vocabulary(reader, path) -> list[str]:
    """`tokenizer.ggml.tokens`: the token texts, one per embedding row."""
    return field(reader, "tokenizer.ggml.tokens", kind=[str])


def token_id(reader, path, name: str, n_tokens: int, *, required: bool = False) -> int | None:
    """`tokenizer.ggml.<name>_token_id`, an id among the file's `n_tokens` tokens."""
    key = f"tokenizer.ggml.{name}_token_id"
    return field(reader, key, required=required, kind=int, lo=0, hi=n_tokens - 1)
