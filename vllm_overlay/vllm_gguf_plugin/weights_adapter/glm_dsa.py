# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GGUF weights adapter for GLM-5 (`glm_moe_dsa`): llama.cpp's `glm-dsa` files.

llama.cpp's converter (`GlmMoeDsaModel`, a `DeepseekV2Model`) writes MLA's
`kv_b_proj` split per head into `attn_k_b` (`[n_head, kv_lora, qk_nope]`, the
key half transposed) and `attn_v_b` (`[n_head, v_head, kv_lora]`), the routed
experts as 3D stacks, and the DSA indexer as `indexer.*`. This module maps every
tensor of such a file to the name `DeepseekV2ForCausalLM.load_weights` expects
and yields the tensors in the form vLLM's GGUF layers take:

- `kv_b_proj` is rebuilt exactly as `[attn_k_b[h]^T ; attn_v_b[h]]` per head
  (dequantized when stored quantized) and loaded as an unquantized linear;
- tensors bound for modules without a GGUF quant method (the indexer's fused
  `wk_weights_proj`, the router) are dequantized when stored quantized;
- quantized experts go to the GGUF MoE method as stacks; unquantized ones are
  yielded per expert for the regular fused-MoE method (and its TP/EP sharding);
- the MTP (nextn) blocks after `num_hidden_layers` are left out of the main
  model and are the whole of its MTP draft (`--speculative-config
  '{"method": "mtp", ...}'`): vLLM's SpeculativeConfig turns the model's config
  into a `deepseek_mtp` one (models/deepseek_mtp.py, DeepSeekMTP), for which the
  block's decoder layer, `nextn.eh_proj`, `nextn.enorm`, `nextn.hnorm` and the
  shared head are mapped to the names DeepSeekMTP.load_weights takes
  (`model.layers.<N>.*`); the nextn copies of the embedding, the head and its
  norm, which llama.cpp's glm-dsa loader does not require, are taken from
  `token_embd`, `output` and `output_norm` when a file lacks them, as llama.cpp
  does; `eh_proj` and the draft's embedding (plain torch/unquantized modules in
  DeepSeekMTP) are dequantized;
- the DSA indexer is loaded on the layers vLLM builds one for, the "full" layers
  of GLM-5.2's IndexShare schedule; a "shared" layer reuses the previous full
  layer's top-k and has no indexer, so indexer tensors a file carries there
  (copies, in some published GGUFs) are checked and left out, and the file's own
  schedule must be the model config's;
