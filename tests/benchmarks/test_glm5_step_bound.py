# SPDX-License-Identifier: Apache-2.0
"""The decode step's memory bound (benchmarks/glm5_step_bound.py): its bytes are the
file's own (gguf-py's reader of a written file), the routed experts a batch touches
follow from uniform routing, the bandwidth comes from the benchmark's mm16 rows, and a
report's engines are set against the bound."""

import json

import pytest

from benchmarks import glm5_step_bound as sb


def test_expected_experts():
    assert sb.expected_experts(256, 8, 1) == pytest.approx(8)
    # two tokens: 8 each, less the expected overlap of 8 x 8 / 256
    assert sb.expected_experts(256, 8, 2) == pytest.approx(16 - 64 / 256)
    assert sb.expected_experts(256, 8, 10**5) == pytest.approx(256)
    # the closed form against counting: every subset of 2 of 4 experts, two tokens
    pairs = [(a, b) for a in range(4) for b in range(a + 1, 4)]
    mean = sum(len(set(p) | set(q)) for p in pairs for q in pairs) / len(pairs) ** 2
    assert sb.expected_experts(4, 2, 2) == pytest.approx(mean)


def test_weights_are_the_files(tmp_path):
    """With every expert and embedding row read, a step reads the file's tensor bytes as
    gguf-py's reader counts them in a file the synthetic writer made; one token reads
    k/E of the experts and one embedding row."""
    from gguf import GGUFReader

    from vllm_gguf_plugin.gguf_model import synthetic

    path = synthetic.write_glm_dsa_gguf(tmp_path / "tiny.gguf", "tiny", layers=3)
    tensors = GGUFReader(path).tensors
    experts = sum(int(t.n_bytes) for t in tensors if "_exps." in t.name)
    embedding = sum(int(t.n_bytes) for t in tensors if t.name == "token_embd.weight")
    total = sum(int(t.n_bytes) for t in tensors)
    shape = synthetic.SHAPES["tiny"]
    every = sb.step_bytes(3, shape.vocab_size * 64, 0, shape="tiny")
    assert every["experts"] == pytest.approx(experts)
    assert every["embedding"] == pytest.approx(embedding * 64)
    assert every["weights"] == total - experts - embedding
    one = sb.step_bytes(3, 1, 0, shape="tiny")
    k, e = shape.num_experts_per_tok, shape.n_routed_experts
    assert one["experts"] == pytest.approx(experts * k / e)
    assert one["embedding"] == pytest.approx(embedding / shape.vocab_size)
    assert one["cache"] == 0


def test_cache_reads():
    """Per layer and sequence: the indexer's keys of every token, the MLA latents of
    the top-k (GLM-5's 2048) at most."""
    short = sb.step_bytes(2, 4, 1000)["cache"]
    assert short == 2 * 4 * 1000 * (sb.MLA_BYTES + sb.INDEX_KEY_BYTES)
    long = sb.step_bytes(2, 4, 8192)["cache"]
    assert long == 2 * 4 * (2048 * sb.MLA_BYTES + 8192 * sb.INDEX_KEY_BYTES)


def ops_row(case, m, n, k, us):
    return {"op": "dense", "case": case, "type": "Q4_K", "M": m, "N": n, "K": k,
            "paths": {"plugin": {"us": 2 * us}, "mm16": {"us": us}}}


def test_bandwidth_from_the_fastest_mm16_row():
    report = {"device": "GPU", "rows": [
        ops_row("a", 8, 1000, 1000, 1.0), ops_row("b", 8, 4000, 1000, 2.0),
        {"op": "moe", "M": 8, "paths": {"marlin": {"us": 0.001}}}]}
    bw = sb.bandwidth_from(report)
    assert bw["case"] == "b" and bw["device"] == "GPU"
    assert bw["bytes_per_s"] == pytest.approx(2 * (4000 * 1000 + 8 * 1000 + 8 * 4000) / 2e-6)
    with pytest.raises(ValueError, match="mm16"):
        sb.bandwidth_from({"rows": [report["rows"][2]]})


def vs_report(layers=2):
    return {"layers": layers,
            "llama_cpp": {"figures": {"decode": {"0": 500.0},
                                      "aggregate": {"0": {"32": 3200.0}}}},
            "paths": {"ours": {"figures": {"decode": {"0": {"1": 250.0, "32": 6400.0}},
                                           "prefill": {"512": 1e4}}}}}


def test_engines_against_the_bound(tmp_path):
    bandwidth = 4e12
    result = sb.bound(2, [1, 32], [0], bandwidth, project=78, report=vs_report())
    one = result["cases"]["decode batch 1 at depth 0"]
    assert one["bound_ms"] == pytest.approx(1e3 * sb.step_bytes(2, 1, 0)["total"] / bandwidth)
    assert one["engines"]["ours"]["ms"] == pytest.approx(4.0)
    assert one["engines"]["ours"]["share_of_bound"] == pytest.approx(one["bound_ms"] / 4.0)
    assert one["max_x_llama_cpp"] == pytest.approx(2.0 / one["bound_ms"])
    many = result["cases"]["decode batch 32 at depth 0"]
    assert many["engines"]["llama.cpp"]["ms"] == pytest.approx(10.0)
    assert many["projected"]["bound_ms"] > 30 * many["bound_ms"]  # 78 layers, not 2
    text = sb.markdown(result)
    assert "| decode batch 32 at depth 0 |" in text and "bound at 78 layers, ms" in text
    with pytest.raises(ValueError, match="3-layer"):
        sb.bound(2, [1], [0], bandwidth, report=vs_report(layers=3))


def test_main(tmp_path):
    ops = tmp_path / "ops.json"
    ops.write_text(json.dumps({"rows": [ops_row("lm_head", 8, 154880, 6144, 440.0)]}))
    vs = tmp_path / "vs.json"
    vs.write_text(json.dumps(vs_report()))
    out = tmp_path / "bound.json"
    result = sb.main(["--layers", "2", "--bandwidth-from", str(ops), "--report", str(vs),
                      "--batches", "1", "--depths", "0", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["bandwidth_from"]["case"] == "lm_head"
    with pytest.raises(SystemExit):
        sb.main(["--layers", "2"])
