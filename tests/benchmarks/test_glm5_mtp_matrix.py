# SPDX-License-Identifier: Apache-2.0
"""The MTP matrix (benchmarks/glm5_mtp_matrix.py) enumerates its rows and applies its
checks: lossless greedy output up to a stated near-tie, acceptance against the bf16
file's, TRITON_MLA_SPARSE for target and draft."""

import json

import pytest

from benchmarks import glm5_mtp_matrix as matrix


def test_every_row_once():
    rows = matrix.rows()
    keys = [matrix.key(r) for r in rows]
    assert len(keys) == len(set(keys))
    for model in matrix.MODELS:
        for source in matrix.SOURCES:
            # each file type with and without MTP, N = 1..3, each with its N = 0 run
            assert {r["n"] for r in rows if (r["model"], r["source"], r["mode"]) ==
                    (model, source, "eager")} == {0, 1, 2, 3}
        for mode in ("graphs", "sm120") if model == "glm5" else ("sm120",):
            assert {(r["source"], r["n"]) for r in rows
                    if r["model"] == model and r["mode"] == mode} >= {("Q4_K_M", 0), ("Q4_K_M", 3)}


def run(tokens, logprobs=None, al=None, backend="TRITON_MLA_SPARSE"):
    logprobs = logprobs or [{str(t): -0.1, "999": -3.0} for t in tokens]
    return {"outputs": [{"tokens": tokens, "logprobs": logprobs}],
            "acceptance": {"acceptance_length": al},
            "target_attention_backend": backend, "draft_attention_backend": backend}


def test_parting_and_its_gap():
    base = run([5, 6, 7], [{"5": -0.1}, {"6": -0.2, "8": -0.23}, {"7": -0.1, "9": -2.0}])
    assert matrix.parting(base, run([5, 6, 7])) is None
    p = matrix.parting(base, run([5, 8, 7]))
    assert (p["prompt"], p["step"], p["without_mtp"], p["with_mtp"]) == (0, 1, 6, 8)
    assert p["gap"] == pytest.approx(0.03)


def test_prompts_parted_by_length():
    base = {"outputs": [{"prompt_len": 40, "tokens": [5, 6]},
                        {"prompt_len": 128, "tokens": [5, 6]},
                        {"prompt_len": 160, "tokens": [5, 6]}]}
    spec = {"outputs": [{"prompt_len": 40, "tokens": [5, 6]},
                        {"prompt_len": 128, "tokens": [5, 7]},
                        {"prompt_len": 160, "tokens": [4, 6]}]}
    assert matrix.prompts_parted(base, spec) == [128, 160]
    assert matrix.prompts_parted(base, base) == []
    assert matrix.prompts_parted(run([5, 6]), run([5, 7])) == [0]


def test_checks():
    near_tie = [{"5": -0.1, "9": -2.0}, {"6": -0.70, "8": -0.72}, {"7": -0.1, "9": -2.0}]
    clear = [{"5": -0.1, "9": -2.0}, {"6": -0.1, "8": -2.0}, {"7": -0.1, "9": -2.0}]
    results = {
        ("glm5", "bf16", "eager", 0): run([5, 6, 7], clear),
        ("glm5", "bf16", "eager", 1): run([5, 6, 7], al=2.0),
        ("glm5", "q8_0", "eager", 0): run([5, 6, 7], near_tie),
        ("glm5", "q8_0", "eager", 1): run([5, 8, 7], al=1.9),  # parts at a near-tie
        ("glm5", "Q4_K_M", "eager", 0): run([5, 6, 7], clear),
        ("glm5", "Q4_K_M", "eager", 1): run([5, 8, 7], al=2.0),  # parts where it is clear
        ("glm5", "IQ2_M", "eager", 0): run([5, 6, 7], clear),
        ("glm5", "IQ2_M", "eager", 1): run([5, 6, 7], al=1.7),  # 15% below bf16
        ("glm5", "safetensors", "eager", 0): run([5, 6, 7], clear),
        ("glm5", "safetensors", "eager", 1): run([5, 6, 7], al=2.1,
                                                 backend="FLASH_ATTN_MLA_SPARSE"),
        ("glm52", "bf16", "eager", 1): {"error": "boom"},
    }
    status = {(r["source"], r["n"]): r["status"] for r in matrix.check(results)
              if r["model"] == "glm5"}
    assert status[("bf16", 1)] == "pass"
    assert status[("q8_0", 1)] == "pass"
    assert status[("Q4_K_M", 1)].startswith("FAIL: parts at a gap of 1.900")
    assert status[("IQ2_M", 1)] == "FAIL: acceptance"
    assert status[("safetensors", 1)] == "FAIL: backend"
    failed = [r for r in matrix.check(results) if "error" in r]
    assert failed[0]["status"] == "FAIL: did not run"


