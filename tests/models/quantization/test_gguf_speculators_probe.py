# SPDX-License-Identifier: Apache-2.0
"""vLLM's speculators probe runs for every model at engine-args time. vLLM would
hand a GGUF to transformers' config parser, which rejects glm-dsa (and deepseek2);
the GGUF plugin (registered by the package's conftest, as vLLM does at start) leaves
GGUF references alone, as the overlay did in vLLM 0.23."""

import pytest


def maybe_override_with_speculators(**kwargs):
    # looked up at call time: the plugin replaces the module's function
    from vllm.transformers_utils import config

    return config.maybe_override_with_speculators(**kwargs)


def test_transformers_cannot_parse_glm_dsa(glm5_gguf):
    # The failure the probe used to hit (independent of vLLM).
    from transformers import PretrainedConfig

    _, _, gguf_path = glm5_gguf
    with pytest.raises(ValueError, match="glm-dsa"):
        PretrainedConfig.get_config_dict(gguf_path.parent, gguf_file=gguf_path.name)


def test_probe_leaves_gguf_alone(glm5_gguf):
    _, model_dir, gguf_path = glm5_gguf
    spec = {"num_speculative_tokens": 1}
    assert maybe_override_with_speculators(
        model=str(gguf_path), tokenizer=str(model_dir), trust_remote_code=False,
        vllm_speculative_config=spec,
    ) == (str(gguf_path), str(model_dir), spec)


def test_probe_still_reads_hf_checkpoints(glm5_gguf):
    # A regular checkpoint without speculators config: unchanged, as upstream.
    _, model_dir, _ = glm5_gguf
    assert maybe_override_with_speculators(
        model=str(model_dir), tokenizer=None, trust_remote_code=False,
    ) == (str(model_dir), None, None)
