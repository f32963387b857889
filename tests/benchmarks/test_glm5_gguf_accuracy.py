# SPDX-License-Identifier: Apache-2.0
"""The accuracy comparison with llama.cpp (benchmarks/glm5_gguf_accuracy.py): its paths
and its table, each engine's error and the overlay's over llama.cpp's."""

import pytest

from benchmarks import glm5_gguf_accuracy as acc


def test_paths_name_the_sm120_path_and_upstreams():
    assert acc.PATHS["portable-fp16"] == {"attention_backend": "TRITON_MLA_SPARSE",
                                          "indexer": "triton", "dtype": "float16"}
    assert "attention_backend" not in acc.PATHS["upstream-bf16"]  # vLLM's own choice
    assert set(acc.SOURCES) == {"gguf-bf16", "gguf-q8_0", "gguf-Q4_K_M"}


@pytest.mark.parametrize("path,base,var,value", [
    ("portable-fp16-bi", "portable-fp16", "VLLM_BATCH_INVARIANT", "1"),
    ("portable-fp16-gguf-moe", "portable-fp16", "VLLM_GGUF_MOE_MARLIN", "0"),
    ("upstream-bf16-gguf-moe", "upstream-bf16", "VLLM_GGUF_MOE_MARLIN", "0"),
    ("portable-bf16-keys16", "portable-bf16", "VLLM_SPARSE_INDEXER_CACHE", "16bit"),
    ("portable-fp16-keys16", "portable-fp16", "VLLM_SPARSE_INDEXER_CACHE", "16bit"),
])
def test_paths_that_differ_only_in_their_environment(monkeypatch, path, base, var, value):
    """`portable-fp16-bi` is `portable-fp16` with VLLM_BATCH_INVARIANT=1 added to the
    engine's environment (the rest of it kept), the `-gguf-moe` paths theirs with
    VLLM_GGUF_MOE_MARLIN=0, the `-keys16` ones with VLLM_SPARSE_INDEXER_CACHE=16bit; the
    other paths inherit this process's."""
    monkeypatch.setenv("VLLM_OVERLAY_SOMETHING", "kept")
    monkeypatch.delenv(var, raising=False)
    assert acc.PATHS[path] == acc.PATHS[base]
    env = acc.path_env(path)
    assert env[var] == value and env["VLLM_OVERLAY_SOMETHING"] == "kept"
    assert acc.path_env(base) is None
    assert sorted(acc.PATH_ENV) == sorted(["portable-fp16-bi", "portable-fp16-gguf-moe",
                                           "upstream-bf16-gguf-moe",
                                           "portable-bf16-keys16", "portable-fp16-keys16"])


def test_which_paths_must_show_marlin_calls(monkeypatch):
    """On the Q4_K_M file every path runs its Q4_K experts on Marlin (and the row
    fails without a counted call) but the batch-invariant and `-gguf-moe` ones, and none
    where this process turned it off."""
    monkeypatch.delenv("VLLM_GGUF_MOE_MARLIN", raising=False)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert {p for p in acc.PATHS if acc.runs(p, "VLLM_GGUF_MOE_MARLIN")} == {
        "portable-fp16", "portable-bf16", "upstream-bf16", "portable-bf16-keys16",
        "portable-fp16-keys16"}
    monkeypatch.setenv("VLLM_GGUF_MOE_MARLIN", "0")
    assert not any(acc.runs(p, "VLLM_GGUF_MOE_MARLIN") for p in acc.PATHS)


def test_switch_counts_check_what_ran(monkeypatch):
    """A path's row fails where a switch it turns on did not run on the Q4_K_M file, and
    on any file where the 16-bit indexer key cache was written without being asked for
    or not written where asked for."""
    for name in ("VLLM_GGUF_MOE_MARLIN", "VLLM_BATCH_INVARIANT", "VLLM_SPARSE_INDEXER_CACHE"):
        monkeypatch.delenv(name, raising=False)

    def result(marlin=1, writes=0):
        return {"marlin_moe_calls": marlin, "keys16_cache_calls": {"write": writes, "gather": 1}}

    got = acc.switch_counts("gguf-Q4_K_M", "portable-fp16", result())
    assert got == {"marlin_moe_calls": 1, "keys16_writes": 0}
    with pytest.raises(RuntimeError, match="VLLM_GGUF_MOE_MARLIN is on"):
        acc.switch_counts("gguf-Q4_K_M", "portable-fp16", result(marlin=0))
    acc.switch_counts("gguf-bf16", "portable-fp16", result(marlin=0))  # (no Q4_K there)
    assert acc.switch_counts("gguf-bf16", "portable-fp16-keys16",
                             result(writes=40))["keys16_writes"] == 40
    with pytest.raises(RuntimeError, match="is asked for but was written 0 times"):
        acc.switch_counts("gguf-q8_0", "portable-bf16-keys16", result())
    with pytest.raises(RuntimeError, match="is not asked for but was written 3 times"):
        acc.switch_counts("gguf-q8_0", "portable-bf16", result(writes=3))


def test_switches_read_as_their_modules_read_them(monkeypatch):
    """Each switch of SWITCHES is on for a path exactly where its module's enabled() is
    on in that path's environment."""
    from vllm_gguf_plugin.quantization import gguf_kernels

    modules = {"VLLM_GGUF_MOE_MARLIN": gguf_kernels.moe_marlin_enabled}
    assert set(modules) == set(acc.SWITCHES)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    for switch, enabled in modules.items():
        for value in (None, "0", "1", "2", " 1 "):
            if value is None:
                monkeypatch.delenv(switch, raising=False)
            else:
                monkeypatch.setenv(switch, value)
            assert acc.runs("portable-fp16", switch) == enabled(), (switch, value)


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


def test_error_split_at_the_top_k():
    """compare(split_at=k): the prompt positions that see at most k tokens (the sparse
    top-k selects all of them) apart from the others, by hand on two outputs."""
    from tests.models.glm5_runs import compare

    def run(lps):  # one prompt: position i's top-5 holds token 7 at logprob lps[i]
        return {"outputs": [{"prompt_logprobs": [None] + [{"7": x} for x in lps],
                             "tokens": [7], "logprobs": [{"7": 0.0}]}]}

    a, b = run([0.0] * 6), run([0.1, 0.1, 0.1, 0.5, 0.5, 0.5])
    got = compare(a, b, split_at=3)
    assert got["mean"] == pytest.approx(0.3)
    assert got["mean_short_context"] == pytest.approx(0.1)  # contexts 1, 2, 3
    assert got["mean_long_context"] == pytest.approx(0.5)  # contexts 4, 5, 6
    assert "mean_short_context" not in compare(a, b)
    # the accuracy rows' split: the tiny GLM-5's index_topk, which every prompt exceeds
    from tests.models.glm5_generate import PROMPT_LENS
    from tests.models.glm5_tiny import TINY_GLM5

    assert acc.TOPK == TINY_GLM5["index_topk"] < min(PROMPT_LENS)
