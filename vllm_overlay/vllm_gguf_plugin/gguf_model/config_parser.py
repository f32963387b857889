# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Config format `gguf` with llama.cpp's `glm-dsa` files as their own config source.

The plugin registers this parser for config format `gguf` in place of its
`GGUFConfigParser`, which reads the config of a GGUF model from an HF checkpoint;
a glm-dsa GGUF named as the config source (plugin.py's engine-args hook names its
first part when no checkpoint is given) gives the config of its metadata instead,
and the generation config (`get_generation_config`, which vLLM's
`try_get_generation_config` asks a config format's parser for: an overlay hunk).
Every other source is the plugin's as before.
"""

from pathlib import Path

from transformers import GenerationConfig, PretrainedConfig
from vllm.transformers_utils.config import _maybe_remap_hf_config_attrs

from ..config_parser import GGUFConfigParser
from .config import config_from_gguf, is_glm_dsa_gguf
from .files import first_file
from .generation_config import generation_config_from_gguf


class GlmDsaGGUFConfigParser(GGUFConfigParser):
    def parse(
        self,
        model: str | Path,
        trust_remote_code: bool,
        revision: str | None = None,
        code_revision: str | None = None,
        **kwargs,
    ) -> tuple[dict, PretrainedConfig]:
        if not is_glm_dsa_gguf(model):
            return super().parse(model, trust_remote_code, revision, code_revision, **kwargs)
        # as HFConfigParser finishes a config
        config = _maybe_remap_hf_config_attrs(config_from_gguf(model))
        return config.to_dict(), config

    def get_generation_config(
        self, model: str | Path, revision: str | None = None
    ) -> GenerationConfig | None:
        """The generation config of a glm-dsa GGUF (any part of a split set) named as
        the config source; None for any other source, which vLLM reads as before."""
        if not str(model).endswith(".gguf") or not is_glm_dsa_gguf(first_file(model)):
            return None
        return generation_config_from_gguf(model)
