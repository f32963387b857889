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

import math
import os
from functools import cache, lru_cache
from pathlib import Path

import regex as re

from vllm.logger import init_logger
from vllm.transformers_utils.gguf_checked import GGUFError, GGUFFile

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
_TOKEN_TYPE_UNUSED = 5


def open_reader(path: str | os.PathLike) -> GGUFFile:
    """The GGUF file at `path`, refusing files that are not whole or consistent
    (`GGUFFile`: every count, length and offset bounded by the file, the tensor
    table checked as llama.cpp does); a file unchanged since it was last opened is
    not read again."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    stat = path.stat()
    return _open(str(path), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=16)
def _open(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def _decimal(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not
    9.999999747378752e-06): float32 carries 7 significant digits."""
    return float(f"{x:.7g}")


# Plausibility bounds of a file's counts, before anything is sized by them: far
# above any GLM-5 (78 + 1 blocks, 64 heads, 256 experts, hidden 6144, 1M context)
_MAX_BLOCKS = 1024
_MAX_HEADS = 1024
_MAX_EXPERTS = 8192
_MAX_DIM = 1 << 20
_MAX_CONTEXT = 1 << 27

# what a metadata value must be, as it is said in an error
_KINDS = {int: "an integer", float: "a finite number", bool: "a bool", str: "a string"}


def _is(value, kind) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))
    if kind is bool:
        # llama.cpp's converter writes bools; a 0/1 integer reads the same
        return isinstance(value, bool) or (isinstance(value, int) and value in (0, 1))
    return isinstance(value, kind)


def check_value(path, key: str, value, kind, lo=None, hi=None, *, above=None):
    """`value` of metadata `key`, if it is of `kind` (int, float, bool, str; a list
    of one: an array of them) and within [lo, hi] (and > above); otherwise a
    GGUFError naming the key, the file, what was found and what was expected."""
    many = isinstance(kind, list)
    item = kind[0] if many else kind
    expected = _KINDS[item] if not many else f"an array of {_KINDS[item].split(' ', 1)[1]}s"
    if above is not None:
        expected += f" above {above:g}"
    if lo is not None and hi is not None:
        expected += f" in {lo}..{hi}"
    elif lo is not None:
        expected += f" >= {lo}"
    elif hi is not None:
        expected += f" <= {hi}"
    values = value if many and isinstance(value, list) else [value]
    ok = (isinstance(value, list) == many and all(
        _is(v, item) and (lo is None or v >= lo) and (hi is None or v <= hi)
        and (above is None or v > above) for v in values))
    if not ok:
        found = repr(value) if not isinstance(value, list) else (
            f"an array of {len(value)}" + (f" ({value[:4]!r}...)" if value else ""))
        raise GGUFError(f"{path}: metadata key {key!r} is {found}, expected {expected}")
    return value


def field(reader, key: str, default=None, *, required: bool = True, kind=None, lo=None,
          hi=None, above=None):
    """Metadata `key` of a GGUF file (its default when absent and not required),
    checked with `check_value` when `kind` is given."""
    f = reader.fields.get(key)
    if f is None:
        if required and default is None:
            raise GGUFError(f"{reader.data.filename}: metadata key {key!r} is missing")
        return default
    value = f.contents()
    if kind is not None:
        check_value(reader.data.filename, key, value, kind, lo, hi, above=above)
    return value


