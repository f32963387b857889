# SPDX-License-Identifier: Apache-2.0
"""A GLM-5 GGUF served past its file's context (VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, as
vLLM allows): its unscaled rope tables hold every position up to max_model_len, with
rope's own values there, so no kernel reads past a table. The tiny GLM-5, whose file
says 4096 tokens, died with an illegal memory access on its first 16384-token prompt so
stretched, and ran every prompt to 131072 tokens at GLM-5's context
(docs/results.md#glm-5s-whole-context). Checked on vLLM's GlmMoeDsaForCausalLM built on
the CPU from the tiny GLM-5's file (glm5_vllm_cpu.py)."""

from vllm_gguf_plugin.gguf_model import config_from_gguf


def rope_tables(run_without_gpu, path, max_model_len) -> dict:
    return run_without_gpu("tests.models.quantization.glm5_vllm_cpu", path,
                           "--max-model-len", max_model_len)[0]["rope_tables"]


def test_rope_tables_cover_max_model_len(run_without_gpu, glm5_ggufs, monkeypatch):
    path = glm5_ggufs["bf16"]
    config = config_from_gguf(path)
    context = config.max_position_embeddings
    assert config.rope_parameters.get("rope_type", "default") == "default"
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    long = rope_tables(run_without_gpu, path, 4 * context)
    # the attention's and the indexer's table of each layer (the MTP block's too)
    assert len(long) >= 2 * config.num_hidden_layers
    assert any("indexer" in name for name in long)
    for name, (positions, error) in long.items():
        assert positions == 4 * context, name
        assert error < 1e-2, (name, error)  # bf16's rounding of cos/sin
    # within the file's context the tables keep the file's length
    short = rope_tables(run_without_gpu, path, context // 2)
    assert set(short) == set(long)
    assert all(positions == context for positions, _ in short.values())
