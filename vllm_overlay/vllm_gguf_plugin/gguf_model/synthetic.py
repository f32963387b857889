# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GLM-5-shaped `glm-dsa` GGUF files with random weights, written directly.

    python -m vllm_gguf_plugin.gguf_model.synthetic OUT.gguf [--shape glm5|tiny]
        [--layers 10] [--nextn 0] [--recipe Q4_K_M] [--seed 0] [--dry-run]

For speed measurements and start-up checks, where the weights' values do not
matter: llama.cpp's converter needs a 16-bit checkpoint and a bf16 GGUF of the
whole model first (44 GB each for 3 GLM-5 layers), this writes the quantized
file alone, a tensor at a time in chunks (a 10-layer Q4_K_M GLM-5 is ~55 GB;
memory stays at a chunk).

What is llama.cpp's, so that both engines load the file as one they made:

- tensor names and shapes, and the metadata keys and their value types, as
  llama.cpp's `convert_hf_to_gguf.py` writes a GLM-5 checkpoint
  (`GlmMoeDsaModel`: MLA's kv_b split into per-head `attn_k_b`/`attn_v_b`, the
  DSA indexer, the MTP block as the last `nextn_predict_layers` blocks);
- each tensor's type, the tensors' order and the keys' order as `llama-quantize`
  writes them for the recipe (`recipe_type`: llama.cpp's src/llama-quant.cpp);
- a byte-level BPE tokenizer with GLM's special tokens and pre-tokenizer
  ("glm4"), padded to the vocabulary size with `[PAD<i>]` tokens as the
  converter pads it.

The blocks are random but valid: fp16 scales finite and normal (weights of
about the standard deviation of a 0.5 / sqrt(fan-in) initialization, the
output head's 4 / sqrt(fan-in)), codes and sub-block scales in range; norms
are 1 and biases 0. Greedy text from such a file means nothing.
"""

import argparse
import dataclasses
import math
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import numpy as np

GGUF_ARCH = "glm-dsa"


@dataclasses.dataclass(frozen=True)
class GlmDsaShape:
    """The dimensions of a GLM-5 (`glm_moe_dsa`) model, as its config.json names
    them. The first `first_k_dense_replace` layers are dense, the others MoE."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    max_position_embeddings: int
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 2.5
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0


SHAPES = {
    # GLM-5's per-layer dimensions (its config.json)
    "glm5": GlmDsaShape(
        vocab_size=154880, hidden_size=6144, intermediate_size=12288,
        moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8,
        n_shared_experts=1, num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512,
        qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32,
        index_head_dim=128, index_topk=2048, max_position_embeddings=202752),
    # GLM-5's attention head dimensions with a small hidden size, vocabulary and
    # few experts; index_topk small so that a prompt of a few hundred tokens
    # exceeds it
    "tiny": GlmDsaShape(
        vocab_size=2048, hidden_size=1024, intermediate_size=2048,
        moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, num_attention_heads=16, q_lora_rank=256, kv_lora_rank=512,
        qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32,
        index_head_dim=128, index_topk=128, max_position_embeddings=4096),
}

# llama.cpp's file types (llama_ftype) of the recipes
RECIPES = {"Q4_K_M": 15}


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """One tensor of the file: name, shape (numpy order: the last dimension is
    GGUF's ne[0], the row) and type (a GGMLQuantizationType)."""

    name: str
    shape: tuple[int, ...]
    qtype: "object"
    std: float = 0.0
    fill: float | None = None  # constant value (norms 1, biases 0)

    @property
    def nbytes(self) -> int:
        from gguf import GGML_QUANT_SIZES

        block, size = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * size


def _block_tensors(s: GlmDsaShape, i: int, nextn: bool) -> Iterator[tuple]:
    """(name, shape, std or fill) of block `i`, in the converter's order."""
    h, heads = s.hidden_size, s.num_attention_heads
    p = f"blk.{i}."
    init = lambda fan_in: 0.5 / math.sqrt(fan_in)  # noqa: E731
    if nextn:
        yield p + "nextn.eh_proj.weight", (h, 2 * h), init(2 * h)
        yield p + "nextn.enorm.weight", (h,), 1.0
        yield p + "nextn.hnorm.weight", (h,), 1.0
    yield p + "attn_norm.weight", (h,), 1.0
    if i < s.first_k_dense_replace:
        n_ff = s.intermediate_size
        yield p + "ffn_down.weight", (h, n_ff), init(n_ff)
        yield p + "ffn_gate.weight", (n_ff, h), init(h)
        yield p + "ffn_up.weight", (n_ff, h), init(h)
    else:
        n_exp, n_ff = s.n_routed_experts, s.moe_intermediate_size
        n_sh = n_ff * s.n_shared_experts
        yield p + "ffn_down_exps.weight", (n_exp, h, n_ff), init(n_ff)
        yield p + "ffn_gate_exps.weight", (n_exp, n_ff, h), init(h)
        yield p + "ffn_up_exps.weight", (n_exp, n_ff, h), init(h)
        yield p + "exp_probs_b.bias", (n_exp,), 0.0
        yield p + "ffn_gate_inp.weight", (n_exp, h), init(h)
        yield p + "ffn_down_shexp.weight", (h, n_sh), init(n_sh)
        yield p + "ffn_gate_shexp.weight", (n_sh, h), init(h)
        yield p + "ffn_up_shexp.weight", (n_sh, h), init(h)
    yield p + "ffn_norm.weight", (h,), 1.0
    yield p + "indexer.k_norm.bias", (s.index_head_dim,), 0.0
    yield p + "indexer.k_norm.weight", (s.index_head_dim,), 1.0
    yield p + "indexer.proj.weight", (s.index_n_heads, h), init(h)
    yield p + "indexer.attn_k.weight", (s.index_head_dim, h), init(h)
    yield (p + "indexer.attn_q_b.weight", (s.index_n_heads * s.index_head_dim, s.q_lora_rank),
           init(s.q_lora_rank))
    yield p + "attn_kv_a_norm.weight", (s.kv_lora_rank,), 1.0
    yield p + "attn_kv_a_mqa.weight", (s.kv_lora_rank + s.qk_rope_head_dim, h), init(h)
    # kv_b_proj split per head (DeepseekV2Model.modify_tensors): k_b transposed
    yield (p + "attn_k_b.weight", (heads, s.kv_lora_rank, s.qk_nope_head_dim),
           init(s.kv_lora_rank))
    yield p + "attn_v_b.weight", (heads, s.v_head_dim, s.kv_lora_rank), init(s.kv_lora_rank)
    yield p + "attn_output.weight", (h, heads * s.v_head_dim), init(heads * s.v_head_dim)
    yield p + "attn_q_a_norm.weight", (s.q_lora_rank,), 1.0
    yield p + "attn_q_a.weight", (s.q_lora_rank, h), init(h)
    yield (p + "attn_q_b.weight",
           (heads * (s.qk_nope_head_dim + s.qk_rope_head_dim), s.q_lora_rank),
           init(s.q_lora_rank))
    if nextn:
        yield p + "nextn.shared_head_head.weight", (s.vocab_size, h), 4.0 / math.sqrt(h)
        yield p + "nextn.shared_head_norm.weight", (h,), 1.0


def _model_tensors(s: GlmDsaShape, layers: int, nextn: int) -> Iterator[tuple]:
    h = s.hidden_size
    yield "output.weight", (s.vocab_size, h), 4.0 / math.sqrt(h)
    yield "token_embd.weight", (s.vocab_size, h), 1.0 / math.sqrt(h)
    for i in range(layers + nextn):
        yield from _block_tensors(s, i, nextn=i >= layers)
    yield "output_norm.weight", (h,), 1.0


def _quantizable(name: str, ndim: int) -> bool:
    """llama-quant.cpp's tensor_allows_quantization, for glm-dsa's names."""
    return (ndim >= 2 and name.endswith("weight") and "_norm.weight" not in name
            and "ffn_gate_inp.weight" not in name)


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quant.cpp's layers that get more bits: the first and last eighth,
    and every third layer between them (C integer division)."""
    return (i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8
            or (i_layer - n_layers // 8) % 3 == 2)


def recipe_type(name: str, shape: tuple[int, ...], recipe: str, n_blocks: int,
                n_expert: int):
    """The type `llama-quantize` gives tensor `name` for `recipe` (llama-quant.cpp's
    llama_tensor_get_type, for the tensor categories a glm-dsa file has): its
    default type, then the per-category rules, then the fallback for rows the
    type's block does not divide. `n_blocks` counts every block (the MTP ones
    too: llama.cpp's n_layer_all); `n_expert` is the routed experts' count."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r}: one of {sorted(RECIPES)}")
    if not _quantizable(name, len(shape)):
        # as the converter wrote it: every such glm-dsa tensor is float32
        return T.F32
    ne0 = shape[-1]
    qtype = T.Q4_K
    if name == "output.weight":
        qtype = T.Q6_K if ne0 % GGML_QUANT_SIZES[T.Q4_K][0] == 0 else T.Q8_0
    elif name == "token_embd.weight":
        pass  # untied: the default type
    elif "attn_k.weight" in name:  # ATTENTION_K (the indexer's attn_k)
        if n_expert == 8:
            qtype = T.Q8_0
    elif "attn_output.weight" in name:  # ATTENTION_OUTPUT
        if n_expert == 8:
            qtype = T.Q5_K
    elif "ffn_down" in name:  # FFN_DOWN: dense, routed and shared experts
        if use_more_bits(int(name.split(".")[1]), n_blocks):
            qtype = T.Q6_K
    # glm-dsa has no attn_v, attn_qkv or attn_kv_b (ATTENTION_V's use_more_bits):
    # the converter splits kv_b into attn_k_b and attn_v_b, which are OTHER
    if ne0 % GGML_QUANT_SIZES[qtype][0]:
        # tensor_type_fallback: a 32-value block type of about the same bits
        qtype = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}.get(qtype, qtype)
        if ne0 % GGML_QUANT_SIZES[qtype][0]:
            qtype = T.F16
    return qtype


