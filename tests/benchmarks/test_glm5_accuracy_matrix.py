# SPDX-License-Identifier: Apache-2.0
"""The accuracy matrix enumerates every row, runs each path with its settings and
applies its stated bound."""

from benchmarks import glm5_accuracy_matrix as matrix


def test_every_row_once():
    rows = matrix.rows()
    assert len(rows) == 2 * 4 * 4 * 2 * 2
    assert len({tuple(r.values()) for r in rows}) == len(rows)
    assert {r["model"] for r in matrix.rows(models=("glm52",))} == {"glm52"}
    # a subset of paths keeps upstream's rows, which bound the others
    some = matrix.rows(("graphs",), ("glm5",), ("portable-16bit",))
    assert [r["path"] for r in some[:2]] == ["upstream"] * 2
    assert {r["path"] for r in some} == {"upstream", "portable-16bit"} and len(some) == 16


def test_bounds_and_status():
    key = ("glm5", "gguf-q8_0", "upstream", "graphs", "bfloat16")
    results = {key: {"vs_fp32": {"mean": 0.3}}}
    ours = dict(model="glm5", source="gguf-q8_0", path="portable", mode="graphs",
                dtype="bfloat16")
    assert matrix.bound(ours, results) == 2 * 0.3 + 0.05
    # fp16 without an upstream fp16 row: the upstream bf16 row bounds it
    assert matrix.bound(dict(ours, dtype="float16"), results) == 2 * 0.3 + 0.05
    assert matrix.bound(dict(ours, source="safetensors"), results) is None
    # the GLM-5.2's rows are bounded by its own upstream row only
    assert matrix.bound(dict(ours, model="glm52"), results) is None
    ok = matrix.status({**ours, "vs_fp32": {"mean": 0.6}}, 0.65)
    bad = matrix.status({**ours, "vs_fp32": {"mean": 0.7}}, 0.65)
    missing = matrix.status({**ours, "error": "boom"}, 0.65)
    ref = matrix.status({**ours, "path": "upstream", "error": "no fp16"}, None)
    assert (ok["status"], bad["status"], missing["status"], ref["status"]) == (
        "pass", "FAIL", "did not run", "reference did not run")


def test_sixteen_bit_dots_path(monkeypatch, tmp_path):
    # the 16-bit-dot path runs the portable indexer as on an A100 (the test hook reports
    # capability 8.0 and its 163 KiB), the other paths with the environment as it is; a
    # row whose indexer ran other dots fails even within its bound
    from tests.models import glm5_runs

    seen = {}

    def generate(model, out, eager=True, env=None, **kw):
        seen[kw.get("indexer")] = env
        # (as the indexer decides: fp8 dots from capability 8.9 on; an H200's here)
        capability = float((env or {}).get("VLLM_TEST_REPORT_CAPABILITY", "9.0"))
        dots = "fp8" if capability >= 8.9 else "16bit"
        return {"indexer_backend": kw["indexer"], "indexer_dots": dots,
                "attention_backend": kw["attention_backend"]}

    monkeypatch.setattr(glm5_runs, "generate", generate)
    monkeypatch.setattr(glm5_runs, "compare", lambda ref, res: {"mean": 0.1})
    monkeypatch.delenv("VLLM_TEST_REPORT_CAPABILITY", raising=False)
    row = dict(model="glm5", source="gguf-bf16", path="portable-16bit", mode="eager",
               dtype="bfloat16")
    res = matrix.run_row(row, tmp_path / "m.gguf", {}, tmp_path, 0.1)
    assert seen["triton"]["VLLM_TEST_REPORT_CAPABILITY"] == "8.0"
    assert seen["triton"]["VLLM_TEST_REPORT_SHARED_MEM"] == str(163 * 1024)
    assert res["indexer_dots"] == "16bit"
    assert matrix.status(res, 0.5)["status"] == "pass"
    matrix.run_row(dict(row, path="portable"), tmp_path / "m.gguf", {}, tmp_path, 0.1)
    assert seen["triton"] is None
    fp8 = dict(res, indexer_dots="fp8")
    assert matrix.status(fp8, 0.5)["status"].startswith("FAIL")
