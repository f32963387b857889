# SPDX-License-Identifier: Apache-2.0
"""The host-call cost benchmark (benchmarks/host_call_cost.py): its "before" runs the
launch rules at every call and its "after" the cached record, the records agree, and
without NVIDIA's driver the NVML rows are left out with the reason."""

import json

import pytest

from benchmarks import host_call_cost as hc


def test_before_runs_the_rules_every_call(monkeypatch):
    from vllm.v1.attention.ops import sparse_mla_launch as sml
    from vllm_gguf_plugin.quantization import gguf_kernels as gk

    ruled = {"attention": 0, "dense": 0, "moe": 0}

    def counted(rule, kind):
        def run(*args, **kwargs):
            ruled[kind] += 1
            return rule(*args, **kwargs)
        return run

    monkeypatch.setattr(sml, "_launch", counted(sml._launch, "attention"))
    monkeypatch.setattr(gk, "mmvq_max_tokens", counted(gk.mmvq_max_tokens, "dense"))
    monkeypatch.setattr(gk, "triton_tile", counted(gk.triton_tile, "moe"))
    sml._cached_launch.cache_clear()
    gk.dense_launch.cache_clear()
    gk.moe_launch.cache_clear()
    try:
        rows = hc.launch_rows(number=7, repeats=3)
    finally:
        sml._cached_launch.cache_clear()
        gk.dense_launch.cache_clear()
        gk.moe_launch.cache_clear()
    assert [r["call"] for r in rows] == ["sparse_mla_launch", "dense_launch", "moe_launch"]
    # rules runs: 21 timed calls and the check's one uncached, and the cached side's
    # first call alone; moe_launch's rules ask a tile for each of its two products
    assert ruled == {"attention": 23, "dense": 23, "moe": 2 * 23}
    assert all(r["after_us"] > 0 and r["before_us"] > 0 for r in rows)


def test_report_on_cpu(tmp_path, capsys):
    report = hc.main(["--number", "20", "--repeats", "1", "--json", str(tmp_path / "r.json"),
                      "--md", str(tmp_path / "r.md")])
    assert "NvmlCudaPlatform" in report["nvml_skipped"]
    assert [r["call"] for r in report["rows"]] == ["sparse_mla_launch", "dense_launch",
                                                    "moe_launch"]
    assert json.loads((tmp_path / "r.json").read_text()) == report
    md = (tmp_path / "r.md").read_text()
    assert md == hc.markdown(report) and md in capsys.readouterr().out
    assert md.count("\n| ") == 3 and "NVML rows left out" in md


@pytest.mark.parametrize("flag", ["--number", "--nvml-number", "--repeats"])
def test_counts_must_be_positive(flag):
    with pytest.raises(SystemExit):
        hc.main([flag, "0"])