def architecture(path: str | os.PathLike) -> str | None:
    """`general.architecture` of a GGUF file, or None if it cannot be read."""
    try:
        arch = field(open_reader(path), "general.architecture")
    except (GGUFError, UnicodeDecodeError):
        return None
    return arch if isinstance(arch, str) else None


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
    if not 1 <= int(m["no"]) <= count:
        raise GGUFError(f"{path}: the file name says part {int(m['no'])} of {count}, "
                        "which no split set has")
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
    names: dict[str, Path] = {}
    for i, p in enumerate(parts):
        reader = open_reader(p)
        no = field(reader, "split.no", -1, required=False, kind=int, lo=0)
        cnt = field(reader, "split.count", -1, required=False, kind=int, lo=1)
        if (no, cnt) != (i, count):
            raise GGUFError(
                f"{p}: split metadata says part {no + 1} of {cnt}, "
                f"the file name says part {i + 1} of {count}"
            )
        if i == 0:
            total = field(reader, "split.tensors.count", kind=int, lo=0)
        for t in reader.tensors:
            if (other := names.setdefault(t.name, p)) != p:
                raise GGUFError(f"{p}: tensor {t.name!r} is also in {other.name}; the parts "
                                "of a split set hold different tensors")
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
        if hp.get("context_length", lo=1, hi=_MAX_CONTEXT) < _GLM_5_2_MIN_CONTEXT:
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
    arch = field(r, "general.architecture", kind=str)
    if arch != GGUF_ARCH:
        raise GGUFError(f"{first}: architecture is {arch!r}, not {GGUF_ARCH!r}")
    hp = _Hparams(r, first)

    def refuse(key: str, why: str):
        raise GGUFError(f"{first}: '{arch}.{key}' {why}")

    # general hyperparameters (llama_model_base::load_hparams), each within bounds
    # before anything is sized by it
    n_ctx = hp.get("context_length", lo=1, hi=_MAX_CONTEXT)
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
    rope = {"rope_type": "default", "rope_theta": _decimal(theta)}
    scaling = hp.get("rope.scaling.type", "linear", kind=str)
    factor = hp.get("rope.scaling.factor", None, kind=float)
    if factor is None:
        # llama.cpp's older name
        factor = hp.get("rope.scale_linear", 0.0, kind=float)
    factor = _decimal(factor) if factor else 1.0
    if scaling not in _ROPE_SCALING_TYPES:
        refuse("rope.scaling.type", f"is {scaling!r}, which llama.cpp does not know")
    if hp.get("rope.scaling.attn_factor", 1.0, kind=float) != 1.0:
        refuse("rope.scaling.attn_factor", "is not 1; vLLM's DeepseekV2 attention has no such "
               "RoPE scale")
    if scaling == "yarn":
        rope.update(rope_type="yarn", factor=factor, original_max_position_embeddings=hp.get(
            "rope.scaling.original_context_length", n_ctx, lo=1, hi=_MAX_CONTEXT))
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


