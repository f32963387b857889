# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Config format `gguf` with llama.cpp's `glm-dsa` files as their own config source.

The plugin registers this parser for config format `gguf` in place of its
`GGUFConfigParser`, which reads the config of a GGUF model from an HF checkpoint;
a glm-dsa GGUF named as the config source (plugin.py's engine-args hook names its
first part when no checkpoint is given) gives the config of its metadata instead.
Every other source is the plugin's as before.
"""

from pathlib import Path

from transformers import PretrainedConfig
from vllm.transformers_utils.config import _maybe_remap_hf_config_attrs

from ..config_parser import GGUFConfigParser
from .config import config_from_gguf, is_glm_dsa_gguf


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

