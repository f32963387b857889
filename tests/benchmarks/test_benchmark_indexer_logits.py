# SPDX-License-Identifier: Apache-2.0
"""The indexer benchmark (benchmarks/kernels/benchmark_indexer_logits.py): both dot
kinds of the Triton kernels side by side, their ratio checked against the SM80/86
targets, and the 16-bit key cache's time over the default path's, in its JSON rows
and its table; on a GPU, a small case of each kind runs."""

import pytest
import torch

from benchmarks.kernels import benchmark_indexer_logits as bench


def test_ratios_and_targets():
    decode = bench.with_ratios({"kind": "decode", "batch": 8, "ctx": 8192, "bytes": 8650752,
                                "triton_us": 10.0, "triton_16bit_us": 12.5})
    assert decode["ratio_16bit_fp8"] == pytest.approx(1.25)
    assert decode["target_16bit_fp8"] == 1.3 and decode["target_met"]
    prefill = bench.with_ratios({"kind": "prefill", "M": 4096, "N": 4096, "flop": 1,
                                 "triton_us": 100.0, "triton_16bit_us": 260.0})
    assert prefill["target_16bit_fp8"] == 2.5 and not prefill["target_met"]
    # a GPU without fp8 dots (SM80/86) times the 16-bit path alone: no ratio
    alone = bench.with_ratios({"kind": "decode", "batch": 1, "ctx": 8192, "bytes": 1,
                               "triton_16bit_us": 5.0})
    assert "ratio_16bit_fp8" not in alone


def test_table_side_by_side():
    rows = [
        bench.with_ratios({"kind": "prefill", "M": 4096, "N": 4096, "flop": 2 * 4096**2 * 4096,
                           "triton_us": 300.0, "triton_16bit_us": 600.0, "deepgemm_us": 85.0}),
        bench.with_ratios({"kind": "decode", "batch": 256, "ctx": 65536,
                           "bytes": 256 * 65536 * 132, "triton_us": 900.0,
                           "triton_16bit_us": 1260.0, "triton_eager_us": 901.0,
                           "triton_keys16_us": 1800.0}),
        bench.with_ratios({"kind": "decode", "batch": 1, "ctx": 8192, "bytes": 8192 * 132,
                           "triton_16bit_us": 6.0, "triton_16bit_eager_us": 70.0,
                           "triton_keys16_us": 9.0}),
    ]
    lines = bench.table(rows)
    assert lines[0].startswith("| case | fp8-dot us | 16-bit-dot us | 16-bit/fp8 (target) |")
    assert len(lines) == 2 + len(rows)
    cells = [line.split(" | ") for line in lines[2:]]
    assert cells[0][1:6] == ["300.0", "600.0", "2.00 (<= 2.5: met)", "85.0", "3.53"]
    assert cells[0][6] == "458 / 229 TFLOP/s"
    # decode reads the same bytes either way: the rates differ by the time ratio
    assert cells[1][3] == "1.40 (<= 1.3: NOT met)" and cells[1][6] == "2.46 / 1.76 TB/s"
    assert cells[1][7] == "901.0" and cells[1][8] == "1800.0 (2.00) |"
    assert cells[0][8] == "- |"
    # without fp8 dots (SM80/86) the 16-bit keys go against the 16-bit-dot path
    assert cells[2][1:4] == ["-", "6.0", "-"] and cells[2][7] == "70.0"
    assert cells[2][8] == "9.0 (1.50) |"


def test_check_same_compares_the_valid_keys():
    a = torch.tensor([[1.0, 2.0, float("-inf")], [4.0, 5.0, 6.0]])
    calls = {"fp8": lambda: a, "16bit": lambda: a * (1 + 1e-4)}
    bench.check_same(calls, [(0, 2), (1, 3)])  # (the -inf past row 0's keys is skipped)
    with pytest.raises(AssertionError):
        bench.check_same({"fp8": lambda: a, "16bit": lambda: a + 0.1}, [(1, 3)])
    bench.check_same({"16bit": lambda: a}, [(0, 2)])  # one path: nothing to compare


@pytest.mark.gpu
def test_cases_run_both_dot_kinds():
    dots = ["fp8", "16bit"] if torch.cuda.get_device_capability() >= (8, 9) else ["16bit"]
    prefill = bench.with_ratios(bench.prefill_case(256, 1024, None, dots))
    decode = bench.with_ratios(bench.decode_case(2, 1024, None, 2048, dots))
    for row in (prefill, decode):
        assert row["triton_16bit_us"] > 0 and row["triton_keys16_us"] > 0
        assert ("ratio_16bit_fp8" in row) == (len(dots) == 2)
    assert decode["bytes"] == 2 * 1024 * 132
