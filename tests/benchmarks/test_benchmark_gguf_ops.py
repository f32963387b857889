# SPDX-License-Identifier: Apache-2.0
"""The GGUF kernel benchmark (benchmarks/kernels/benchmark_gguf_ops.py): its random
blocks are valid GGUF data for every type it times (gguf-py dequantizes them to small
finite values), its flop/byte counts, its choice of the fastest right path and its
table; on a GPU, every path of a small dense and MoE case against float32."""

import math

import gguf
import numpy as np
import pytest
import torch

from benchmarks.kernels import benchmark_gguf_ops as bench

ALL_TYPES = ("Q4_0", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS", "IQ2_XS",
             "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS", "IQ4_NL", "IQ1_S", "IQ1_M")


@pytest.mark.parametrize("qtype", sorted(set(ALL_TYPES) | set(bench.TYPES)))
def test_random_blocks_are_valid_gguf(qtype):
    gen = torch.Generator().manual_seed(0)
    blocks = bench.random_blocks(qtype, 4, 512, gen)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    assert blocks.dtype == torch.uint8 and blocks.shape == (4, 512 // block * size)
    w = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[qtype])
    assert w.shape == (4, 512) and np.isfinite(w).all()
    # float16 scales below 2^-11 times the largest sub-scale (int8) and code (6 bits)
    assert np.abs(w).max() < 2.0 ** -11 * 128 * 64
    assert np.abs(w).max() > 0  # not all zeros: the values vary
    with pytest.raises(ValueError, match="whole blocks"):
        bench.random_blocks(qtype, 1, block + 1)


def test_flop_and_bytes():
    flop, nbytes = bench.dense_flop_bytes(4, 256, 512, "Q8_0")
    assert flop == 2 * 4 * 256 * 512
    assert nbytes == 256 * 512 // 32 * 34 + 2 * 4 * (256 + 512)
    shape = {"experts": 8, "hidden": 256, "intermediate": 128, "top_k": 2}
    per_expert = 3 * 256 * 128 // 256 * 144  # Q4_K: 144 bytes per 256 values
    flop, nbytes = bench.moe_flop_bytes(1, "Q4_K", shape)
    assert flop == 2 * 1 * 2 * 3 * 256 * 128
    assert nbytes == 2 * per_expert + 2 * 256 * 2  # one token hits top_k experts
    _, nbytes = bench.moe_flop_bytes(64, "Q4_K", shape)
    assert nbytes == 8 * per_expert + 2 * 64 * 256 * 2  # every expert, once
    # gate_up at Q4_K, down at Q6_K (210 bytes per 256 values)
    assert bench.moe_types("Q4_K/Q6_K") == ("Q4_K", "Q6_K")
    assert bench.moe_types("Q8_0") == ("Q8_0", "Q8_0")
    mixed = 2 * 256 * 128 // 256 * 144 + 256 * 128 // 256 * 210
    assert bench.moe_flop_bytes(64, "Q4_K/Q6_K", shape) == (flop * 64,
                                                              8 * mixed + 2 * 64 * 256 * 2)


def test_fastest_skips_wrong_paths_and_bounds():
    paths = {"plugin": {"us": 10.0, "rel": 0.01}, "mmq": {"us": 5.0, "rel": 0.2},
             "triton": {"us": 8.0, "rel": 0.001}, "mm16": {"us": 1.0, "rel": 0.0},
             "marlin4": {"us": 0.5, "rel": 0.01}, "dequant": {"error": "RuntimeError: x"}}
    assert bench.fastest(paths) == "triton"
    assert bench.fastest({"mm16": {"us": 1.0, "rel": 0.0}}) is None


def test_paths_can_be_chosen_the_bounds_always_run():
    paths = {"plugin": 1, "marlin": 2, "mmq": 3, "mm16": 4, "fused16": 5}
    assert bench.kept(paths, None) == paths
    assert bench.kept(paths, {"marlin", "vec"}) == {"marlin": 2, "mm16": 4, "fused16": 5}


def test_table():
    rows = [{"op": "dense", "case": "q_b", "type": "Q4_K", "M": 8, "flop": 2e9, "bytes": 1e7,
             "paths": {"plugin": {"us": 20.0, "rel": 0.01}, "mmq": {"us": 10.0, "rel": 0.3},
                       "triton": {"us": 10.0, "rel": 0.001}}, "fastest": "triton"},
            {"op": "moe", "case": "moe-256x2048", "type": "Q4_K", "M": 1, "flop": 1e6,
             "bytes": 1e6, "paths": {"plugin": {"error": "x"}, "vec": {"us": 2.0, "rel": 0.0}},
             "fastest": "vec"}]
    lines = bench.table(rows)
    assert lines[0] == ("| op | type | M | plugin | mmq | triton | vec | fastest | "
                        "plugin / fastest | fastest TFLOP/s, TB/s |")
    cells = lines[2].split(" | ")
    assert cells[3:6] == ["20.0", "10.0 (rel 0.30!)", "10.0"]
    assert cells[7:10] == ["triton", "2.00", "200.0, 1.00 |"]
    assert lines[3].split(" | ")[3] == "error" and lines[3].split(" | ")[8] == "-"


