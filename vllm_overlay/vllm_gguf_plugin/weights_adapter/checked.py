# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plugin's default GGUF adapter, with the file checked against the model.

`GGUFWeightsAdapter` maps tensors by gguf-py's tensor-name map and loads what it
finds: a split set's missing part, a missing or renamed tensor, or an embedding
with another number of rows than the file has tokens leave model parameters
unfilled (garbage weights) or give the model another vocabulary, without an error.
This adapter, the fallback of `get_weights_adapter`, loads the same tensors and
refuses such files, naming the file and the tensors, as llama.cpp's loader does:

- a split set is whole and consistent (`split_files`);
- every tensor the model has a parameter for is in the file (the output head
  aside: without it the model is tied, as the plugin decides);
- every tensor the model does not map is one of llama.cpp's tensors of the file's
  architecture (gguf-py's `MODEL_TENSORS`, blocks below its `block_count`);
- `token_embd` has one row per token of the model's vocabulary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import gguf
import regex as re
import torch
from transformers import AutoModelForCausalLM

from ..gguf_model import GGUFError, field, open_gguf, split_files
from .base import GGUFLoadSpec
from .default import GGUFWeightsAdapter

if TYPE_CHECKING:
    from vllm.config import ModelConfig

_BLOCK_RE = re.compile(r"^blk\.(0|[1-9]\d*)\.(.+)$")
# the plugin ties the output head to the embedding when the file has none
_TIED = "lm_head.weight"
_MAX_LISTED = 8


def _listed(names: list[str]) -> str:
    return ", ".join(names[:_MAX_LISTED]) + (" ..." if len(names) > _MAX_LISTED else "")


class _ArchTensors:
    """The tensor names llama.cpp's converter writes for the file's architecture."""

    def __init__(self, first: str):
        reader = open_gguf(first)
        name = field(reader, "general.architecture", kind=str)
        arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == name), None)
        # an architecture gguf-py does not know: every name is taken as its own
        self.known = arch is not None
        names = [gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS.get(arch, [])]
        self.globals = {n for n in names if "{bid}" not in n}
        self.blocks = {n.removeprefix("blk.{bid}.") for n in names if "{bid}" in n}
        self.n_blocks = (field(reader, f"{name}.block_count", 0, required=False, kind=int,
                               lo=0) if self.known else 0)

    def __contains__(self, tensor: str) -> bool:
        if not self.known:
            return True
        base, _, suffix = tensor.rpartition(".")
        if suffix not in ("weight", "bias"):
            return False
        m = _BLOCK_RE.match(base)
        if m is None:
            return base in self.globals
        return int(m[1]) < self.n_blocks and m[2] in self.blocks


class CheckedGGUFWeightsAdapter(GGUFWeightsAdapter):
    """`GGUFWeightsAdapter` for every model no other adapter takes, refusing files
    whose tensors are not the model's (see the module docstring)."""

    @staticmethod
    def _get_all_gguf_files(model_path: str) -> list[str]:
        # a whole split set, not the parts that happen to be there
        return [str(p) for p in split_files(model_path)]

    def prepare_loading(self, model_path: str, model_config: ModelConfig) -> GGUFLoadSpec:
        spec = super().prepare_loading(model_path, model_config)
        _check_tensors(spec.weights_source, spec.gguf_to_hf_name_map, model_config)
        return spec


def _check_tensors(files: list[str], name_map: dict[str, str],
                   model_config: ModelConfig) -> None:
    tensors = {t.name: t for f in files for t in open_gguf(f).tensors}
    arch = _ArchTensors(files[0])
    config = model_config.hf_config
    with torch.device("meta"):
        params = set(AutoModelForCausalLM.from_config(
            config, trust_remote_code=model_config.trust_remote_code).state_dict())
    missing = sorted(g for g, hf in name_map.items()
                     if g not in tensors and g in arch and hf in params and hf != _TIED)
    if missing:
        raise GGUFError(f"{files[0]}: GGUF is missing {len(missing)} tensors the model "
                        f"needs: {_listed(missing)}")
    unknown = sorted(n for n in tensors if n not in name_map and n not in arch)
    if unknown:
        raise GGUFError(f"{files[0]}: {len(unknown)} GGUF tensors map to no parameter of "
                        f"the model and are no tensors of its architecture in llama.cpp: "
                        f"{_listed(unknown)}")
    embedding = tensors.get("token_embd.weight")
    vocab = config.get_text_config().vocab_size
    if embedding is not None and int(embedding.shape[-1]) != vocab:
        raise GGUFError(f"{files[0]}: GGUF tensor 'token_embd.weight' has "
                        f"{int(embedding.shape[-1])} rows, the vocabulary {vocab} tokens")