def tokenizer_from_gguf(path: str | os.PathLike, **kwargs):
    """GLM-5's byte-level BPE tokenizer from `tokenizer.ggml.*` metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    first = first_file(path)
    r = open_reader(first)
    model = field(r, "tokenizer.ggml.model", kind=str)
    pre = field(r, "tokenizer.ggml.pre", "default", required=False, kind=str)
    if model != "gpt2" or pre not in _GLM_PRE_TOKENIZERS:
        raise GGUFError(f"{first}: tokenizer {model!r} with pre-tokenizer {pre!r} is not "
                        f"GLM's (gpt2 with one of {_GLM_PRE_TOKENIZERS}); pass --tokenizer")
    tokens = vocabulary(r, first)
    # optional in llama.cpp (every token then NORMAL): no special tokens
    types = field(r, "tokenizer.ggml.token_type", [], required=False, kind=[int])
    if types and len(types) != len(tokens):
        raise GGUFError(f"{first}: metadata key 'tokenizer.ggml.token_type' has {len(types)} "
                        f"entries, expected one per token ({len(tokens)})")
    # "left right", split at the first space after the first character, as
    # llama.cpp's vocabulary loader does
    merges = field(r, "tokenizer.ggml.merges", kind=[str])
    if bad := next((m for m in merges if m.find(" ", 1) < 0), None):
        raise GGUFError(f"{first}: metadata key 'tokenizer.ggml.merges' has {bad!r}, "
                        "expected two tokens with a space between them")
    merges = [(m[:i], m[i + 1:]) for m in merges for i in (m.find(" ", 1),)]
    # without the converter's [PAD<i>] placeholders (UNUSED) for the ids
    # of the model's vocab_size the checkpoint's tokenizer has no token for
    used = [i for i in range(len(tokens)) if i >= len(types) or types[i] != _TOKEN_TYPE_UNUSED]
    vocab = {tokens[i]: i for i in used}
    if len(vocab) != len(used):
        raise GGUFError(f"{first}: tokenizer.ggml.tokens has duplicate entries")
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    except Exception as e:  # the tokenizers library names the merge, not the file
        raise GGUFError(f"{first}: the BPE tokenizer of 'tokenizer.ggml.tokens' and "
                        f"'tokenizer.ggml.merges' cannot be built ({e})") from e
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_GLM_PRE_TOKENIZER_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # The checkpoint's added tokens, never split. llama.cpp's converter
    # (conversion/base.py, get_vocab_base) writes those the checkpoint marks
    # special as CONTROL and the others as USER_DEFINED: GLM's <think>, <tool_call>,
    # <arg_key>, ... (a non-special token whose text looks like <|...|> becomes
    # CONTROL). Only special ones are dropped by decode(skip_special_tokens=True).
    added = {i: (t, ty == _TOKEN_TYPE_CONTROL) for i, (t, ty) in enumerate(zip(tokens, types))
             if ty in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)}
    tok.add_tokens([AddedToken(t, special=special, normalized=False)
                    for t, special in added.values()])

    def token(name, required=False):
        i = token_id(r, first, name, len(tokens), required=required)
        return tokens[i] if i is not None else None

    # The BOS the file names ([gMASK] for GLM: llama.cpp's _set_vocab_glm sets it
    # when the checkpoint names none) if it is an added token: as bos_token,
    # transformers would make a normal token unsplittable, changing how text encodes.
    bos_id = token_id(r, first, "bos", len(tokens))
    chat_template = field(r, "tokenizer.chat_template", required=False, kind=str)
    init = {"tokenizer_object": tok, "eos_token": token("eos", required=True), "pad_token": token("padding"),
            "unk_token": None, "bos_token": tokens[bos_id] if bos_id in added else None,
            "clean_up_tokenization_spaces": False,
            # GLM's tokenizer lists every added token among its special tokens
            # (extra_special_tokens), which vLLM's parsers read
            "extra_special_tokens": [t for t, _ in added.values()]}
    # GLM-5's tokenizer_config.json: model_max_length is the context length
    n_ctx = field(r, f"{GGUF_ARCH}.context_length", required=False, kind=int, lo=1,
                  hi=_MAX_CONTEXT)
    if n_ctx is not None:
        init["model_max_length"] = n_ctx
    if chat_template is not None:
        init["chat_template"] = chat_template
    for key in ("truncation_side", "padding_side", "model_max_length"):
        if key in kwargs:
            init[key] = kwargs[key]
    return PreTrainedTokenizerFast(**init)


# The end-of-generation tokens a GGUF names: llama.cpp's vocabulary loader adds
# eos, eot and eom to its EOG set (src/llama-vocab.cpp, special_eog_ids; of the
# tokens it adds by their text GLM's vocabulary has only <|endoftext|>, its eos),
# and its converter names GLM's <|user|> eot and <|observation|> eom
# (conversion/base.py, _set_vocab_glm): GLM-5's generation_config.json eos_token_id.
_EOG_TOKENS = ("eos", "eot", "eom")
# general.sampling.* (gguf-py's Metadata copies them from the checkpoint's
# generation_config.json) as the GenerationConfig fields vLLM reads for its
# default sampling parameters (ModelConfig.get_diff_sampling_param)
_SAMPLING_KEYS = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k",
                  "min_p": "min_p", "penalty_repeat": "repetition_penalty"}


def generation_config_from_gguf(path: str | os.PathLike):
    """The `GenerationConfig` of a GGUF's metadata (of its first part): every
    end-of-generation token it names as `eos_token_id`, its padding token, and
    the checkpoint's sampling defaults (`general.sampling.*`)."""
    from transformers import GenerationConfig

    first = first_file(path)
    r = open_reader(first)
    n_tokens = len(vocabulary(r, first))

    values = {}
    eog = list(dict.fromkeys(i for name in _EOG_TOKENS
                             if (i := token_id(r, first, name, n_tokens)) is not None))
    if eog:
        values["eos_token_id"] = eog[0] if len(eog) == 1 else eog
    if (pad := token_id(r, first, "padding", n_tokens)) is not None:
        values["pad_token_id"] = pad
    for key, name in _SAMPLING_KEYS.items():
        kind = int if name == "top_k" else float
        value = field(r, f"general.sampling.{key}", required=False, kind=kind, lo=0)
        if value is None:
            continue
        values[name] = value if name == "top_k" else _decimal(value)
    if any(name in values for name in _SAMPLING_KEYS.values()):
        # llama.cpp samples with them (its defaults for these keys)
        values["do_sample"] = True
    return GenerationConfig(**values)
