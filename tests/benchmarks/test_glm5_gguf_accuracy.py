# SPDX-License-Identifier: Apache-2.0
"""The accuracy comparison with llama.cpp (benchmarks/glm5_gguf_accuracy.py): its paths
and its table, each engine's error and the overlay's over llama.cpp's."""

from benchmarks import glm5_gguf_accuracy as acc


def test_paths_name_the_sm120_path_and_upstreams():
    assert acc.PATHS["portable-fp16"] == {"attention_backend": "TRITON_MLA_SPARSE",
                                          "indexer": "triton", "dtype": "float16"}
    assert "attention_backend" not in acc.PATHS["upstream-bf16"]  # vLLM's own choice
    assert set(acc.SOURCES) == {"gguf-bf16", "gguf-q8_0", "gguf-Q4_K_M"}


def test_batch_invariant_path_differs_only_in_its_environment(monkeypatch):
    """`portable-fp16-bi` is `portable-fp16` with VLLM_BATCH_INVARIANT=1 added to the
    engine's environment (the rest of it kept); the other paths inherit this process's."""
    monkeypatch.setenv("VLLM_OVERLAY_SOMETHING", "kept")
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert acc.PATHS["portable-fp16-bi"] == acc.PATHS["portable-fp16"]
    env = acc.path_env("portable-fp16-bi")
    assert env["VLLM_BATCH_INVARIANT"] == "1" and env["VLLM_OVERLAY_SOMETHING"] == "kept"
    assert all(acc.path_env(p) is None for p in acc.PATHS if p != "portable-fp16-bi")


def test_table():
    r = {"mean": 0.5, "max": 3.0, "greedy_agreement": 0.75}
    results = {("gguf-bf16", "llama.cpp"): {"mean": 0.25, "max": 2.0, "greedy_agreement": 1.0},
               ("gguf-bf16", "portable-fp16"): r,
               ("gguf-q8_0", "llama.cpp"): {"error": "boom"},
               ("gguf-q8_0", "portable-fp16"): r}
    lines = acc.rows_table(results, ["portable-fp16"])
    assert lines[0] == "| source | llama.cpp | portable-fp16 | portable-fp16 / llama.cpp |"
    assert lines[2] == "| gguf-bf16 | 0.250 (2.00, 1.00) | 0.500 (3.00, 0.75) | 2.00 |"
    assert lines[3] == "| gguf-q8_0 | error | 0.500 (3.00, 0.75) | - |"
    assert lines[4] == "| gguf-Q4_K_M | - | - | - |"
