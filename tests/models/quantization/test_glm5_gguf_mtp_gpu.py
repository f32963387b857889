# SPDX-License-Identifier: Apache-2.0
"""GPU: MTP speculative decoding from a GGUF in vLLM, on the trained tiny GLM-5
(glm5_trained.py, whose MTP head predicts its corpus) as llama.cpp's converter
writes it (bf16), with nothing but the file: TRITON_MLA_SPARSE and the portable
indexer (fp16, as on SM >= 100) serve the target, the draft and the verification
steps (several query tokens per request), with CUDA graphs.

For N = 0 (no MTP) and N = 1..5 draft tokens (glm5_mtp_generate.py, one engine
each): greedy output with MTP identical to without it (speculative decoding with
greedy verification does not change the output; the trained model's greedy
margins are wide, so kernel rounding does not decide it); the acceptance length
(tokens per verification step) and per-position acceptance rates, which must show
drafts accepted: at N = 1 more than half the time, as the MTP head's token is the
corpus rule's most of the time (test_gguf_mtp.py checks that on the CPU), and
never fewer tokens per step with more draft tokens; decode tokens/s at batch 1 and
8 with and without MTP, reported. Writes the report as JSON (glm5-gguf-mtp.json in
VLLM_OVERLAY_REPORT_DIR, else the test's tmp folder) and prints it
(GGUF_MTP_REPORT).

Needs a CUDA GPU, the overlay wheels, transformers 5.17, the trained checkpoint
(VLLM_OVERLAY_GLM5_TRAINED; else trained here on the CPU, minutes) and llama.cpp's
converter (VLLM_OVERLAY_LLAMA_CPP offline); six engine runs of the tiny model.
"""

import json
import os
from pathlib import Path

import pytest

from tests.models import glm5_mtp_generate as mg
from tests.models import glm5_trained
from tests.models.glm5_runs import _run
from tests.models.quantization import gguf_reference as gr

SETTINGS = {"attention_backend": "TRITON_MLA_SPARSE", "indexer": "triton", "dtype": "float16"}
DRAFT_TOKENS = (1, 2, 3, 4, 5)


def mtp_run(model, out: Path, num_speculative_tokens: int) -> dict:
    args = ["--model", str(model), "--num-speculative-tokens", str(num_speculative_tokens)]
    for k, v in SETTINGS.items():
        args += [f"--{k.replace('_', '-')}", v]
    return _run("tests.models.glm5_mtp_generate", out, args)


def first_parting(a: dict, b: dict):
    """(prompt, step, a's token, b's token, a's top-2 there) of the first token where
    two runs' greedy outputs part, or None."""
    for i, (oa, ob) in enumerate(zip(a["outputs"], b["outputs"])):
        for j, (ta, tb) in enumerate(zip(oa["tokens"], ob["tokens"])):
            if ta != tb:
                return i, j, ta, tb, oa["logprobs"][j]
    return None


@pytest.fixture(scope="module")
def trained_gguf(tmp_path_factory):
    trained = glm5_trained.trained_glm5()
    llama_cpp = gr.llama_cpp_dir(tmp_path_factory.getbasetemp() / "llama-cpp")
    tmp = tmp_path_factory.mktemp("gguf-mtp-gpu")
    return gr.convert(llama_cpp, trained, tmp / "glm5-trained-bf16.gguf", "bf16")


@pytest.mark.gpu
def test_glm5_gguf_mtp_in_vllm(trained_gguf, tmp_path):
    runs = {n: mtp_run(trained_gguf, tmp_path / f"mtp-{n}.json", n) for n in (0, *DRAFT_TOKENS)}
    report = {
        "settings": SETTINGS,
        "attention_backend": {n: r["attention_backend"] for n, r in runs.items()},
        "triton_indexer_calls": {n: r["triton_indexer_calls"] for n, r in runs.items()},
        "acceptance": {n: runs[n]["acceptance"] for n in DRAFT_TOKENS},
        "decode_tokens_per_s": {n: r["decode_tokens_per_s"] for n, r in runs.items()},
        "speedup": {n: {b: runs[n]["decode_tokens_per_s"][b] / runs[0]["decode_tokens_per_s"][b]
                        for b in runs[0]["decode_tokens_per_s"]} for n in DRAFT_TOKENS},
        "greedy_parting": {n: first_parting(runs[0], runs[n]) for n in DRAFT_TOKENS},
    }
    report_dir = Path(os.environ.get("VLLM_OVERLAY_REPORT_DIR", tmp_path))
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "glm5-gguf-mtp.json").write_text(json.dumps(report, indent=1))
    print("GGUF_MTP_REPORT " + json.dumps(report))
    for n, r in runs.items():
        assert r["attention_backend"] == "TRITON_MLA_SPARSE", (n, r["attention_backend"])
        assert r["indexer_backend"] == "triton"
        assert r["triton_indexer_calls"]["prefill"] > 0 and r["triton_indexer_calls"]["decode"] > 0
    assert runs[0]["acceptance"]["drafts"] == 0
    # greedy output with MTP is the output without it
    assert report["greedy_parting"] == {n: None for n in DRAFT_TOKENS}
    al = {n: report["acceptance"][n]["acceptance_length"] for n in DRAFT_TOKENS}
    for n in DRAFT_TOKENS:
        assert 1 <= al[n] <= n + 1, (n, al)
        # more draft positions never take away what the first accepts (the same
        # first draft token), up to a few tokens that part by rounding
        assert al[n] >= al[1] - 0.05, (n, al)
    assert al[1] > 1.5, al