- tensors llama.cpp's glm-dsa loader does not require and whose absence changes
  nothing in its graph (the routing bias, the indexer key norm's affine) are
  filled with the values that compute the same when a file lacks them;
- a tensor that maps nowhere, a missing tensor, a wrong shape or a type the
  plugin's GGUF kernels cannot run is an error naming the tensor, raised before
  the model is built;
- a split set is checked part by part, the tensor-parallel split must keep
  whole quant blocks, and a model parameter no tensor filled is an error;
- the tensors are views of the file, which each tensor-parallel rank's loader
  narrows to its shard before it copies; what is dequantized here (kv_b_proj, an
  MTP draft's embedding) is dequantized from the rank's rows only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import gguf
import numpy as np
import regex as re
import torch
from vllm.logger import init_logger

from ..gguf_model import GGUFError, field, open_gguf, split_files
from ..gguf_model.config import indexer_schedule
from ..gguf_model.tensors import LoadProgress, bf16_view, file_view, release
from ..quantization.utils import DEQUANT_TYPES
from ..spec_decode import patch_mtp_sharing
from .base import BaseGGUFWeightsAdapter, GGUFLoadSpec
from .default import GGUFWeightsAdapter

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from vllm.config import ModelConfig

logger = init_logger(__name__)

UNQUANTIZED = ("F32", "F16", "BF16")
# What the plugin's GGUF kernels run (quantization/utils.py).
KERNEL_TYPES = {t.name for t in DEQUANT_TYPES}

KV_B = "self_attn.kv_b_proj.weight"
# Targets whose vLLM module has no GGUF quant method: dequantized on load. (The
# indexer's wq_b, a ReplicatedLinear, keeps its blocks: the plugin's
# quantization/params.py loads GGUF weights of layers without a v2 loader.)
DEQUANTIZED = ("self_attn.indexer.wk.weight", "self_attn.indexer.weights_proj.weight",
               "mlp.gate.weight")

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ATTENTION = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_k_b.weight": KV_B,
    "attn_v_b.weight": KV_B,
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_INDEXER = {
    "indexer.attn_k.weight": "self_attn.indexer.wk.weight",
    "indexer.attn_q_b.weight": "self_attn.indexer.wq_b.weight",
    "indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "indexer.proj.weight": "self_attn.indexer.weights_proj.weight",
}
_DENSE = {
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_MOE = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_exps.weight": "mlp.experts.0.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.0.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.0.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
# Tensors llama.cpp's glm-dsa loader marks TENSOR_NOT_REQUIRED whose absence its
# graph treats as a no-op (no selection bias; a LayerNorm without affine), with
# the value that computes the same in vLLM's module.
_OPTIONAL = {"exp_probs_b.bias": 0.0, "indexer.k_norm.weight": 1.0, "indexer.k_norm.bias": 0.0}
# Layers split along their input dimension under tensor parallelism.
_ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight",
                 "mlp.shared_experts.down_proj.weight", "mlp.experts.0.down_proj.weight")
# Layers split along their output dimension (rows; kv_b_proj's attn_k_b/attn_v_b
# by heads, their first dimension); the embedding and the heads along the
# vocabulary, as VocabParallelEmbedding pads it. Everything else (the fused
# q_a/kv_a_mqa, the indexer, the router, norms) is replicated.
_COLUMN_PARALLEL = ("self_attn.q_b_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                    "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
                    "mlp.experts.0.gate_proj.weight", "mlp.experts.0.up_proj.weight")
_VOCAB_PARALLEL = ("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_EXPERTS_RE = re.compile(r"\.mlp\.experts\.0\.(gate|up|down)_proj\.weight$")


# The MTP (nextn) block's own tensors (llama.cpp's MODEL_TENSOR.NEXTN_*), by
# DeepSeekMTP's name in layer N; the last three are optional in llama.cpp's
# glm-dsa loader (TENSOR_NOT_REQUIRED), whose MTP graph then uses the main
# model's: {name: the global tensor it falls back to}.
_NEXTN = {
    "nextn.eh_proj.weight": "eh_proj.weight",
    "nextn.enorm.weight": "enorm.weight",
    "nextn.hnorm.weight": "hnorm.weight",
    "nextn.embed_tokens.weight": "embed_tokens.weight",
    "nextn.shared_head_head.weight": "shared_head.head.weight",
    "nextn.shared_head_norm.weight": "shared_head.norm.weight",
}
_NEXTN_FALLBACK = {
    "nextn.embed_tokens.weight": ("token_embd.weight",),
    # a tied file's output is token_embd (llama.cpp: TENSOR_DUPLICATED)
    "nextn.shared_head_head.weight": ("output.weight", "token_embd.weight"),
    "nextn.shared_head_norm.weight": ("output_norm.weight",),
}
# MTP targets of plain torch or unquantized modules in DeepSeekMTP: dequantized.
_NEXTN_DEQUANTIZED = ("eh_proj.weight", "embed_tokens.weight")
# DeepseekV2's fused layers and their shards (DeepseekV2ForCausalLM's
# packed_modules_mapping, which DeepSeekMTP does not declare).
_FUSED = {"fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
          "gate_up_proj": ("gate_proj", "up_proj")}


def is_mtp_draft(config) -> bool:
    """Whether `config` is vLLM's MTP draft of a GLM-5 model: for method "mtp"
    SpeculativeConfig.hf_config_override (config/speculative.py) turns the
    target's GlmMoeDsaConfig into model_type "deepseek_mtp" with architectures
    ["DeepSeekMTPModel"], keeping everything else (and its class)."""
    from transformers import GlmMoeDsaConfig

    return config.model_type == "deepseek_mtp" and isinstance(config, GlmMoeDsaConfig)


def _n_mtp(config) -> int:
    return getattr(config, "num_nextn_predict_layers", 0) or 0


def _is_moe_layer(config, i: int) -> bool:
    return (config.n_routed_experts is not None and i >= config.first_k_dense_replace
            and i % getattr(config, "moe_layer_freq", 1) == 0)


def runs_indexer(config, i: int) -> bool:
    """Whether vLLM builds a DSA indexer for main-model layer `i` ("full") or
    lets it reuse the previous full layer's top-k ("shared"): DeepseekV2's
    attention reads `index_topk_pattern` ("F"/"S" per layer), else
    `index_topk_freq` and `index_skip_topk_offset` (models/deepseek_v2.py).
    MTP layers (i >= num_hidden_layers) always build one (`is_mtp_layer`)."""
    if i >= config.num_hidden_layers:
        return True
    pattern = getattr(config, "index_topk_pattern", None)
    if pattern is None:
        freq = getattr(config, "index_topk_freq", 1)
        offset = getattr(config, "index_skip_topk_offset", 2)
        return max(i - offset + 1, 0) % freq == 0
    return not (0 <= i < len(pattern) and pattern[i] == "S")


def _table(config, i: int) -> dict[str, str]:
    """{GGUF name in block i: vLLM name in layer i} of what layer i loads."""
    return {**_ATTENTION, **(_INDEXER if runs_indexer(config, i) else {}),
            **(_MOE if _is_moe_layer(config, i) else _DENSE)}


def _shapes(config) -> dict[str, tuple[int, ...]]:
    """The shapes (torch order, [out, in]) of a block's tensors, by their name in
    the block (blk.<i>.*), and of the global tensors."""
    H, V = config.hidden_size, config.vocab_size
    nh, ql, kl = config.num_attention_heads, config.q_lora_rank, config.kv_lora_rank
    r, n, v = config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim
    ih, idim = config.index_n_heads, config.index_head_dim
    E, mI = config.n_routed_experts, config.moe_intermediate_size
    sI = mI * (config.n_shared_experts or 0)
    I = config.intermediate_size
    return {
        "token_embd.weight": (V, H), "output_norm.weight": (H,), "output.weight": (V, H),
        "attn_norm.weight": (H,), "attn_q_a.weight": (ql, H), "attn_q_a_norm.weight": (ql,),
        "attn_q_b.weight": (nh * (n + r), ql), "attn_kv_a_mqa.weight": (kl + r, H),
        "attn_kv_a_norm.weight": (kl,), "attn_k_b.weight": (nh, kl, n),
        "attn_v_b.weight": (nh, v, kl), "attn_output.weight": (H, nh * v),
        "ffn_norm.weight": (H,),
        "indexer.attn_k.weight": (idim, H), "indexer.attn_q_b.weight": (ih * idim, ql),
        "indexer.k_norm.weight": (idim,), "indexer.k_norm.bias": (idim,),
        "indexer.proj.weight": (ih, H),
        "ffn_gate.weight": (I, H), "ffn_up.weight": (I, H), "ffn_down.weight": (H, I),
        "ffn_gate_inp.weight": (E, H), "exp_probs_b.bias": (E,),
        "ffn_gate_exps.weight": (E, mI, H), "ffn_up_exps.weight": (E, mI, H),
        "ffn_down_exps.weight": (E, H, mI),
        "ffn_gate_shexp.weight": (sI, H), "ffn_up_shexp.weight": (sI, H),
        "ffn_down_shexp.weight": (H, sI),
        "nextn.eh_proj.weight": (H, 2 * H), "nextn.enorm.weight": (H,),
        "nextn.hnorm.weight": (H,), "nextn.embed_tokens.weight": (V, H),
        "nextn.shared_head_head.weight": (V, H), "nextn.shared_head_norm.weight": (H,),
    }


def _block(config, shapes, i: int) -> dict[str, tuple[int, ...]]:
    """{GGUF name: shape} of what decoder layer i loads."""
    shared_experts = bool(config.n_shared_experts)
    return {f"blk.{i}.{k}": shapes[k] for k in _table(config, i)
            if shared_experts or not k.endswith("_shexp.weight")}


def _layout(config) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """The GGUF tensors of a glm-dsa file for `config`, with their shapes (torch
    order, [out, in]): (those the model loads, the indexer tensors of shared
    layers, which llama.cpp loads when present and the model does not use).
    For an MTP draft config, the model is the MTP block(s) alone: the decoder
    layer and the nextn tensors of blocks num_hidden_layers and after."""
    shapes = _shapes(config)
    L = config.num_hidden_layers
    if is_mtp_draft(config):
        loaded = {}
        for i in range(L, L + _n_mtp(config)):
            loaded.update(_block(config, shapes, i))
            loaded.update({f"blk.{i}.{k}": shapes[k] for k in _NEXTN})
        return loaded, {}
    loaded = {k: shapes[k] for k in ("token_embd.weight", "output_norm.weight")}
    if not config.tie_word_embeddings:
        loaded["output.weight"] = shapes["output.weight"]
    unused = {}
    for i in range(L):
        loaded.update(_block(config, shapes, i))
        if not runs_indexer(config, i):
            unused.update({f"blk.{i}.{k}": shapes[k] for k in _INDEXER})
    return loaded, unused


def _layers(names: Iterable[str]) -> str:
    return ", ".join(str(i) for i in sorted({int(_BLOCK_RE.match(n)[1]) for n in names}))


def _shape(t) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape))


class GlmDsaGGUF:
    """The tensors of one glm-dsa GGUF model (a single file or a split set as
    `split_files` gives it: whole, its parts holding different tensors), checked
    against `config` and mapped to vLLM's names."""

    def __init__(self, files: list[str | Path], config, tp_size: int = 1,
                 experts_tp_size: int | None = None):
        self.config = config
        self.tensors = {}
        self.file_of = {}
        self.mappings = {}  # {file: its mapping, which the tensors' data view}
        first = None
        for f in files:
            reader = open_gguf(f)
            if field(reader, "split.no", 0, required=False) == 0:
                first = (reader, Path(f))  # the part holding the metadata
            self.mappings[Path(f)] = reader.data
            for t in reader.tensors:
                self.tensors[t.name] = t
                self.file_of[t.name] = Path(f)
        self.path = first[1] if first is not None else Path(files[0])
        if first is not None:
            self._check_schedule(indexer_schedule(*first))
        self.gguf_to_hf = self._map()
        self.tp_size = tp_size
        self.experts_tp_size = tp_size if experts_tp_size is None else experts_tp_size
        self._check_tensor_parallel(tp_size, self.experts_tp_size)

    def _check_schedule(self, full: list[bool]) -> None:
        """The file's indexer schedule is the one vLLM builds from the config: a
        layer the file shares would otherwise compute a top-k of its own (from
        copied indexer weights, or from none), and a full one would lose its own."""
        for i, f in enumerate(full[:self.config.num_hidden_layers]):
            if f != runs_indexer(self.config, i):
                raise GGUFError(
                    f"{self.path}: layer {i} is {'full' if f else 'shared'} in the GGUF's "
                    f"indexer schedule (glm-dsa.attention.indexer.types) but "
                    f"{'shared' if f else 'full'} in the model config (index_topk_pattern, "
                    "else index_topk_freq/index_skip_topk_offset); the model would not be "
                    "the one in the file")

    def _hf_name(self, name: str) -> str:
        """vLLM's name (as the model's load_weights takes it) of GGUF tensor `name`."""
        if name in _GLOBAL:
            return _GLOBAL[name]
        m = _BLOCK_RE.match(name)
        i, rest = int(m[1]), m[2]
        if rest in _NEXTN:
            return f"model.layers.{i}.{_NEXTN[rest]}"
        return f"model.layers.{i}.{_table(self.config, i)[rest]}"

    def _map(self) -> dict[str, str]:
        config = self.config
        L = config.num_hidden_layers
        n_mtp = _n_mtp(config)
        draft = is_mtp_draft(config)
        model = "DeepSeekMTP (the MTP draft)" if draft else "GlmMoeDsaForCausalLM"
        if draft and not n_mtp:
            raise GGUFError(f"{self.path}: the GGUF has no MTP block "
                            "(glm-dsa.nextn_predict_layers is 0 or missing), which "
                            "speculative method 'mtp' needs")
        loaded, unused = _layout(config)
        mapping, unmapped, other, copies = {}, [], 0, []
        for name in self.tensors:
            m = _BLOCK_RE.match(name)
            block = int(m[1]) if m is not None else None
            if name in loaded:
                mapping[name] = self._hf_name(name)
            elif draft and (name in _GLOBAL or (block is not None and block < L)):
                other += 1  # the main model's: the draft's fallbacks below aside
            elif not draft and block is not None and L <= block < L + n_mtp:
                other += 1  # MTP block: the draft model's, not the main model's
            elif name in unused:
                copies.append(name)  # a shared layer's indexer: checked, not loaded
            elif name.endswith((".scale", ".input_scale")):
                raise GGUFError(f"{self.file_of[name]}: tensor {name!r} is a weight scale of "
                                "llama.cpp's NVFP4 format, which the GGUF plugin's kernels "
                                "do not run")
            else:
                unmapped.append(name)
        if unmapped:
            raise GGUFError(
                f"{self.path}: {len(unmapped)} GGUF tensors map to no parameter of "
                f"{model} ({L} layers, {n_mtp} MTP, indexer schedule "
                f"{getattr(config, 'index_topk_pattern', None)}, tied output "
                f"{config.tie_word_embeddings}): {', '.join(sorted(unmapped)[:8])}"
                + (" ..." if len(unmapped) > 8 else ""))
        # an absent optional tensor: {GGUF name: (vLLM name, shape, value)}
        self.defaults = {}
        # an absent optional nextn tensor taken from the main model's (as llama.cpp's
        # MTP graph does): {vLLM name: GGUF name}
        self.fallbacks = {}
        for name in sorted(set(loaded) - set(mapping)):
            if (m := _BLOCK_RE.match(name)) is None:
                continue
            if m[2] in _OPTIONAL:
                self.defaults[name] = (self._hf_name(name), loaded[name], _OPTIONAL[m[2]])
            elif m[2] in _NEXTN_FALLBACK:
                source = next((g for g in _NEXTN_FALLBACK[m[2]] if g in self.tensors), None)
                if source is not None:
                    self.fallbacks[self._hf_name(name)] = source
        taken = {g for g in self.fallbacks.values()}
        missing = sorted(set(loaded) - set(mapping) - set(self.defaults)
                         - {n for n in loaded if self._hf_name(n) in self.fallbacks})
        if missing:
            self._refuse_missing(missing, draft)
        for name in [*mapping, *copies, *taken]:
            t = self.tensors[name]
            shape = (loaded[name] if name in mapping else unused[name] if name in unused
                     else _shapes(config)[name])
            if _shape(t) != shape:
                raise GGUFError(f"{self.file_of[name]}: GGUF tensor {name!r} has shape "
                                f"{list(_shape(t))}, the config implies {list(shape)}")
        for name in [*mapping, *taken]:
            kind = self._type(name)
            if kind not in UNQUANTIZED and kind not in KERNEL_TYPES:
                raise GGUFError(f"{self.file_of[name]}: GGUF tensor {name!r} has type {kind}, "
                                "which the GGUF plugin's kernels do not support")
            if kind not in UNQUANTIZED and len(_shape(self.tensors[name])) == 1:
                # llama.cpp's converter keeps 1-D tensors (norms, biases) in F32; vLLM
                # has no quantized vector
                raise GGUFError(f"{self.file_of[name]}: GGUF tensor {name!r} is a vector "
                                f"stored as {kind}; norms and biases must be unquantized")
        for i in range(L + n_mtp):
            stacks = {self._quantized(f"blk.{i}.ffn_{p}_exps.weight")
                      for p in ("gate", "up", "down") if f"blk.{i}.ffn_{p}_exps.weight" in mapping}
            if len(stacks) > 1:
                raise GGUFError(f"{self.path}: GGUF layer {i}: some expert stacks (ffn_*_exps) "
                                "are quantized and some are not; vLLM runs a layer's experts "
                                "one way")
        if other and not draft:
            logger.info("GGUF: the %d tensors of the MTP (nextn) block are not part of the "
                        "main model; speculative decoding with method 'mtp' loads them as "
                        "its draft", other)
        if draft:
            logger.info("GGUF: the MTP draft is block(s) %s of %s", _layers(mapping), self.path)
        if self.fallbacks:
            logger.info("GGUF: the MTP block has no nextn copy of %s and takes %s, as "
                        "llama.cpp's MTP graph does",
                        ", ".join(sorted(self.fallbacks)),
                        ", ".join(sorted(set(self.fallbacks.values()))))
        if copies:
            logger.info("GGUF: %d indexer tensors on shared layers %s are not loaded: a "
                        "shared layer reuses the top-k of the full layer before it",
                        len(copies), _layers(copies))
        if self.defaults:
            logger.info("GGUF: %d optional tensors are absent (layers %s) and take the value "
                        "that computes what llama.cpp does without them: %s",
                        len(self.defaults), _layers(self.defaults),
                        ", ".join(sorted({_BLOCK_RE.match(n)[2] for n in self.defaults})))
        return mapping

    def _refuse_missing(self, missing: list[str], draft: bool) -> None:
        L = self.config.num_hidden_layers
        listed = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        if draft:
            mtp = {i for i in range(L, L + _n_mtp(self.config))}
            if not any((m := _BLOCK_RE.match(n)) and int(m[1]) in mtp for n in self.tensors):
                raise GGUFError(
                    f"{self.path}: the GGUF declares {len(mtp)} MTP block(s) "
                    "(glm-dsa.nextn_predict_layers) but holds no tensor of block(s) "
                    f"{', '.join(map(str, sorted(mtp)))}: a trunk-only file (llama.cpp "
                    "loads one without its MTP tensors); speculative method 'mtp' needs "
                    "a GGUF converted with them")
            indexer = [n for n in missing if _BLOCK_RE.match(n)[2] in _INDEXER]
            raise GGUFError(
                f"{self.path}: the GGUF's MTP block lacks {len(missing)} tensors vLLM's MTP "
                f"draft (DeepSeekMTP) needs: {listed}"
                + (" (vLLM builds a DSA indexer on every MTP layer, which llama.cpp's MTP "
                   "graph does not run and its loader does not require)" if indexer else ""))
        if "blk.0.attn_norm.weight" not in self.tensors and any(
                ".nextn." in n for n in self.tensors):
            raise GGUFError(
                f"{self.path}: an MTP-only GGUF (llama.cpp's convert_hf_to_gguf.py --mtp): it "
                "holds the draft head and no main-model layers; serve the model's GGUF")
        raise GGUFError(f"{self.path}: GGUF is missing {len(missing)} tensors the model "
                        f"needs: {listed}")

    def _check_tensor_parallel(self, tp_size: int, experts_tp_size: int) -> None:
        """Each rank's shard of each quantized tensor is whole quant blocks
        (`tensor_parallel_shards`)."""
        tensor_parallel_shards(
            {g: (self.tensors[g].tensor_type, _shape(self.tensors[g]))
             for g in self.gguf_to_hf if self._quantized(g)},
            self.gguf_to_hf, tp_size, experts_tp_size)

    def rank_bytes(self, rank: int, experts_ranks: int = 1) -> int:
        """The bytes of the file tensor-parallel rank `rank` copies: its share of
        each split tensor (`tensor_parallel_shards`), each replicated one whole, and
        under expert parallelism its `experts_ranks`-th of the routed experts. Each
        is kept in at least as many bytes on the GPU (dequantized ones, and Marlin's
        experts, in more): a lower bound of the rank's weights."""
        sources = list(self._sources())
        shards = tensor_parallel_shards(
            {g: (self.tensors[g].tensor_type, _shape(self.tensors[g])) for g, _ in sources},
            dict(sources), self.tp_size, self.experts_tp_size)
        total = 0
        for g, hf in sources:
            size, shard = int(self.tensors[g].n_bytes), shards[g]
            if shard is not None:  # the ranks' lengths partition the split dimension
                size = size * shard[rank][2] // sum(length for _, _, length in shard)
            elif _EXPERTS_RE.search(hf):
                size //= experts_ranks
            total += size
        return total

    def _type(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def _quantized(self, name: str) -> bool:
        return self._type(name) not in UNQUANTIZED

    def _dequantized_target(self, hf: str) -> bool:
        """Whether vLLM parameter `hf` takes a dequantized tensor: the rebuilt
        kv_b_proj, modules without a GGUF quant method, and the MTP draft's
        plain-torch eh_proj and unquantized embedding."""
        return hf.endswith((KV_B, *DEQUANTIZED)) or (
            hf.startswith("model.layers.") and hf.endswith(_NEXTN_DEQUANTIZED))

    def _sources(self) -> Iterator[tuple[str, str]]:
        """(GGUF name, vLLM name) of every tensor the model takes from the file."""
        yield from self.gguf_to_hf.items()
        for hf, g in self.fallbacks.items():
            yield g, hf

    def weight_type_map(self) -> dict[str, str]:
        """{vLLM weight name: GGUF type} as GGUFModelLoader uses it to pick the
        modules that run unquantized; the rebuilt kv_b_proj and dequantized
        tensors count as F32."""
        types = {}
        for g, hf in self._sources():
            types[hf] = "F32" if self._dequantized_target(hf) else self._type(g)
            if hf.endswith(".shared_head.head.weight"):
                # DeepSeekMTP builds shared_head.head under its layer's prefix
                # (SharedHead passes its own): model.layers.<N>.head
                types[hf.replace(".shared_head.head.", ".head.")] = types[hf]
        types.update({hf: "F32" for hf, _, _ in self.defaults.values()})
        if is_mtp_draft(self.config):
            # DeepSeekMTP declares no packed_modules_mapping, by which the GGUF config
            # tells a fused layer's shards (the target's DeepseekV2ForCausalLM does):
            # name the fused layers whose shards are all unquantized too
            for fused, shards in _FUSED.items():
                for hf in [h for h in types if h.endswith(f".{shards[0]}.weight")]:
                    parts = [hf.replace(f".{shards[0]}.", f".{s}.") for s in shards]
                    if all(types.get(p) in UNQUANTIZED for p in parts):
                        types[hf.replace(f".{shards[0]}.", f".{fused}.")] = types[hf]
        return types

    def _same_bytes(self, a: str, b: str) -> bool:
        t, u = self.tensors[a], self.tensors[b]
        return (t.tensor_type == u.tensor_type and _shape(t) == _shape(u)
                and np.array_equal(np.asarray(t.data), np.asarray(u.data)))

    def _main_tensor(self, nextn: str) -> str:
        """The main model's tensor a nextn tensor stands for (_NEXTN_FALLBACK's first
        one in the file)."""
        return next(g for g in _NEXTN_FALLBACK[nextn] if g in self.tensors)

    def shared_sources(self) -> dict[str, tuple[str, str]]:
        """{module: (file, GGUF tensor)} for the modules an MTP draft and its
        target may share, the embedding and the output head: the main model's
        `token_embd` and `output`; for the draft, its nextn copy, or the main
        tensor where the block has no copy or its copy holds the same bytes. The
        MTP proposer shares the target's module where the two name one tensor."""
        path = str(self.path.resolve())
        if not is_mtp_draft(self.config):
            return {"model.embed_tokens": (path, "token_embd.weight"),
                    "lm_head": (path, self._main_tensor("nextn.shared_head_head.weight"))}
        out = {}
        L = self.config.num_hidden_layers
        for i in range(L, L + _n_mtp(self.config)):
            for rest, module in (("nextn.embed_tokens.weight", "model.embed_tokens"),
                                 ("nextn.shared_head_head.weight",
                                  f"model.layers.{i}.shared_head.head")):
                name, main = f"blk.{i}.{rest}", self._main_tensor(rest)
                if name not in self.tensors or self._same_bytes(name, main):
                    name = main
                # DeepSeekMTP loads the embedding of its first MTP layer only
                out.setdefault(module, (path, name))
        return out

    def _raw(self, name: str) -> torch.Tensor:
        """The stored data: elements for F32/F16/BF16, blocks for quantized types; a
        view of the file's mapping (gguf_model/tensors.py), which the weight loaders
        narrow to this rank's shard before they copy it."""
        t = self.tensors[name]
        if t.tensor_type.name == "BF16":
            return bf16_view(np.asarray(t.data).reshape(-1)).reshape(_shape(t))
        if not self._quantized(name):
            return file_view(np.asarray(t.data)).reshape(_shape(t))
        return file_view(np.asarray(t.data))

    def dequantized(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `name` in float32, or of its outermost dimension only `rows`
        (start, end): what is read and dequantized is that slice."""
        t = self.tensors[name]
        start, end = rows if rows is not None else (0, _shape(t)[0])
        if not self._quantized(name):
            return self._raw(name)[start:end].float()
        out = gguf.quants.dequantize(np.asarray(t.data)[start:end], t.tensor_type)
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(
            end - start, *_shape(t)[1:])

    def kv_b(self, layer: int) -> torch.Tensor:
        """kv_b_proj.weight `[n_head * (qk_nope + v_head), kv_lora]`, rebuilt: of
        this tensor-parallel rank's heads, the rows its ColumnParallelLinear takes
        (the other rows are left unset: no rank reads another's)."""
        n_head, (rank, size) = self.config.num_attention_heads, _tp_rank_and_size()
        heads = (rank * n_head // size, (rank + 1) * n_head // size)
        k_b = self.dequantized(f"blk.{layer}.attn_k_b.weight", heads)  # [h, kv_lora, nope]
        v_b = self.dequantized(f"blk.{layer}.attn_v_b.weight", heads)  # [h, v_head, kv_lora]
        rows = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1])
        per_head = rows.shape[0] // (heads[1] - heads[0])
        if size == 1:
            return rows
        out = torch.empty(n_head * per_head, rows.shape[1], dtype=rows.dtype)
        out[heads[0] * per_head:heads[1] * per_head] = rows
        return out

    def _dequantized_load(self, g: str, hf: str) -> torch.Tensor:
        """A dequantized target's tensor: whole for a replicated module; of a
        vocab-parallel embedding (an MTP draft's), the rank's rows, the others left
        unset as in `kv_b`."""
        if not (hf.startswith("model.layers.") and hf.endswith(".embed_tokens.weight")):
            return self.dequantized(g)
        rank, size = _tp_rank_and_size()
        if size == 1:
            return self.dequantized(g)
        rows = _vocab_shards(_shape(self.tensors[g])[0], size)[rank]
        out = torch.empty(_shape(self.tensors[g]), dtype=torch.float32)
        out[rows[0]:rows[1]] = self.dequantized(g, rows)
        return out

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for the model's load_weights (DeepseekV2ForCausalLM's,
        or DeepSeekMTP's for the MTP draft): the types of all quantized weights
        first (packed layers need them before any data), then the data, as views
        of the file that each rank's loader narrows to its shard, or dequantized
        (of the rank's rows where the module splits them); the load's progress
        on rank 0, and each tensor's pages unmapped once it is loaded
        (gguf_model/tensors.py)."""
        for g, hf in self._sources():
            if self._quantized(g) and not self._dequantized_target(hf):
                yield (hf.removesuffix("weight") + "qweight_type",
                       torch.tensor(self.tensors[g].tensor_type))
        progress = LoadProgress.of(self.tensors[g] for g, _ in self._sources())
        for g, hf in self._sources():
            if hf.endswith(KV_B):
                if g.endswith("attn_k_b.weight"):
                    yield hf, self.kv_b(int(_BLOCK_RE.match(g)[1]))
            elif self._dequantized_target(hf):
                yield hf, (self._dequantized_load(g, hf) if self._quantized(g)
                           else self._raw(g))
            elif self._quantized(g):
                yield hf.removesuffix("weight") + "qweight", self._raw(g)
            elif _EXPERTS_RE.search(hf):
                # per expert, for the unquantized fused-MoE method
                stack = self._raw(g)
                for e in range(stack.shape[0]):
                    yield hf.replace(".experts.0.", f".experts.{e}."), stack[e]
            else:
                yield hf, self._raw(g)
            progress.update(self.tensors[g])
            release(self.mappings[self.file_of[g]], self.tensors[g])
        progress.close()
        # and the neighbours' pages the kernel mapped around each read (fault-around)
        for mapping in self.mappings.values():
            release(mapping)
        for hf, shape, fill in self.defaults.values():
            yield hf, torch.full(shape, fill, dtype=torch.float32)


def _vocab_shards(vocab: int, tp: int) -> list[tuple[int, int]]:
    """Each rank's rows [start, end) of a vocabulary split as VocabParallelEmbedding
    (and ParallelLMHead) pads and splits it."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        VocabParallelEmbedding, pad_vocab_size)

    padded = pad_vocab_size(vocab)
    shards = [VocabParallelEmbedding._get_indices(padded, padded, vocab, vocab, r, tp)
              for r in range(tp)]
    return [(s.org_vocab_start_index, s.org_vocab_end_index) for s in shards]


def _tp_rank_and_size() -> tuple[int, int]:
    """This process's tensor-parallel rank and size (0, 1 outside an engine)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())


def tensor_parallel_shards(tensors: dict[str, tuple[gguf.GGMLQuantizationType, tuple[int, ...]]],
                           gguf_to_hf: dict[str, str], tp_size: int, experts_tp_size: int,
                           ) -> dict[str, list[tuple[int, int, int]] | None]:
    """How tensor parallelism splits quantized GGUF tensors {name: (type, shape in
    torch order)} bound for vLLM parameters `gguf_to_hf`, as the weight loaders
    narrow their stored data ([..., rows, bytes of a row]): {name: for each rank,
    (dimension, start, length) of the stored tensor it copies}, None for a tensor
    every rank copies whole. Row-parallel layers (o_proj, the down projections)
    split the input dimension, which quant types pack in blocks: a rank's share
    must be whole blocks. Column-parallel ones split rows (the vocabulary as
    VocabParallelEmbedding pads it). The routed experts split over
    `experts_tp_size` (1 under expert parallelism). A split that would cut a block,
    or give the ranks unequal rows, is an error naming the tensor and the setting."""
    shards = {}
    for g, (kind, shape) in tensors.items():
        hf = gguf_to_hf[g]
        tp = experts_tp_size if _EXPERTS_RE.search(hf) else tp_size
        if tp == 1 or not hf.endswith((*_ROW_PARALLEL, *_COLUMN_PARALLEL, *_VOCAB_PARALLEL,
                                       KV_B)):
            shards[g] = None
            continue
        block, type_size = gguf.GGML_QUANT_SIZES[kind]
        if hf.endswith(_ROW_PARALLEL):
            inputs = shape[-1]
            if inputs % (tp * block):
                fix = (" (or --enable-expert-parallel, which does not split the routed "
                       "experts)" if _EXPERTS_RE.search(hf) else "")
                raise GGUFError(
                    f"GGUF tensor {g!r} ({kind.name}, {inputs} inputs) cannot be split over "
                    f"tensor parallel size {tp}: a rank would hold {inputs / tp:g} inputs, not "
                    f"a whole number of {kind.name} blocks of {block}; set "
                    f"--tensor-parallel-size to a divisor of its {inputs // block} blocks a "
                    f"row{fix}")
            n = inputs // block * type_size // tp
            shards[g] = [(len(shape) - 1, r * n, n) for r in range(tp)]
        elif hf.endswith(_VOCAB_PARALLEL):
            from vllm.model_executor.layers.vocab_parallel_embedding import pad_vocab_size

            vocab, padded = shape[0], pad_vocab_size(shape[0])
            if padded % tp:
                raise GGUFError(
                    f"GGUF tensor {g!r} ({kind.name}, a vocabulary of {vocab}, padded to "
                    f"{padded}) cannot be split over tensor parallel size {tp}; set "
                    f"--tensor-parallel-size to a divisor of {padded}")
            shards[g] = [(0, start, end - start) for start, end in _vocab_shards(vocab, tp)]
        else:
            dim = 0 if hf.endswith(KV_B) else len(shape) - 2  # kv_b: by heads
            rows = shape[dim]
            if rows % tp:
                raise GGUFError(
                    f"GGUF tensor {g!r} ({kind.name}, {rows} outputs) cannot be split over "
                    f"tensor parallel size {tp}: the ranks would hold unequal rows; set "
                    f"--tensor-parallel-size to a divisor of {rows}")
            shards[g] = [(dim, r * rows // tp, rows // tp) for r in range(tp)]
    return shards


def check_all_loaded(model: torch.nn.Module, loaded: Iterable[str]) -> None:
    """Every parameter of the model was filled from the GGUF."""
    missing = sorted(set(dict(model.named_parameters())) - set(loaded))
    if missing:
        raise GGUFError(f"{len(missing)} model parameters were not filled by any GGUF tensor: "
                        f"{', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))


class GlmDsaGGUFAdapter(BaseGGUFWeightsAdapter):
    """llama.cpp's glm-dsa files for vLLM's GlmMoeDsaForCausalLM (DeepseekV2) and
    for its MTP draft (DeepSeekMTP)."""

    load_spec: GGUFLoadSpec | None = None

    @classmethod
    def matches(cls, config: PretrainedConfig) -> bool:
        # the model, or its MTP draft (speculative method "mtp")
        return config.model_type == "glm_moe_dsa" or is_mtp_draft(config)

    def prepare_loading(self, model_path: str, model_config: ModelConfig) -> GGUFLoadSpec:
        from vllm.config import get_current_vllm_config

        files = split_files(model_path)
        if is_mtp_draft(model_config.hf_config):
            # the proposer shares target modules with this draft after loading it
            patch_mtp_sharing()
        # the tensor parallel split must keep whole quant blocks per rank
        parallel = get_current_vllm_config().parallel_config
        tp = parallel.tensor_parallel_size
        self.gguf = GlmDsaGGUF(files, model_config.hf_config, tp_size=tp,
                               experts_tp_size=1 if parallel.enable_expert_parallel else tp)
        self.load_spec = GGUFLoadSpec(
            weights_source=[str(f) for f in files],
            unquantized_modules=GGUFWeightsAdapter.get_unquantized_modules(
                self.gguf.weight_type_map()),
            gguf_to_hf_name_map=self.gguf.gguf_to_hf,
        )
        return self.load_spec

    def prepare_weights(self, model_config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        del model_config
        yield from self.gguf.weights()

    def rank_weight_bytes(self) -> int | None:
        """This rank's bytes of the file (`GlmDsaGGUF.rank_bytes`); None under
        pipeline parallelism, where a rank holds some layers only."""
        from vllm.config import get_current_vllm_config

        parallel = get_current_vllm_config().parallel_config
        if parallel.pipeline_parallel_size > 1:
            return None
        experts_ranks = (parallel.tensor_parallel_size * parallel.data_parallel_size
                         if parallel.enable_expert_parallel else 1)
        return self.gguf.rank_bytes(_tp_rank_and_size()[0], experts_ranks)

    def check_loaded(self, model: torch.nn.Module, loaded: Iterable[str]) -> None:
        check_all_loaded(model, loaded)
        # what the MTP proposer compares before it shares target modules with the
        # draft (vllm_gguf_plugin/spec_decode.py)
        for module, source in self.gguf.shared_sources().items():
            model.get_submodule(module).gguf_source = source
