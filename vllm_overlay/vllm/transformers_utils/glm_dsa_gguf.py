# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GLM-5 (`glm_moe_dsa`) from llama.cpp's `glm-dsa` GGUF files alone.

transformers cannot build a config or a tokenizer from a `glm-dsa` GGUF, so
without this a user also needs `--hf-config-path` and `--tokenizer` pointing to
the original checkpoint. This module reads the GGUF metadata written by
llama.cpp's `convert_hf_to_gguf.py` (`GlmMoeDsaModel`) and builds:

- the `GlmMoeDsaConfig` (MLA ranks and head dims, the DSA indexer and its
  per-layer schedule of GLM-5.2's IndexShare, experts, leading dense blocks, the
  MTP/nextn blocks, RoPE), reading every key as llama.cpp's glm-dsa loader does:
  a key it treats as optional takes its default;
- the tokenizer (`tokenizer.ggml.*`: byte-level BPE with GLM's pre-tokenizer);
- the list of files of a split GGUF (`*-00001-of-0000N.gguf`, llama.cpp's
  `gguf-split` layout), checked part by part.
"""

import os
from functools import cache
from pathlib import Path

import regex as re

from vllm.logger import init_logger

logger = init_logger(__name__)

GGUF_ARCH = "glm-dsa"
MODEL_TYPE = "glm_moe_dsa"

_SPLIT_RE = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")  # gguf-split

# llama.cpp's pre-tokenizer regex for `tokenizer.ggml.pre` "glm4"/"glm5"
# (LLAMA_VOCAB_PRE_TYPE_CHATGLM4 in src/llama-vocab.cpp), which is the split
# regex of GLM-4.5/GLM-5's tokenizer.json; llama.cpp also sets ignore_merges.
_GLM_PRE_TOKENIZER_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GLM_PRE_TOKENIZERS = ("glm4", "glm5")

# gguf TokenType values (gguf.constants.TokenType)
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


class GGUFError(ValueError):
    """A GGUF file that cannot be used as it is; the message names the problem."""


def open_reader(path: str | os.PathLike):
    """A `gguf.GGUFReader` over `path`, refusing files that are not whole."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises whatever numpy/struct raise
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise GGUFError(
                f"{path}: truncated: tensor {t.name!r} ends at byte "
                f"{t.data_offset + t.n_bytes}, the file has {size}"
            )
    return reader


def _decimal(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not
    9.999999747378752e-06): float32 carries 7 significant digits."""
    return float(f"{x:.7g}")


def field(reader, key: str, default=None, *, required: bool = True):
    f = reader.fields.get(key)
    if f is None:
        if required and default is None:
            raise GGUFError(f"{reader.data.filename}: metadata key {key!r} is missing")
        return default
    return f.contents()


def architecture(path: str | os.PathLike) -> str | None:
    """`general.architecture` of a GGUF file, or None if it cannot be read."""
    try:
        return field(open_reader(path), "general.architecture")
    except GGUFError:
        return None


def is_glm_dsa_gguf(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_file() and _cached_architecture(str(p.resolve())) == GGUF_ARCH


@cache
def _cached_architecture(path: str) -> str | None:
    return architecture(path)


def resolve_gguf_dir(model: str) -> str:
    """A directory that holds one GGUF model (single file or one split set) is
    that model's first file; anything else is returned unchanged."""
    p = Path(model)
    if not p.is_dir() or (p / "config.json").exists():
        return model
    ggufs = sorted(f for f in p.glob("*.gguf") if not f.name.startswith("mmproj"))
    if not ggufs:
        return model
    firsts = [f for f in ggufs if (m := _SPLIT_RE.match(f.name)) is None or int(m["no"]) == 1]
    if len(firsts) != 1:
        raise GGUFError(
            f"{p}: holds {len(firsts)} GGUF models "
            f"({', '.join(f.name for f in firsts)}); pass one file"
        )
    return str(firsts[0])


def _part_paths(path: Path) -> list[Path]:
    """The file names of the model `path` belongs to, by its name alone."""
    m = _SPLIT_RE.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    return [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf")
            for i in range(1, count + 1)]


def split_files(path: str | os.PathLike) -> list[Path]:
    """All files of the GGUF model that `path` belongs to, first part first.

    A single file is returned alone. For a split set (`-NNNNN-of-MMMMM.gguf`,
    any part may be given) every part must exist and carry matching
    `split.no`/`split.count` metadata, and the parts together must hold the
    `split.tensors.count` tensors the first part announces.
    """
    path = Path(path)
    if _SPLIT_RE.match(path.name) is None:
        return [path]
    parts = _part_paths(path)
    count = len(parts)
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise GGUFError(
            f"split GGUF {parts[0].name}: {len(missing)} of {count} parts missing "
            f"in {path.parent}: {', '.join(missing)}"
        )
    n_tensors = 0
    total = None
    for i, p in enumerate(parts):
        reader = open_reader(p)
        no, cnt = field(reader, "split.no", -1, required=False), field(
            reader, "split.count", -1, required=False)
        if (no, cnt) != (i, count):
            raise GGUFError(
                f"{p}: split metadata says part {no + 1} of {cnt}, "
                f"the file name says part {i + 1} of {count}"
            )
        if i == 0:
            total = field(reader, "split.tensors.count")
        n_tensors += len(reader.tensors)
    if n_tensors != total:
        raise GGUFError(
            f"split GGUF {parts[0].name}: the parts hold {n_tensors} tensors, "
            f"the first part announces {total}"
        )
    return parts


def first_file(path: str | os.PathLike) -> Path:
    """The part holding the metadata; the loader checks the whole set
    (`split_files`), so config and tokenizer open this part only."""
    return _part_paths(Path(path))[0]


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

    def get(self, key: str, default=_REQUIRED):
        f = self.reader.fields.get(f"{GGUF_ARCH}.{key}")
        if f is None:
            if default is _REQUIRED:
                raise GGUFError(f"{self.path}: metadata key '{GGUF_ARCH}.{key}' is missing")
            return default
        return f.contents()

    def per_layer(self, key: str, n: int, default=_REQUIRED):
        """A key llama.cpp reads with get_key_or_arr: one value, or one per
        block. glm-dsa's graph uses block 0's (`hparams.n_ff()`, `n_head()`,
        `n_ff_exp()`, `n_expert_used()`) for every layer, and so does vLLM."""
        value = self.get(key, default)
        if not isinstance(value, list):
            return value
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
    n_layers = hp.get("block_count") - hp.get("nextn_predict_layers", 0)
    types = hp.get("attention.indexer.types", None)
    if types is None:
        if hp.get("context_length") < _GLM_5_2_MIN_CONTEXT:
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
    r = open_reader(first)
    arch = field(r, "general.architecture")
    if arch != GGUF_ARCH:
        raise GGUFError(f"{first}: architecture is {arch!r}, not {GGUF_ARCH!r}")
    hp = _Hparams(r, first)

    def refuse(key: str, why: str):
        raise GGUFError(f"{first}: '{arch}.{key}' {why}")

    # general hyperparameters (llama_model_base::load_hparams)
    n_ctx = hp.get("context_length")
    hidden = hp.get("embedding_length")
    n_blocks = hp.get("block_count")
    n_nextn = hp.get("nextn_predict_layers", 0)
    if not 0 < n_blocks or not 0 <= n_nextn < n_blocks:
        refuse("nextn_predict_layers", f"is {n_nextn} of {n_blocks} blocks")
    n_layers = n_blocks - n_nextn
    n_expert = hp.get("expert_count", 0)
    n_expert_used = hp.per_layer("expert_used_count", n_blocks, 0)
    n_groups = hp.get("expert_group_count", 0)
    n_groups_used = hp.get("expert_group_used_count", 0)
    n_ff = hp.per_layer("feed_forward_length", n_blocks, 0)
    n_head = hp.per_layer("attention.head_count", n_blocks, 0)
    hp.per_layer("attention.head_count_kv", n_blocks, n_head)  # MLA: one latent KV head
    # key_length (kv_lora_rank + rope dims in a converted file) only serves as
    # llama.cpp's default for the RoPE dimensions
    head_k = hp.get("attention.key_length", hidden // n_head if n_head else 0)
    rope_dim = hp.get("rope.dimension_count", head_k)

    # glm-dsa's own (llama_model_glm_dsa::load_arch_hparams)
    n_ff_exp = hp.per_layer("expert_feed_forward_length", n_blocks)
    rms_eps = hp.get("attention.layer_norm_rms_epsilon")
    n_shared = hp.get("expert_shared_count")
    n_dense = hp.get("leading_dense_block_count", 0)
    weights_scale = hp.get("expert_weights_scale", 0.0)
    weights_norm = hp.get("expert_weights_norm", False)
    q_lora = hp.get("attention.q_lora_rank")
    kv_lora = hp.get("attention.kv_lora_rank")
    key_mla = hp.get("attention.key_length_mla", 0)
    value_mla = hp.get("attention.value_length_mla", 0)
    index_heads = hp.get("attention.indexer.head_count")
    index_dim = hp.get("attention.indexer.key_length")
    index_topk = hp.get("attention.indexer.top_k")
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

    rope = {"rope_type": "default", "rope_theta": _decimal(hp.get("rope.freq_base", 10000.0))}
    scaling = hp.get("rope.scaling.type", "linear")
    factor = hp.get("rope.scaling.factor", None)
    if factor is None:
        factor = hp.get("rope.scale_linear", 0.0)  # llama.cpp's older name
    factor = _decimal(factor) if factor else 1.0
    if scaling not in _ROPE_SCALING_TYPES:
        refuse("rope.scaling.type", f"is {scaling!r}, which llama.cpp does not know")
    if hp.get("rope.scaling.attn_factor", 1.0) != 1.0:
        refuse("rope.scaling.attn_factor", "is not 1; vLLM's DeepseekV2 attention has no such "
               "RoPE scale")
    if scaling == "yarn":
        rope.update(rope_type="yarn", factor=factor, original_max_position_embeddings=hp.get(
            "rope.scaling.original_context_length", n_ctx))
    elif scaling != "none" and factor != 1.0:
        # vLLM's DeepseekV2 attention turns every rope_type but "default" into YaRN
        refuse("rope.scaling.type", f"is {scaling!r} with factor {factor:g}; vLLM's "
               "DeepseekV2 attention runs no such RoPE scaling")

    tok = {}
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"),
                      ("pad_token_id", "padding")):
        tok[key] = field(r, f"tokenizer.ggml.{name}_token_id", required=False)
    types = ["full" if f else "shared" for f in full]
    config = GlmMoeDsaConfig(
        # llama.cpp's n_vocab is the token list's length (<arch>.vocab_size aside)
        vocab_size=len(field(r, "tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=n_ff,
        moe_intermediate_size=n_ff_exp,
        num_hidden_layers=n_layers,
        num_attention_heads=n_head,
        num_key_value_heads=n_head,
        n_shared_experts=n_shared,
        n_routed_experts=n_expert,
        # llama.cpp scales the routing weights only by a scale set and not 1
        routed_scaling_factor=_decimal(weights_scale) if weights_scale else 1.0,
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
        rms_norm_eps=_decimal(rms_eps),
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
    return config


def tokenizer_from_gguf(path: str | os.PathLike, **kwargs):
    """GLM-5's byte-level BPE tokenizer from `tokenizer.ggml.*` metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    first = first_file(path)
    r = open_reader(first)
    model = field(r, "tokenizer.ggml.model")
    pre = field(r, "tokenizer.ggml.pre", "default", required=False)
    if model != "gpt2" or pre not in _GLM_PRE_TOKENIZERS:
        raise GGUFError(f"{first}: tokenizer {model!r} with pre-tokenizer {pre!r} is not "
                        f"GLM's (gpt2 with one of {_GLM_PRE_TOKENIZERS}); pass --tokenizer")
    tokens = field(r, "tokenizer.ggml.tokens")
    # optional in llama.cpp (every token then NORMAL): no special tokens
    types = field(r, "tokenizer.ggml.token_type", [], required=False)
    merges = [tuple(m.split(" ", 1)) for m in field(r, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError(f"{first}: tokenizer.ggml.tokens has duplicate entries")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_GLM_PRE_TOKENIZER_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, types)
                if ty in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)]
    tok.add_special_tokens(specials)

    def token(name):
        i = field(r, f"tokenizer.ggml.{name}_token_id", required=False)
        return tokens[i] if i is not None else None

    chat_template = field(r, "tokenizer.chat_template", required=False)
    init = {"tokenizer_object": tok, "eos_token": token("eos"), "pad_token": token("padding"),
            "unk_token": None, "bos_token": None, "clean_up_tokenization_spaces": False}
    if chat_template is not None:
        init["chat_template"] = chat_template
    for key in ("truncation_side", "padding_side", "model_max_length"):
        if key in kwargs:
            init[key] = kwargs[key]
    return PreTrainedTokenizerFast(**init)