# CPU: the report's arithmetic, on counters made as vLLM's metrics reader returns them


def spec_metrics(steps: list[int], n: int, engines: int = 1) -> list:
    """vLLM's spec-decode metrics after verification steps that accepted
    steps[i] of n drafts each, split over `engines` label sets."""
    from vllm.v1.metrics.reader import Counter, Gauge, Vector

    out = [Gauge(name="vllm:num_requests_running", labels={}, value=1.0)]
    for e in range(engines):
        part = steps[e::engines]
        labels = {"engine": str(e)}
        out += [Counter(name="vllm:spec_decode_num_drafts", labels=labels, value=len(part)),
                Counter(name="vllm:spec_decode_num_draft_tokens", labels=labels,
                        value=n * len(part)),
                Counter(name="vllm:spec_decode_num_accepted_tokens", labels=labels,
                        value=sum(part)),
                Vector(name=mg.SPEC_PER_POS, labels=labels,
                       values=[sum(a > i for a in part) for i in range(n)])]
    return out


@pytest.mark.parametrize("engines", (1, 2))
def test_acceptance_length_from_spec_counters(engines):
    """Acceptance length is the mean number of tokens a verification step yields
    (its accepted drafts, plus the target's token); position i's rate the share of
    steps that accepted more than i drafts."""
    earlier, steps, n = [3, 0], [0, 2, 3, 1, 3, 3, 0], 3
    before = mg.spec_counts(spec_metrics(earlier, n, engines))
    after = mg.spec_counts(spec_metrics(earlier + steps, n, engines))
    got = mg.acceptance(before, after)
    assert got["drafts"] == len(steps) and got["draft_tokens"] == n * len(steps)
    assert got["acceptance_length"] == pytest.approx(sum(1 + a for a in steps) / len(steps))
    assert got["per_position"] == pytest.approx(
        [sum(a > i for a in steps) / len(steps) for i in range(n)])
    # no speculative decoding: no counters at all
    none = mg.spec_counts(spec_metrics([], n)[:1])
    assert mg.acceptance(none, none) == {"drafts": 0, "acceptance_length": None,
                                         "per_position": []}


def test_decode_rate_leaves_out_the_prefill():
    # 8 sequences: 0.5 s of prefill and first token, then 20 ms per step of 8 tokens
    prefill, step, tokens = 0.5, 0.02, 256
    seconds = prefill + (tokens - 1) * step
    assert mg.decode_rate(8, tokens, seconds, prefill) == pytest.approx(8 / step)


def test_llm_arguments():
    args = mg.argparse.Namespace(model="m.gguf", dtype="float16", eager=False,
                                 attention_backend="TRITON_MLA_SPARSE", num_speculative_tokens=3)
    kw = mg.llm_kwargs(args)
    assert kw["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3,
                                        "attention_backend": "TRITON_MLA_SPARSE"}
    assert kw["attention_config"] == {"backend": "TRITON_MLA_SPARSE"}
    assert kw["disable_log_stats"] is False and kw["enforce_eager"] is False
    from vllm.engine.arg_utils import EngineArgs

    # every argument is one vLLM's engine takes
    assert set(kw) - {"model"} <= set(EngineArgs.__dataclass_fields__)
    args.num_speculative_tokens = 0
    assert mg.llm_kwargs(args)["speculative_config"] is None


def test_first_parting():
    a = {"outputs": [{"tokens": [5, 6, 7], "logprobs": [{}, {}, {"7": -0.1, "9": -2.0}]}]}
    b = {"outputs": [{"tokens": [5, 6, 9], "logprobs": [{}, {}, {}]}]}
    assert first_parting(a, a) is None
    assert first_parting(a, b) == (0, 2, 7, 9, {"7": -0.1, "9": -2.0})
