# SPDX-License-Identifier: Apache-2.0
"""The accuracy matrix enumerates every row and applies its stated bound."""

from benchmarks import glm5_accuracy_matrix as matrix


def test_every_row_once():
    rows = matrix.rows()
    assert len(rows) == 4 * 3 * 2 * 2
    assert len({tuple(r.values()) for r in rows}) == len(rows)


def test_bounds_and_status():
    key = ("gguf-q8_0", "upstream", "graphs", "bfloat16")
    results = {key: {"vs_fp32": {"mean": 0.3}}}
    ours = dict(source="gguf-q8_0", path="portable", mode="graphs", dtype="bfloat16")
    assert matrix.bound(ours, results) == 2 * 0.3 + 0.05
    # fp16 without an upstream fp16 row: the upstream bf16 row bounds it
    assert matrix.bound(dict(ours, dtype="float16"), results) == 2 * 0.3 + 0.05
    assert matrix.bound(dict(ours, source="safetensors"), results) is None
    ok = matrix.status({**ours, "vs_fp32": {"mean": 0.6}}, 0.65)
    bad = matrix.status({**ours, "vs_fp32": {"mean": 0.7}}, 0.65)
    missing = matrix.status({**ours, "error": "boom"}, 0.65)
    ref = matrix.status({**ours, "path": "upstream", "error": "no fp16"}, None)
    assert (ok["status"], bad["status"], missing["status"], ref["status"]) == (
        "pass", "FAIL", "did not run", "reference did not run")