def plan(shape: GlmDsaShape | str = "tiny", layers: int = 4, nextn: int = 0,
         recipe: str = "Q4_K_M") -> list[TensorPlan]:
    """The file's tensors with the recipe's types, in llama-quantize's order (its
    model loader's weights_map: by block, blocks by number, then by name)."""
    s = SHAPES[shape] if isinstance(shape, str) else shape
    if not s.first_k_dense_replace < layers:
        raise ValueError(f"{layers} layers: at least one MoE layer after "
                         f"{s.first_k_dense_replace} dense")
    out = []
    for name, dims, std in _model_tensors(s, layers, nextn):
        qtype = recipe_type(name, dims, recipe, layers + nextn, s.n_routed_experts)
        constant = len(dims) == 1
        out.append(TensorPlan(name, dims, qtype, 0.0 if constant else std,
                              std if constant else None))
    return sorted(out, key=lambda t: (_block_number(t.name), t.name))


def _block_number(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("blk.") else -1


# --------------------------------------------------------------------------------------
# Random blocks
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where a block type keeps its fp16 scale (d) and offset (dmin/m), which of
    its bytes to mask so that sub-block scales stay small, and the offset that
    centers the codes (dmin = center x d)."""

    d: int
    dmin: int | None = None
    center: float = 0.0
    masks: tuple[tuple[int, int, int], ...] = ()  # (start, stop, and-mask)
    add: tuple[tuple[int, int, int], ...] = ()  # (start, stop, value) after the mask


def _layouts():
    from gguf import GGMLQuantizationType as T

    # Q4_K/Q5_K: 12 bytes of packed 6-bit scales and mins from byte 4; masking the
    # first 8 with 0x0F leaves every scale and min in 0..15 (get_scale_min_k4)
    k_scales = ((4, 12, 0x0F),)
    return {
        T.Q4_K: _Layout(d=0, dmin=2, center=7.5, masks=k_scales),
        T.Q5_K: _Layout(d=0, dmin=2, center=15.5, masks=k_scales),
        # int8 sub-block scales at 192..208 in 1..8, d last
        T.Q6_K: _Layout(d=208, masks=((192, 208, 0x07),), add=((192, 208, 1),)),
        T.Q8_0: _Layout(d=0),
        T.Q5_0: _Layout(d=0),
        T.Q5_1: _Layout(d=0, dmin=2, center=-15.5),
        T.Q4_0: _Layout(d=0),
    }


def _random_blocks(rng: np.random.Generator, qtype, n_blocks: int, d: float) -> np.ndarray:
    """`n_blocks` random blocks of `qtype` whose scales are about `d` (each block's
    drawn from [0.75 d, 1.25 d], fp16 and normal)."""
    from gguf import GGML_QUANT_SIZES

    layout = _layouts()[qtype]
    size = GGML_QUANT_SIZES[qtype][1]
    # the generator's raw 64-bit words: random bytes without a copy
    words = rng.bit_generator.random_raw(-(-n_blocks * size // 8))
    blocks = words.view(np.uint8)[:n_blocks * size].reshape(n_blocks, size)
    for start, stop, mask in layout.masks:
        blocks[:, start:stop] &= mask
    for start, stop, value in layout.add:
        blocks[:, start:stop] += value
    scale = d * rng.uniform(0.75, 1.25, n_blocks)
    scale = np.maximum(scale, np.finfo(np.float16).tiny)
    blocks[:, layout.d:layout.d + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    if layout.dmin is not None:
        dmin = (scale * layout.center).astype(np.float16)
        blocks[:, layout.dmin:layout.dmin + 2] = dmin.view(np.uint8).reshape(-1, 2)
    return blocks


@cache
def _unit_std(qtype) -> float:
    """The standard deviation of values dequantized from `_random_blocks` with d = 1
    (measured once on 256 blocks with gguf-py's dequantization)."""
    from gguf.quants import dequantize

    sample = _random_blocks(np.random.default_rng(0), qtype, 256, 1.0)
    return float(np.std(dequantize(sample, qtype)))


class _Chunks:
    """A tensor's data, made and written a chunk at a time: what GGUFWriter's
    write_tensor_data needs of an array (`nbytes`, `tofile`)."""

    CHUNK_BYTES = 64 << 20

    def __init__(self, tensor: TensorPlan, make: Callable[[int], np.ndarray]):
        self.tensor, self.make, self.nbytes = tensor, make, tensor.nbytes

    def tofile(self, fout) -> None:
        from gguf import GGML_QUANT_SIZES

        block, size = GGML_QUANT_SIZES[self.tensor.qtype]
        n_blocks = math.prod(self.tensor.shape) // block
        step = max(1, self.CHUNK_BYTES // size)
        for first in range(0, n_blocks, step):
            fout.write(memoryview(np.ascontiguousarray(self.make(min(step, n_blocks - first)))))


def tensor_data(tensor: TensorPlan, rng: np.random.Generator) -> _Chunks:
    """The tensor's values: a constant (norms, biases), normal values of its std
    (float types), or random blocks whose values have about its std."""
    from gguf import GGMLQuantizationType as T

    float_types = {T.F32: np.float32, T.F16: np.float16}
    if tensor.qtype in float_types:
        dtype = float_types[tensor.qtype]
        if tensor.fill is not None:
            return _Chunks(tensor, lambda n: np.full(n, tensor.fill, dtype=dtype))
        return _Chunks(tensor, lambda n: (rng.standard_normal(n, dtype=np.float32)
                                          * tensor.std).astype(dtype))
    if tensor.qtype not in _layouts():
        raise ValueError(f"{tensor.name}: no random blocks for type {tensor.qtype.name}")
    d = tensor.std / _unit_std(tensor.qtype)
    return _Chunks(tensor, lambda n: _random_blocks(rng, tensor.qtype, n, d))


# --------------------------------------------------------------------------------------
# Tokenizer and metadata
# --------------------------------------------------------------------------------------
# GLM's added tokens (tokenizer.json), written as CONTROL tokens after the BPE
# vocabulary as the converter writes a checkpoint's special tokens
GLM_SPECIAL_TOKENS = ("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
                      "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
# A short chat template in GLM's shape ([gMASK]<sop>, role tokens)
GLM_CHAT_TEMPLATE = ("[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                     "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_UNUSED = 1, 3, 5
_BPE_TOKENS = 1024


def glm_vocabulary(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): a byte-level BPE (GLM's split regex, as the
    plugin's tokenizer rebuilds it) trained on a fixed text, GLM's special
    tokens, and `[PAD<i>]` (UNUSED) up to `vocab_size`, as llama.cpp's converter
    pads a tokenizer smaller than the model's vocabulary."""
    import json

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from .tokenizer import _GLM_PRE_TOKENIZER_REGEX

    n_bpe = min(_BPE_TOKENS, vocab_size - len(GLM_SPECIAL_TOKENS))
    if n_bpe < 256:
        raise ValueError(f"vocab_size {vocab_size}: at least {256 + len(GLM_SPECIAL_TOKENS)}")
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_GLM_PRE_TOKENIZER_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    text = [f"GLM-5 sparse attention, sentence {i}: the quick brown fox jumps over "
            f"{i * 7} lazy dogs; 你好, мир! " for i in range(200)]
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=n_bpe, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab] + list(GLM_SPECIAL_TOKENS)
    types = [_TOKEN_NORMAL] * len(vocab) + [_TOKEN_CONTROL] * len(GLM_SPECIAL_TOKENS)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [_TOKEN_UNUSED] * (vocab_size - len(types))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, types, merges


def add_metadata(writer, s: GlmDsaShape, layers: int, nextn: int, recipe: str,
                 name: str) -> None:
    """The metadata of a converted and quantized GLM-5: the converter's keys in its
    order (ModelBase/DeepseekV2Model/GlmMoeDsaModel set_gguf_parameters,
    _set_vocab_glm), then the two llama-quantize sets."""
    from gguf import GGUFValueType as V

    a = GGUF_ARCH
    u32 = writer.add_uint32
    writer.add_type("model")
    writer.add_name(name)
    writer.add_size_label(size_label(plan(s, layers, nextn, recipe)))
    u32(f"{a}.block_count", layers + nextn)
    u32(f"{a}.context_length", s.max_position_embeddings)
    u32(f"{a}.embedding_length", s.hidden_size)
    u32(f"{a}.feed_forward_length", s.intermediate_size)
    u32(f"{a}.attention.head_count", s.num_attention_heads)
    u32(f"{a}.attention.head_count_kv", 1)  # MLA: one latent KV head
    writer.add_float32(f"{a}.rope.freq_base", s.rope_theta)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", s.rms_norm_eps)
    u32(f"{a}.expert_count", s.n_routed_experts)
    u32(f"{a}.expert_used_count", s.num_experts_per_tok)
    u32(f"{a}.expert_group_count", 1)
    u32(f"{a}.expert_group_used_count", 1)
    u32(f"{a}.expert_gating_func", 2)  # sigmoid
    u32(f"{a}.attention.key_length", s.kv_lora_rank + s.qk_rope_head_dim)
    u32(f"{a}.attention.value_length", s.kv_lora_rank)
    u32(f"{a}.leading_dense_block_count", s.first_k_dense_replace)
    u32(f"{a}.vocab_size", s.vocab_size)
    u32(f"{a}.attention.q_lora_rank", s.q_lora_rank)
    u32(f"{a}.attention.kv_lora_rank", s.kv_lora_rank)
    u32(f"{a}.attention.key_length_mla", s.qk_nope_head_dim + s.qk_rope_head_dim)
    u32(f"{a}.attention.value_length_mla", s.v_head_dim)
    u32(f"{a}.expert_feed_forward_length", s.moe_intermediate_size)
    u32(f"{a}.expert_shared_count", s.n_shared_experts)
    writer.add_float32(f"{a}.expert_weights_scale", s.routed_scaling_factor)
    writer.add_bool(f"{a}.expert_weights_norm", True)
    u32(f"{a}.rope.dimension_count", s.qk_rope_head_dim)
    u32(f"{a}.nextn_predict_layers", nextn)
    u32(f"{a}.attention.indexer.head_count", s.index_n_heads)
    u32(f"{a}.attention.indexer.key_length", s.index_head_dim)
    u32(f"{a}.attention.indexer.top_k", s.index_topk)
    writer.add_array(f"{a}.attention.indexer.types", [True] * layers)
    tokens, types, merges = glm_vocabulary(s.vocab_size)
    ids = {t: i for i, t in enumerate(tokens) if t in GLM_SPECIAL_TOKENS}
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "glm4")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_key_value("tokenizer.ggml.token_type", types, V.ARRAY, sub_type=V.INT32)
    writer.add_array("tokenizer.ggml.merges", merges)
    for key, token in (("eos", "<|endoftext|>"), ("padding", "<|endoftext|>"),
                       ("bos", "[gMASK]"), ("eot", "<|user|>"),
                       ("unknown", "<|endoftext|>"), ("eom", "<|observation|>")):
        u32(f"tokenizer.ggml.{key}_token_id", ids[token])
    writer.add_string("tokenizer.chat_template", GLM_CHAT_TEMPLATE)
    # llama-quantize sets these two last (gguf_set_val_u32 moves a key to the end)
    u32("general.quantization_version", 2)
    u32("general.file_type", RECIPES[recipe])


def size_label(tensors: list[TensorPlan]) -> str:
    """`general.size_label` as the converter computes it (GGUFWriter's
    get_total_parameter_count): experts x (shared + one expert's parameters)."""
    import gguf

    total = shared = expert = n_expert = 0
    for t in tensors:
        size = math.prod(t.shape)
        total += size
        if "_exps." in t.name and len(t.shape) >= 3:
            n_expert = t.shape[0]
            expert += size // n_expert
        else:
            shared += size
    return gguf.size_label(total, shared, expert, n_expert)


def write_glm_dsa_gguf(path: str | os.PathLike, shape: GlmDsaShape | str = "tiny",
                       layers: int = 4, nextn: int = 0, recipe: str = "Q4_K_M",
                       seed: int = 0, progress: Callable[[str], None] | None = None) -> Path:
    """Write a GLM-5-shaped GGUF with random weights to `path` (see the module's
    docstring); `progress` is called with a line per tensor."""
    from gguf import GGUFWriter

    s = SHAPES[shape] if isinstance(shape, str) else shape
    tensors = plan(s, layers, nextn, recipe)
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    writer = GGUFWriter(partial, GGUF_ARCH)
    label = shape if isinstance(shape, str) else "custom"
    add_metadata(writer, s, layers, nextn, recipe,
                 f"GLM-5-shaped synthetic ({label}, {layers}L, {recipe})")
    for t in tensors:
        if t.qtype.name in ("F32", "F16"):
            dtype = np.float32 if t.qtype.name == "F32" else np.float16
            writer.add_tensor_info(t.name, t.shape, np.dtype(dtype), t.nbytes, t.qtype)
        else:
            # quantized: the byte shape, rows of whole blocks
            from gguf import GGML_QUANT_SIZES

            block, size = GGML_QUANT_SIZES[t.qtype]
            byte_shape = (*t.shape[:-1], t.shape[-1] // block * size)
            writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes, t.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    try:
        for i, t in enumerate(tensors):
            writer.write_tensor_data(tensor_data(t, rng))
            if progress is not None:
                progress(f"[{i + 1}/{len(tensors)}] {t.name} {t.qtype.name} "
                         f"{list(t.shape)} {t.nbytes / 2**20:.1f} MiB")
        writer.close()
        partial.replace(path)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m vllm_gguf_plugin.gguf_model.synthetic",
        description="Write a GLM-5-shaped glm-dsa GGUF with random weights "
                    "(llama.cpp's names, metadata and Q4_K_M types).")
    p.add_argument("out", type=Path, help="the .gguf file to write")
    p.add_argument("--shape", choices=sorted(SHAPES), default="glm5",
                   help="glm5: GLM-5's dimensions (default); tiny: small ones for tests")
    p.add_argument("--layers", type=int, default=10,
                   help="main-model layers, the first dense (default 10)")
    p.add_argument("--nextn", type=int, default=0, help="MTP blocks after them (default 0)")
    p.add_argument("--recipe", choices=sorted(RECIPES), default="Q4_K_M")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="print the size and types only")
    args = p.parse_args(argv)
    tensors = plan(args.shape, args.layers, args.nextn, args.recipe)
    total = sum(t.nbytes for t in tensors)
    counts: dict[str, int] = {}
    for t in tensors:
        counts[t.qtype.name] = counts.get(t.qtype.name, 0) + 1
    print(f"{args.out}: {len(tensors)} tensors, {total / 2**30:.2f} GiB of data "
          f"({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))})")
    if args.dry_run:
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.out.parent).free
    if total > free:
        print(f"needs {total / 2**30:.1f} GiB, {args.out.parent} has {free / 2**30:.1f} GiB free",
              file=sys.stderr)
        return 1
    write_glm_dsa_gguf(args.out, args.shape, args.layers, args.nextn, args.recipe, args.seed,
                       progress=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