def test_a_run_cut_short_keeps_its_finished_cases(monkeypatch, tmp_path):
    """The JSON report is written after each case (a device call's time limit cut the
    benchmark of 2026-12-04 and its report with it); complete only at the end."""
    import json
    import sys

    def case(op, qtype, name, cut_at=None):
        if name == cut_at:
            raise TimeoutError(name)
        return [{"op": op, "case": name, "type": qtype, "M": 8, "flop": 1e6, "bytes": 1e6,
                 "paths": {"plugin": {"us": 2.0, "rel": 0.01}}, "fastest": "plugin"}]

    out = tmp_path / "ops.json"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "GPU")
    monkeypatch.setattr(bench, "moe_case", lambda qtype, *a: case("moe", qtype, "moe"))
    argv = ["bench", "--types", "Q6_K", "--dense", "qkv_a", "o_proj", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(bench, "dense_case",
                        lambda qtype, name, *a: case("dense", qtype, name, cut_at="o_proj"))
    with pytest.raises(TimeoutError):
        bench.main()
    report = json.loads(out.read_text())
    assert report["complete"] is False and [r["case"] for r in report["rows"]] == ["qkv_a"]
    monkeypatch.setattr(bench, "dense_case", lambda qtype, name, *a: case("dense", qtype, name))
    bench.main()
    report = json.loads(out.read_text())
    assert report["complete"] is True and report["argv"] == argv[1:]
    assert [r["case"] for r in report["rows"]] == ["qkv_a", "o_proj", "moe"]
    assert list(tmp_path.iterdir()) == [out]


def test_int4_groups_along_each_experts_inputs():
    # codes and scales along k (an expert's inputs), the weight within half a step
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(3, 64, 96, generator=gen) * 0.05).half()
    q, s = bench.int4_groups(w)
    assert q.shape == (3, 96, 64) and s.shape == (3, 96 // bench.MARLIN_GROUP, 64)
    assert int(q.min()) >= 1 and int(q.max()) <= 15
    step = s.float().repeat_interleave(bench.MARLIN_GROUP, dim=1)
    back = (q.float() - 8) * step
    err = (back - w.float().transpose(1, 2)).abs()
    assert bool((err <= step / 2 + 1e-3 * step).all())
    # the group's largest weight is on the grid's end: its scale is max |w| / 7
    g = w[1].float().T.reshape(3, bench.MARLIN_GROUP, 64)
    torch.testing.assert_close(s[1].float(), (g.abs().amax(1) / 7).half().float())


def int4_weights(w16: torch.Tensor) -> torch.Tensor:
    """The [experts, n, k] weights that int4_groups' codes and scales stand for."""
    q, s = bench.int4_groups(w16)
    step = s.float().repeat_interleave(bench.MARLIN_GROUP, dim=1)
    return ((q.float() - 8) * step).transpose(1, 2).to(w16.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 96])
def test_marlin4_computes_its_own_codes(m):
    # marlin4 is a bound timed on the experts requantized to int4: the kernel must give the
    # MoE of those codes. Against the GGUF's own weights the requantization alone moves one
    # token's output by up to 0.28 of its largest value (a CPU run of the benchmark's Q4_K/Q6_K
    # case, 200 draws), so that comparison tests no kernel.
    torch.manual_seed(m)
    gen = torch.Generator().manual_seed(m)
    e, h, i, top_k = 8, 512, 256, 2
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * h ** -0.5).half().cuda()
    w2 = (torch.randn(e, h, i, generator=gen) * i ** -0.5).half().cuda()
    x = (torch.randn(m, h, device="cuda") * h ** -0.5).half()
    topk_ids = torch.rand(m, e, device="cuda").topk(top_k, dim=1).indices.to(torch.int32)
    topk_w = torch.rand(m, top_k, device="cuda").softmax(dim=1)
    out = bench._marlin4_moe([], w13, w2, x, topk_w, topk_ids)
    ref = bench._moe_reference(x, int4_weights(w13), int4_weights(w2), topk_w, topk_ids)
    assert bench.rel_error(out, ref) < bench.WRONG
    # and the codes are not the weights: the original weights' MoE is further away
    assert bench.rel_error(out, bench._moe_reference(x, w13, w2, topk_w, topk_ids)) > bench.WRONG


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "IQ2_S", "Q4_K/Q6_K"])
def test_every_path_matches_float32(qtype):
    torch.manual_seed(1)  # the activations and routing (on the GPU)
    gen = torch.Generator().manual_seed(1)
    dense = ([] if "/" in qtype  # (a MoE case only: gate_up and down of other types)
             else bench.dense_case(qtype, "small", [1, 8, 40], gen=gen, shape=(512, 1024)))
    moe = bench.moe_case(qtype, [1, 8, 96], gen=gen, triton_block_m=(4, 16),
                         shape={"experts": 8, "hidden": 512, "intermediate": 256, "top_k": 2})
    for row in dense + moe:
        for name, res in row["paths"].items():
            assert "error" not in res, (row["op"], row["M"], name, res)
            # int8 activations (mmvq, mmq, vec) round more than the 16-bit paths; marlin4
            # runs other codes (test_marlin4_computes_its_own_codes)
            if name not in bench.REQUANTIZED:
                assert res["rel"] < bench.WRONG, (row["op"], row["M"], name, res["rel"])
            assert math.isfinite(res["us"]) and res["us"] > 0
        assert row["fastest"] is not None
