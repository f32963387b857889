# SPDX-License-Identifier: Apache-2.0
"""End to end on a GPU: the tiny GLM-5 through vLLM with the portable (Triton)
indexer against the same model with DeepGEMM's indexer (the upstream path).

Same attention backend in both runs (FLASHMLA_SPARSE, upstream's on SM90), so
the difference is the indexer alone; a third run adds TRITON_MLA_SPARSE. Prompts
of 300-1000 tokens exceed index_topk (128). Eager mode (CUDA graphs are covered
by the backend's own tests). Compared: prompt-token logprobs and greedy output,
where the two runs may part only at a near-tie (each run's token among the
other's top-5).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from glm5_tiny import make_tiny_glm5

HERE = Path(__file__).resolve().parent


def generate(model, out, **kw):
    cmd = [sys.executable, str(HERE / "glm5_generate.py"), "--model", str(model),
           "--out", str(out), "--eager"]
    for k, v in kw.items():
        cmd += [f"--{k.replace('_', '-')}", v]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return json.loads(Path(out).read_text())


def compare(a, b):
    """Mean/max |delta| of prompt-token logprobs and greedy agreement."""
    deltas, agree, total = [], 0, 0
    for oa, ob in zip(a["outputs"], b["outputs"]):
        for pa, pb in zip(oa["prompt_logprobs"][1:], ob["prompt_logprobs"][1:]):
            common = set(pa) & set(pb)
            deltas += [abs(pa[t] - pb[t]) for t in common]
        for i, (ta, tb) in enumerate(zip(oa["tokens"], ob["tokens"])):
            total += 1
            if ta != tb:
                # parting at a near-tie: each token among the other's top-5
                assert str(tb) in oa["logprobs"][i] and str(ta) in ob["logprobs"][i]
                break
            agree += 1
    return sum(deltas) / len(deltas), max(deltas), agree / total


@pytest.mark.gpu
def test_portable_indexer_matches_deepgemm(tmp_path):
    pytest.importorskip("vllm.third_party.deep_gemm")
    model = make_tiny_glm5(tmp_path / "tiny-glm5")
    ref = generate(model, tmp_path / "ref.json", attention_backend="FLASHMLA_SPARSE",
                   indexer="deepgemm")
    ours = generate(model, tmp_path / "ours.json", attention_backend="FLASHMLA_SPARSE",
                    indexer="triton")
    both = generate(model, tmp_path / "both.json", attention_backend="TRITON_MLA_SPARSE",
                    indexer="triton")
    assert ref["indexer_backend"] == "deepgemm" and ref["triton_indexer_calls"] == {
        "prefill": 0, "decode": 0}
    for run in (ours, both):
        assert run["indexer_backend"] == "triton"
        assert run["triton_indexer_calls"]["prefill"] > 0
        assert run["triton_indexer_calls"]["decode"] > 0
        mean, worst, agree = compare(ref, run)
        print(f"{run['args']['attention_backend']}: prompt logprob |delta| mean {mean:.4f} "
              f"max {worst:.4f}; greedy agreement {agree:.3f}")
        assert mean < 0.02 and worst < 0.5
