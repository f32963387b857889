# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The generation config of a llama.cpp `glm-dsa` GGUF's metadata.

transformers finds no generation_config.json in a file, and vLLM would take
`eos_token_id` from the model config (the file's eos alone); vLLM reads this one
for a glm-dsa GGUF as config source, for its stop tokens and default sampling
parameters.
"""

import os

from .config import as_decimal, token_id, vocabulary
from .files import first_file
from .reader import field, open_gguf

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
    r = open_gguf(first)
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
        values[name] = value if name == "top_k" else as_decimal(value)
    if any(name in values for name in _SAMPLING_KEYS.values()):
        # llama.cpp samples with them (its defaults for these keys)
        values["do_sample"] = True
    return GenerationConfig(**values)
