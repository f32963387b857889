# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GLM-5 (`glm_moe_dsa`) from llama.cpp's `glm-dsa` GGUF files alone.

transformers cannot build a config or a tokenizer from a `glm-dsa` GGUF, so
without this a user also needs `--hf-config-path` and `--tokenizer` pointing to
the original checkpoint. This module reads the GGUF metadata written by
llama.cpp's `convert_hf_to_gguf.py` (`GlmMoeDsaModel`) and builds:

- the `GlmMoeDsaConfig` (MLA ranks and head dims, the DSA indexer, experts,
  leading dense blocks, the MTP/nextn blocks, RoPE);
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


def config_from_gguf(path: str | os.PathLike):
    """A `GlmMoeDsaConfig` built from the `glm-dsa.*` metadata of a GGUF."""
    from transformers import GlmMoeDsaConfig

    first = first_file(path)
    r = open_reader(first)
    arch = field(r, "general.architecture")
    if arch != GGUF_ARCH:
        raise GGUFError(f"{first}: architecture is {arch!r}, not {GGUF_ARCH!r}")

    def a(key, default=None):
        return field(r, f"{arch}.{key}", default)

    n_nextn = a("nextn_predict_layers", 0)
    n_layers = a("block_count") - n_nextn
    n_dense = a("leading_dense_block_count")
    kv_lora = a("attention.kv_lora_rank")
    rope_dim = a("rope.dimension_count")
    qk_head = a("attention.key_length_mla")
    gating = a("expert_gating_func")
    if gating != 2:  # gguf.ExpertGatingFuncType.SIGMOID
        raise GGUFError(f"{first}: {arch}.expert_gating_func is {gating}; GLM-5 routes with "
                        "sigmoid (2)")
    if a("attention.key_length") != kv_lora + rope_dim:
        raise GGUFError(f"{first}: {arch}.attention.key_length is "
                        f"{a('attention.key_length')}, expected kv_lora_rank + rope dims "
                        f"= {kv_lora + rope_dim}")
    rope = {"rope_type": "default", "rope_theta": _decimal(a("rope.freq_base"))}
    scaling = field(r, f"{arch}.rope.scaling.type", "none", required=False)
    if scaling == "yarn":
        rope = {
            "rope_type": "yarn",
            "rope_theta": rope["rope_theta"],
            "factor": _decimal(a("rope.scaling.factor")),
            "original_max_position_embeddings": a("rope.scaling.original_context_length"),
        }
    elif scaling != "none":
        raise GGUFError(f"{first}: {arch}.rope.scaling.type {scaling!r} is not supported")
    indexer_types = field(r, f"{arch}.attention.indexer.types", required=False)
    kwargs = {}
    if indexer_types is not None:
        # llama.cpp writes True for a layer that runs its own indexer ("full")
        kwargs["index_topk_pattern"] = "".join("F" if t else "S"
                                               for t in indexer_types[:n_layers])
        kwargs["indexer_types"] = ["full" if t else "shared" for t in indexer_types[:n_layers]]
    tok = {}
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"),
                      ("pad_token_id", "padding")):
        tok[key] = field(r, f"tokenizer.ggml.{name}_token_id", required=False)
    config = GlmMoeDsaConfig(
        vocab_size=field(r, f"{arch}.vocab_size", required=False)
        or len(field(r, "tokenizer.ggml.tokens")),
        hidden_size=a("embedding_length"),
        intermediate_size=a("feed_forward_length"),
        moe_intermediate_size=a("expert_feed_forward_length"),
        num_hidden_layers=n_layers,
        num_attention_heads=a("attention.head_count"),
        num_key_value_heads=a("attention.head_count"),
        n_shared_experts=a("expert_shared_count"),
        n_routed_experts=a("expert_count"),
        routed_scaling_factor=_decimal(a("expert_weights_scale")),
        kv_lora_rank=kv_lora,
        q_lora_rank=a("attention.q_lora_rank"),
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=qk_head - rope_dim,
        v_head_dim=a("attention.value_length_mla"),
        n_group=a("expert_group_count", 1),
        topk_group=a("expert_group_used_count", 1),
        num_experts_per_tok=a("expert_used_count"),
        norm_topk_prob=bool(a("expert_weights_norm", False)),
        max_position_embeddings=a("context_length"),
        rms_norm_eps=_decimal(a("attention.layer_norm_rms_epsilon")),
        rope_parameters=rope,
        first_k_dense_replace=n_dense,
        mlp_layer_types=["dense"] * n_dense + ["sparse"] * (n_layers - n_dense),
        index_topk=a("attention.indexer.top_k"),
        index_head_dim=a("attention.indexer.key_length"),
        index_n_heads=a("attention.indexer.head_count"),
        tie_word_embeddings=not any(t.name == "output.weight" for t in r.tensors),
        architectures=["GlmMoeDsaForCausalLM"],
        # GLM-5's weights are bf16; vLLM's dtype "auto" starts from this
        dtype="bfloat16",
        **{k: v for k, v in tok.items() if v is not None},
        **kwargs,
    )
    # Fields GLM-5's config.json carries that the GlmMoeDsaConfig class does not
    # declare; vLLM reads them (router bias, indexer RoPE layout, MTP blocks).
    config.update({
        "num_nextn_predict_layers": n_nextn,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        # llama.cpp's glm-dsa graph applies the indexer's RoPE interleaved, as
        # transformers' GlmMoeDsa indexer does
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
    types = field(r, "tokenizer.ggml.token_type")
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
