# SPDX-License-Identifier: Apache-2.0
"""End to end on a GPU: the tiny GLM-5 through vLLM with the portable (Triton)
indexer against the same model with DeepGEMM's indexer (the upstream path), and
with its 16-bit key cache (VLLM_SPARSE_INDEXER_CACHE=16bit) against the fp8 one,
both against transformers fp32.

Reference: FLASHMLA_SPARSE + DeepGEMM (upstream's SM90 path). Noise floor: the
same DeepGEMM indexer with TRITON_MLA_SPARSE, i.e. what a legitimate change of
bf16 kernel does to the logprobs. The Triton indexer with either attention
backend must stay within 3x that floor (with small absolute minimums). Prompts
of 300-1000 tokens exceed index_topk (128). Eager mode (CUDA graphs are covered
by the kernels' own tests). This random model amplifies bf16 differences (see
the measurement below), so the comparison is coarse; a comparison with
transformers fp32 belongs to the end-to-end accuracy matrix.
"""

import os

import pytest

from tests.models.glm5_runs import compare, generate, hf_reference
from tests.models.glm5_tiny import make_tiny_glm5


@pytest.mark.gpu
def test_portable_indexer_matches_deepgemm(tmp_path):
    pytest.importorskip("vllm.third_party.deep_gemm")
    model = make_tiny_glm5(tmp_path / "tiny-glm5")
    ref = generate(model, tmp_path / "ref.json", attention_backend="FLASHMLA_SPARSE",
                   indexer="deepgemm")
    # Noise floor: the same indexer with the other attention kernel.
    floor_run = generate(model, tmp_path / "floor.json", attention_backend="TRITON_MLA_SPARSE",
                         indexer="deepgemm")
    ours = generate(model, tmp_path / "ours.json", attention_backend="FLASHMLA_SPARSE",
                    indexer="triton")
    both = generate(model, tmp_path / "both.json", attention_backend="TRITON_MLA_SPARSE",
                    indexer="triton")
    for run in (ref, floor_run):
        assert run["indexer_backend"] == "deepgemm"
        assert run["triton_indexer_calls"] == {"prefill": 0, "decode": 0}
    floor = compare(ref, floor_run)
    print(f"floor (attention kernel only): {floor}")
    for run in (ours, both):
        assert run["indexer_backend"] == "triton"
        assert run["triton_indexer_calls"]["prefill"] > 0
        assert run["triton_indexer_calls"]["decode"] > 0
        got = compare(ref, run)
        print(f"triton indexer + {run['args']['attention_backend']}: {got}")
        # Measured on the H200 (2026-11-29): the floor itself is large on this random
        # model (prompt logprob |delta| mean 0.144, max 6.0; greedy runs part at
        # non-ties), and the Triton indexer with FLASHMLA_SPARSE stayed inside it
        # (mean 0.118, max 4.9). So: within 3x the floor, no near-tie requirement.
        assert got["mean"] <= max(3 * floor["mean"], 0.01), (got, floor)
        assert got["max"] <= max(3 * floor["max"], 0.1), (got, floor)


@pytest.fixture(scope="module")
def tiny_fp32(tmp_path_factory):
    out = tmp_path_factory.mktemp("glm5-keys16")
    model = make_tiny_glm5(out / "tiny-glm5")
    return model, hf_reference(model, out / "fp32.json")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,eager", [("bfloat16", True), ("bfloat16", False),
                                         ("float16", True)])
def test_16bit_key_cache_closer_to_fp32(tiny_fp32, tmp_path, dtype, eager):
    """fp8 keys and queries move the indexer's top-k where this random model's scores
    are close (transformers fp32 with only them rounded to e4m3: 0.42 nats off, in
    bfloat16 alone 0.24; docs/results.md): the 16-bit key cache must bring the
    portable path clearly closer to fp32 than its fp8 cache."""
    model, fp32 = tiny_fp32
    flags = dict(attention_backend="TRITON_MLA_SPARSE", indexer="triton", dtype=dtype)
    env = {k: v for k, v in os.environ.items()
           if k != "VLLM_SPARSE_INDEXER_CACHE" and not k.startswith("VLLM_TEST_REPORT_")}
    fp8 = generate(model, tmp_path / "fp8.json", eager=eager, env=env, **flags)
    keys16 = generate(model, tmp_path / "keys16.json", eager=eager,
                      env=dict(env, VLLM_SPARSE_INDEXER_CACHE="16bit"), **flags)
    assert fp8["keys16_cache_calls"] == {"write": 0, "gather": 0}
    assert keys16["keys16_cache_calls"]["write"] > 0 and keys16["keys16_cache_calls"]["gather"] > 0
    assert keys16["triton_indexer_calls"]["prefill"] > 0
    assert keys16["triton_indexer_calls"]["decode"] > 0 or not eager
    got, ref = compare(fp32, keys16), compare(fp32, fp8)
    print("KEYS16_REPORT", {"dtype": dtype, "eager": eager, "keys16_vs_fp32": got,
                            "fp8_vs_fp32": ref})
    assert got["mean"] <= 0.8 * ref["mean"], (got, ref)
