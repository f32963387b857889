# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GLM-5's tokenizer from a llama.cpp `glm-dsa` GGUF's `tokenizer.ggml.*` metadata.

transformers cannot build a tokenizer from a `glm-dsa` GGUF. The plugin registers
tokenizer mode `glm_dsa_gguf` with vLLM's tokenizer (and renderer) registry and
selects it for a glm-dsa GGUF named as the tokenizer (plugin.py's engine-args
hook); vLLM then loads the tokenizer through `GlmDsaGGUFTokenizer`.
"""

import os
from pathlib import Path

from vllm.tokenizers.hf import HfTokenizer, get_cached_tokenizer
from vllm.tokenizers.protocol import TokenizerLike

from .config import GGUF_ARCH, MAX_CONTEXT, token_id, vocabulary
from .files import first_file
from .reader import GGUFError, field, open_gguf

TOKENIZER_MODE = "glm_dsa_gguf"

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


def tokenizer_from_gguf(path: str | os.PathLike, **kwargs):
    """GLM-5's byte-level BPE tokenizer from `tokenizer.ggml.*` metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    first = first_file(path)
    r = open_gguf(first)
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
    init = {"tokenizer_object": tok, "eos_token": token("eos", required=True),
            "pad_token": token("padding"),
            "unk_token": None, "bos_token": tokens[bos_id] if bos_id in added else None,
            "clean_up_tokenization_spaces": False,
            # GLM's tokenizer lists every added token among its special tokens
            # (extra_special_tokens), which vLLM's parsers read
            "extra_special_tokens": [t for t, _ in added.values()]}
    # GLM-5's tokenizer_config.json: model_max_length is the context length
    n_ctx = field(r, f"{GGUF_ARCH}.context_length", required=False, kind=int, lo=1,
                  hi=MAX_CONTEXT)
    if n_ctx is not None:
        init["model_max_length"] = n_ctx
    if chat_template is not None:
        init["chat_template"] = chat_template
    for key in ("truncation_side", "padding_side", "model_max_length"):
        if key in kwargs:
            init[key] = kwargs[key]
    return PreTrainedTokenizerFast(**init)


class GlmDsaGGUFTokenizer(TokenizerLike):
    """Tokenizer mode `glm_dsa_gguf`: the tokenizer of a glm-dsa GGUF (any part of
    a split set), cached as vLLM caches HF tokenizers."""

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo_id: str | Path,
        *args,
        trust_remote_code: bool = False,
        revision: str | None = None,
        download_dir: str | None = None,
        **kwargs,
    ) -> HfTokenizer:
        return get_cached_tokenizer(tokenizer_from_gguf(path_or_repo_id, **kwargs))


def register_tokenizer_mode() -> None:
    """Tokenizer mode `glm_dsa_gguf`, rendered as vLLM renders HF tokenizers."""
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers.registry import TokenizerRegistry

    if TOKENIZER_MODE not in TokenizerRegistry.tokenizers:
        TokenizerRegistry.register(TOKENIZER_MODE, __name__, GlmDsaGGUFTokenizer.__name__)
    if TOKENIZER_MODE not in RENDERER_REGISTRY.renderers:
        RENDERER_REGISTRY.register(TOKENIZER_MODE, "vllm.renderers.hf", "HfRenderer")