def test_batch_invariant_rows_and_subsets():
    rows = matrix.rows()
    bi = {(r["model"], r["source"], r["n"]) for r in rows if r["mode"] == "bi"}
    # each model's quantized files under batch invariance, each N with its N = 0 run
    assert bi == {(m, s, n) for m in matrix.MODELS for s in matrix.BI_SOURCES
                  for n in (0, 1, 2, 3)}
    some = matrix.rows(("glm5",), modes=("bi",), sources=("Q4_K_M", "IQ2_M"))
    assert {(r["mode"], r["source"]) for r in some} == {("bi", "Q4_K_M"), ("bi", "IQ2_M")}
    assert {"f16", "Q2_K"} <= set(matrix.SOURCES)


def test_batch_invariant_rows_allow_no_parting():
    """Under batch invariance a run with MTP computes what the run without it computes:
    any parting fails, even at a near-tie."""
    near_tie = [{"5": -0.1, "9": -2.0}, {"6": -0.70, "8": -0.72}, {"7": -0.1, "9": -2.0}]
    results = {
        ("glm5", "bf16", "bi", 0): run([5, 6, 7], near_tie),
        ("glm5", "bf16", "bi", 1): run([5, 6, 7], al=2.0),
        ("glm5", "Q4_K_M", "bi", 0): run([5, 6, 7], near_tie),
        ("glm5", "Q4_K_M", "bi", 1): run([5, 8, 7], al=2.0),
    }
    status = {r["source"]: r["status"] for r in matrix.check(results) if r["n"] == 1}
    assert status["bf16"] == "pass"
    assert status["Q4_K_M"] == "FAIL: parts at a gap of 0.020"


def test_saved_rows(tmp_path):
    """--saved-rows checks the row files a stopped run left: a row without its file did
    not run, and a present row is read as the run returned it."""
    head = {"attention_backend": "TRITON_MLA_SPARSE",
            "target_attention_backend": "TRITON_MLA_SPARSE", "indexer_backend": "triton"}
    base = dict(run([5, 6]), **head, draft_attention_backend=None)
    spec = dict(run([5, 6], al=2.0), **head, draft_attention_backend="TRITON_MLA_SPARSE")
    rows = [dict(model="glm5", source="bf16", mode="bi", n=n) for n in (0, 1, 2)]
    for row, res in zip(rows, (base, spec)):
        matrix.row_file(row, tmp_path).write_text(json.dumps(res))
    table = matrix.check({matrix.key(r): matrix.saved_row(r, tmp_path) for r in rows})
    assert [r["status"] for r in table] == ["pass", "pass", "FAIL: did not run"]
    assert table[1]["acceptance"]["acceptance_length"] == 2.0


def test_upstream_rows():
    """Mode upstream: the GLM-5's safetensors, bf16 and Q4_K_M, each N with its N = 0 run."""
    up = {(r["model"], r["source"], r["n"]) for r in matrix.rows() if r["mode"] == "upstream"}
    assert up == {("glm5", s, n) for s in ("safetensors", "bf16", "Q4_K_M")
                  for n in (0, 1, 2, 3)}
    assert not [r for r in matrix.rows(("glm52",)) if r["mode"] == "upstream"]


def test_upstream_checks():
    """On upstream's path the bf16 file's acceptance is held to 5% of safetensors' (the
    same weights), a quantized file's to 10% of the bf16 file's, and the backend must be
    one, and not ours."""
    flash = "FLASH_ATTN_MLA_SPARSE"
    clear = [{"5": -0.1, "9": -2.0}, {"6": -0.1, "8": -2.0}, {"7": -0.1, "9": -2.0}]

    def results(bf16_al, q4_al=2.0, q4_backend=flash):
        return {
            ("glm5", "safetensors", "upstream", 0): run([5, 6, 7], clear, backend=flash),
            ("glm5", "safetensors", "upstream", 1): run([5, 6, 7], al=2.0, backend=flash),
            ("glm5", "bf16", "upstream", 0): run([5, 6, 7], clear, backend=flash),
            ("glm5", "bf16", "upstream", 1): run([5, 6, 7], al=bf16_al, backend=flash),
            ("glm5", "Q4_K_M", "upstream", 0): run([5, 6, 7], clear, backend=flash),
            ("glm5", "Q4_K_M", "upstream", 1): run([5, 6, 7], al=q4_al, backend=q4_backend),
        }

    def status(res):
        return {(r["source"], r["n"]): r["status"] for r in matrix.check(res)}

    ok = status(results(bf16_al=1.95))
    assert set(ok.values()) == {"pass"}
    row = next(r for r in matrix.check(results(bf16_al=1.95))
               if (r["source"], r["n"]) == ("bf16", 1))
    assert row["acceptance_vs_safetensors"] == pytest.approx(0.975)
    # 7% below safetensors: within the quantized files' 10%, not the same weights' 5%
    assert status(results(bf16_al=1.86))[("bf16", 1)] == "FAIL: acceptance against safetensors"
    assert status(results(bf16_al=2.0, q4_al=1.7))[("Q4_K_M", 1)] == "FAIL: acceptance"
    assert status(results(bf16_al=2.0, q4_backend="TRITON_MLA_SPARSE"))[("Q4_K_M", 1)] \
        == "FAIL: backend"
