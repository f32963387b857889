# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A GGUF model from its files: what the plugin reads from them before the weights.

- `reader`: the checked reader of every GGUF the plugin opens, whatever its
  architecture, and typed metadata values;
- `files`: the split-set name rule, split sets, the directory of one model, a
  quant's files by name;
- `config`, `tokenizer`, `generation_config`: llama.cpp's `glm-dsa` (GLM-5) files
  as their own config, tokenizer and generation config source;
- `config_parser`: config format `gguf` with those files as config source.
- `tensors`: the tensors as the weight loaders take them (views of the file),
  and the load's progress.

The weights adapters (`weights_adapter/glm_dsa.py`, `weights_adapter/checked.py`)
map the tensors.
"""

from .config import config_from_gguf, is_glm_dsa_gguf
from .files import first_file, resolve_gguf_dir, split_files
from .generation_config import generation_config_from_gguf
from .reader import GGUFError, GGUFFile, field, open_gguf
from .tokenizer import TOKENIZER_MODE, register_tokenizer_mode, tokenizer_from_gguf

__all__ = [
    "GGUFError",
    "GGUFFile",
    "TOKENIZER_MODE",
    "config_from_gguf",
    "field",
    "first_file",
    "generation_config_from_gguf",
    "is_glm_dsa_gguf",
    "open_gguf",
    "register_tokenizer_mode",
    "resolve_gguf_dir",
    "split_files",
    "tokenizer_from_gguf",
]
