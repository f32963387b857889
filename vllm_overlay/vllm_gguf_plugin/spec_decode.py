# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the speculative-decoding proposer shares between a GGUF target and its
MTP draft.

After loading the draft, vLLM's proposer (`SpecDecodeBaseProposer.load_model`,
v1/spec_decode/llm_base_proposer.py) gives an MTP draft the target's embedding and
head. It reads both modules' `.weight` to compare their widths, and a GGUF
module holds its blocks as `qweight` instead, so a quantized file failed there
(`'VocabParallelEmbedding' object has no attribute 'weight'`). For a GGUF model
the loader's weights adapter records which file tensor filled each of these
modules (`gguf_source`, see `GlmDsaGGUFAdapter.check_loaded`); where the draft's
tensor is the target's, the draft shares the target's module (as upstream does
for a checkpoint's MTP layer), else it keeps the file's own tensor. Models without
a recorded source take upstream's path unchanged.
"""

from __future__ import annotations

from functools import wraps

import torch.nn as nn
from vllm.distributed.parallel_state import get_pp_group
from vllm.logger import init_logger

logger = init_logger(__name__)


def gguf_source(module: nn.Module | None) -> tuple[str, str] | None:
    """(file, GGUF tensor) the module's weights were loaded from, or None."""
    return getattr(module, "gguf_source", None)


def _target_embedding(target: nn.Module) -> nn.Module | None:
    inner = getattr(target, "model", None)
    return getattr(inner, "embed_tokens", None) or getattr(inner, "embedding", None)


def _shared_heads(draft: nn.Module) -> dict[str, nn.Module]:
    """{layer: its shared_head} of an MTP draft's layers."""
    layers = getattr(getattr(draft, "model", None), "layers", None)
    if layers is None:
        return {}
    items = layers.items() if isinstance(layers, nn.ModuleDict) else enumerate(layers)
    return {str(k): layer.shared_head for k, layer in items
            if hasattr(getattr(layer, "shared_head", None), "head")}


def _share_embeddings(original):
    @wraps(original)
    def share_embeddings(self, target_language_model: nn.Module) -> None:
        target = _target_embedding(target_language_model)
        draft = getattr(self.model.model, "embed_tokens", None)
        source = gguf_source(draft)
        if source is None or gguf_source(target) is None:
            return original(self, target_language_model)
        if get_pp_group().world_size > 1:
            logger.info("The MTP draft's embedding is loaded separately from the target "
                        "model's (pipeline parallel).")
        elif source == gguf_source(target):
            del self.model.model.embed_tokens
            self.model.model.embed_tokens = target
            logger.info("GGUF: the MTP draft shares the target model's embedding (%s).",
                        source[1])
        else:
            logger.info("GGUF: the MTP draft keeps its own embedding (%s), not the target "
                        "model's (%s).", source[1], gguf_source(target)[1])

    return share_embeddings


def _share_lm_head(original):
    @wraps(original)
    def share_lm_head(self, target_language_model: nn.Module) -> None:
        target = getattr(target_language_model, "lm_head", None)
        heads = _shared_heads(self.model)
        own = {k: sh.head for k, sh in heads.items()
               if gguf_source(sh.head) is not None and gguf_source(target) is not None
               and gguf_source(sh.head) != gguf_source(target)}
        had_lm_head = hasattr(self.model, "lm_head")
        # upstream's: the head, the top-k buffer, the index sharing of GLM-5.2
        original(self, target_language_model)
        if not own:
            return
        # a draft head that is not the target's tensor stays the draft's
        for k, head in own.items():
            del heads[k].head
            heads[k].head = head
            logger.info("GGUF: MTP layer %s keeps its own head (%s), not the target "
                        "model's (%s).", k, gguf_source(head)[1], gguf_source(target)[1])
        if not had_lm_head and getattr(self.model, "lm_head", None) is target:
            del self.model.lm_head

    return share_lm_head


def patch_mtp_sharing() -> None:
    """Make the proposer's sharing of embedding and head GGUF-aware (idempotent)."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer as proposer

    if getattr(proposer, "_gguf_sharing_patched", False):
        return
    proposer._maybe_share_embeddings = _share_embeddings(proposer._maybe_share_embeddings)
    proposer._maybe_share_lm_head = _share_lm_head(proposer._maybe_share_lm_head)
    proposer._gguf_sharing_patched = True
