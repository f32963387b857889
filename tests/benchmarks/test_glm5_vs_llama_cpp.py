# SPDX-License-Identifier: Apache-2.0
"""The GGUF-vs-llama.cpp benchmark's CPU side.

- benchmarks/glm5_llama_cpp_model.py end to end in --small mode: an HF checkpoint,
  llama.cpp's converter (the pinned sdist's) and llama-quantize Q4_K_M (and a variant of
  it with layer 1's down projections at Q6_K, as Q4_K_M gives its last layer), and IQ2_M with
  an importance matrix from llama-imatrix (both built from the sdist); the GGUF's
  metadata and tensor shapes (read with the converter's gguf-py) must be the requested
  dimensions, and the full-size model's checkpoint names and shapes (transformers'
  GlmMoeDsa on the meta device) GLM-5's.
- benchmarks/glm5_vs_llama_cpp.py's parsing of llama-bench's `-o json` (a sample with
  llama-bench.cpp's field list, json_printer's layout) and the ratios against the
  issue's targets.
"""

import json
import math
import subprocess
import types
from pathlib import Path

import pytest

from benchmarks import glm5_llama_cpp_model as gen
from benchmarks import glm5_vs_llama_cpp as bench


def test_full_size_checkpoint_is_glm5_shaped():
    cfg = gen.glm5_config(3)
    shapes = gen.checkpoint_tensors(cfg)
    h, heads, experts = 6144, 64, 256
    assert shapes["model.layers.0.self_attn.q_a_proj.weight"] == (2048, h)
    assert shapes["model.layers.0.self_attn.q_b_proj.weight"] == (heads * (192 + 64), 2048)
    assert shapes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (512 + 64, h)
    assert shapes["model.layers.0.self_attn.kv_b_proj.weight"] == (heads * (192 + 256), 512)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (h, heads * 256)
    assert shapes["model.layers.0.self_attn.indexer.wq_b.weight"] == (32 * 128, 2048)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (12288, h)  # dense first layer
    for layer in (1, 2):
        prefix = f"model.layers.{layer}.mlp."
        assert shapes[prefix + "gate.weight"] == (experts, h)
        assert shapes[prefix + "shared_experts.up_proj.weight"] == (2048, h)
        ups = [n for n in shapes if n.startswith(prefix + "experts.") and "up_proj" in n]
        assert len(ups) == experts and shapes[prefix + "experts.255.down_proj.weight"] == (h, 2048)
    assert not any(n.startswith("model.layers.0.mlp.experts") for n in shapes)
    assert shapes["lm_head.weight"] == (154880, h)
    assert cfg["num_experts_per_tok"] == 8 and cfg["n_shared_experts"] == 1
    assert cfg["index_topk"] == 2048 and cfg["num_hidden_layers"] == 3
    params = sum(math.prod(s) for s in shapes.values())
    assert 21e9 < params < 23e9  # 2 MoE layers of 256 x 3 x 6144 x 2048 dominate


def test_init_and_space_check(tmp_path):
    import torch

    g = torch.Generator().manual_seed(0)
    assert torch.equal(gen.init_tensor("model.norm.weight", (8,), g),
                       torch.ones(8, dtype=torch.bfloat16))
    assert not gen.init_tensor("model.layers.1.mlp.gate.e_score_correction_bias", (8,), g).any()
    w = gen.init_tensor("lm_head.weight", (4096, 256), g).float()
    assert abs(w.std().item() - 4.0 / 16) < 0.01
    w = gen.init_tensor("model.layers.0.mlp.down_proj.weight", (1024, 512), g).float()
    assert abs(w.std().item() - 0.5 / 512 ** 0.5) < 0.002
    plan = gen.disk_plan(10 ** 15, "bf16", ["Q4_K_M"])
    with pytest.raises(SystemExit, match="GiB free"):
        gen.check_space(plan, tmp_path / "work", tmp_path / "out", "bf16", keep=False)
    gen.check_space(gen.disk_plan(1000, "bf16", ["Q4_K_M"]), tmp_path / "work",
                    tmp_path / "out", "bf16", keep=False)


def test_space_check_by_filesystem(tmp_path, monkeypatch):
    # the checkpoint in memory (work, 160 GiB free), the quants on a disk of 40: a
    # 50 GiB intermediate fits only beside the checkpoint
    import collections
    import os
    import tempfile

    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the temporary folder")
    work, out = Path(tempfile.mkdtemp(dir="/dev/shm")), tmp_path / "disk"
    try:
        gib = 2 ** 30
        free = {os.stat(work).st_dev: 160 * gib, os.stat(tmp_path).st_dev: 40 * gib}
        usage = collections.namedtuple("usage", "free")
        monkeypatch.setattr(gen.shutil, "disk_usage", lambda p: usage(free[os.stat(p).st_dev]))
        plan = {"checkpoint": 100 * gib, "q8_0": 50 * gib, "Q4_K_M": 30 * gib}
        with pytest.raises(SystemExit, match=r"needs about 50\.0 GiB free on .*disk's"):
            gen.check_space(plan, work, out, "q8_0", keep=False)
        gen.check_space(plan, work, out, "q8_0", keep=False, inter_dir=work)
        free[os.stat(work).st_dev] = 140 * gib  # checkpoint and intermediate together
        with pytest.raises(SystemExit, match=r"needs about 150\.0 GiB free on /dev/shm"):
            gen.check_space(plan, work, out, "q8_0", keep=False, inter_dir=work)
    finally:
        os.rmdir(work)


def test_small_gguf_end_to_end(tmp_path):
    out = tmp_path / "out"
    report = gen.main(["--small", "--out", str(out), "--quants", "Q4_K_M", "--layers", "3",
                       "--experts", "16", "--variant", r"q6down:blk\.1\.ffn_down=q6_k"])
    q4 = Path(report["files"]["Q4_K_M"]["path"])
    # checkpoint and bf16 removed
    assert sorted(report["files"]) == ["Q4_K_M", "Q4_K_M-q6down"]
    assert not (out / "glm5-shaped-small-3L-bf16.gguf").exists()
    assert not (out / "work" / "glm5-shaped-small-3L-hf").exists()
    assert json.loads((out / "model.json").read_text())["params"] == report["params"]
    gguf = gen.gr.gguf_module(gen.gr.llama_cpp_dir(out / "work"))
    reader = gguf.GGUFReader(q4)
    meta = {f.name: f.contents() for f in reader.fields.values()}
    cfg = report["config"]
    a = "glm-dsa."
    expect = {
        "general.architecture": "glm-dsa",
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_Q4_K_M),
        a + "block_count": 3, a + "leading_dense_block_count": 1,
        a + "embedding_length": cfg["hidden_size"], a + "vocab_size": cfg["vocab_size"],
        a + "feed_forward_length": cfg["intermediate_size"],
        a + "attention.head_count": cfg["num_attention_heads"],
        a + "attention.q_lora_rank": cfg["q_lora_rank"],
        a + "attention.kv_lora_rank": 512,
        a + "attention.key_length": 512 + 64, a + "attention.key_length_mla": 192 + 64,
        a + "attention.value_length_mla": 256, a + "rope.dimension_count": 64,
        a + "expert_count": 16, a + "expert_used_count": cfg["num_experts_per_tok"],
        a + "expert_shared_count": 1,
        a + "expert_feed_forward_length": cfg["moe_intermediate_size"],
        a + "attention.indexer.head_count": cfg["index_n_heads"],
        a + "attention.indexer.key_length": 128,
        a + "attention.indexer.top_k": cfg["index_topk"],
    }
    assert {k: meta.get(k) for k in expect} == expect
    tensors = {t.name: t for t in reader.tensors}
    h, e, m = cfg["hidden_size"], 16, cfg["moe_intermediate_size"]
    for layer in (1, 2):
        t = tensors[f"blk.{layer}.ffn_up_exps.weight"]
        assert [int(d) for d in t.shape] == [h, m, e]
        assert t.tensor_type in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K,
                                 gguf.GGMLQuantizationType.Q6_K)
    assert "blk.0.ffn_up_exps.weight" not in tensors and "blk.0.ffn_up.weight" in tensors
    assert [int(d) for d in tensors["blk.0.ffn_up.weight"].shape] == [h, cfg["intermediate_size"]]
    assert [int(d) for d in tensors["blk.2.indexer.attn_q_b.weight"].shape] == [
        cfg["q_lora_rank"], cfg["index_n_heads"] * 128]
    assert sum(t.tensor_type == gguf.GGMLQuantizationType.Q4_K for t in reader.tensors) >= 10
    # Q4_K_M gives the last of 3 layers Q6_K down projections (llama.cpp's use_more_bits),
    # not layer 1; the variant gives layer 1 the same and changes nothing else
    Q4, Q6 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    types = {t.name: t.tensor_type for t in reader.tensors}
    variant = {t.name: t.tensor_type for t in gguf.GGUFReader(
        report["files"]["Q4_K_M-q6down"]["path"]).tensors}
    down = [f"blk.{i}.ffn_down_{k}.weight" for i in (1, 2) for k in ("exps", "shexp")]
    assert [types[n] for n in down] == [Q4, Q4, Q6, Q6]
    assert [variant[n] for n in down] == [Q6, Q6, Q6, Q6]
    assert {n: t for n, t in variant.items() if n not in down[:2]} == {
        n: t for n, t in types.items() if n not in down[:2]}
    with pytest.raises(SystemExit):
        gen.main(["--small", "--out", str(out), "--variant", "q6 down:ffn_down=q6_k"])


def test_small_iq2_m_with_imatrix(tmp_path):
    report = gen.main(["--small", "--out", str(tmp_path), "--quants", "IQ2_M"])
    gguf = gen.gr.gguf_module(gen.gr.llama_cpp_dir(tmp_path / "work"))
    reader = gguf.GGUFReader(report["files"]["IQ2_M"]["path"])
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_IQ2_M)
    assert "quantize.imatrix.file" in reader.fields
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.1.ffn_up_exps.weight"] == gguf.GGMLQuantizationType.IQ2_S


# llama-bench.cpp's test::get_fields(), in order; json_printer writes each, then samples
FIELDS = [
    "build_commit", "build_number", "cpu_info", "gpu_info", "backends", "model_filename",
    "model_type", "model_size", "model_n_params", "n_batch", "n_ubatch", "n_threads",
    "cpu_mask", "cpu_strict", "poll", "type_k", "type_v", "n_gpu_layers", "n_cpu_moe",
    "split_mode", "main_gpu", "no_kv_offload", "flash_attn", "devices", "tensor_split",
    "tensor_buft_overrides", "load_mode", "lazy_mode", "embeddings", "no_op_offload",
    "no_host", "repack", "fit_target", "fit_min_ctx", "n_prompt", "n_gen", "n_depth",
    "test_time", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts",
]


def bench_test(n_prompt, n_gen, n_depth, avg_ts, n_ubatch=512):
    n = n_prompt + n_gen
    values = {f: 0 for f in FIELDS} | {
        "build_commit": "abc1234", "build_number": 1, "cpu_info": "x", "gpu_info": "NVIDIA H200",
        "backends": "CUDA", "model_filename": "m.gguf", "model_type": "glm-dsa ?B Q4_K - Medium",
        "cpu_mask": "0x0", "cpu_strict": False, "type_k": "f16", "type_v": "f16",
        "split_mode": "layer", "no_kv_offload": False, "devices": "auto", "tensor_split": "0.00",
        "tensor_buft_overrides": "none", "load_mode": "mmap", "lazy_mode": "auto",
        "embeddings": False, "n_batch": 8192, "n_ubatch": n_ubatch, "n_gpu_layers": 999,
        "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": n_depth,
        "test_time": "2026-12-02T00:00:00Z", "avg_ns": int(n / avg_ts * 1e9),
        "stddev_ns": 1000, "avg_ts": avg_ts, "stddev_ts": 0.5}
    body = ",\n".join(f"    {json.dumps(f)}: {json.dumps(values[f])}" for f in FIELDS)
    return (f"  {{\n{body},\n    \"samples_ns\": [ 1, 2 ],\n"
            f"    \"samples_ts\": [ {avg_ts}, {avg_ts} ]\n  }}")


def bench_output(tests):
    return "[\n" + ",\n".join(bench_test(*t) for t in tests) + "\n]\n"


PP = bench_output([(512, 0, 0, 4000.0, 512), (8192, 0, 0, 3000.0, 512),
                   (512, 0, 0, 4100.0, 2048), (8192, 0, 0, 3500.0, 2048)])
TG = bench_output([(0, 128, 0, 100.0), (0, 128, 8192, 80.0)])


def test_parse_llama_bench():
    rows = bench.parse_llama_bench("ggml_cuda_init: found 1 CUDA devices\n" + PP)
    assert [(r["kind"], r["n_prompt"], r["n_ubatch"], r["avg_ts"]) for r in rows] == [
        ("pp", 512, 512, 4000.0), ("pp", 8192, 512, 3000.0), ("pp", 512, 2048, 4100.0),
        ("pp", 8192, 2048, 3500.0)]
    rows += bench.parse_llama_bench(TG)
    # a -pg test (prompt and generation together) is not one of the cases
    rows += bench.parse_llama_bench(bench_output([(512, 128, 0, 999.0)]))
    figures = bench.llama_figures(rows)
    assert figures == {"prefill": {512: 4100.0, 8192: 3500.0}, "decode": {0: 100.0, 8192: 80.0}}
    with pytest.raises(ValueError):
        bench.parse_llama_bench("error: failed to load model\n")


def test_llama_bench_commands():
    pp, tg = bench.llama_bench_cmds("llama-bench", "m.gguf", [512, 8192], [0, 8192], 128)
    def flag(cmd, f):
        return cmd[cmd.index(f) + 1]
    assert (flag(pp, "-p"), flag(pp, "-n"), flag(pp, "-d"), flag(pp, "-o")) == (
        "512,8192", "0", "0", "json")
    assert int(flag(pp, "-b")) >= 8192
    assert (flag(tg, "-p"), flag(tg, "-n"), flag(tg, "-d")) == ("0", "128", "0,8192")


# batched-bench.cpp's jsonl line (its LOG format), between its other log lines
def batched_line(pp, pl, speed_tg, tg=128):
    return ('{"n_kv_max": 300000, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, '
            '"is_pp_shared": 0, "n_gpu_layers": 999, "n_threads": 16, "n_threads_batch": 16, '
            f'"pp": {pp}, "tg": {tg}, "pl": {pl}, "n_kv": {pl * (pp + tg)}, "t_pp": 0.5, '
            f'"speed_pp": 1000.000000, "t_tg": {pl * tg / speed_tg:.6f}, '
            f'"speed_tg": {speed_tg:.6f}, "t": 2.0, "speed": 900.0}}')


BATCHED = "\n".join(["main: n_kv_max = 300000", batched_line(1, 8, 160.0),
                      batched_line(1, 32, 80.0), batched_line(8192, 8, 100.0),
                      batched_line(8192, 32, 130.0), "llama_perf_context_print: ..."])


def test_batched_bench_command_and_rows():
    cmd = bench.batched_bench_cmd("bin/llama-batched-bench", "m.gguf", [0, 8192], [8, 32], 128)

    def flag(f):
        return cmd[cmd.index(f) + 1]
    assert (flag("-npp"), flag("-ntg"), flag("-npl"), flag("--output-format")) == (
        "1,8192", "128", "8,32", "jsonl")
    assert int(flag("-c")) >= 32 * (8192 + 128)  # every sequence fits the context
    assert "-kvu" in cmd
    rows = bench.parse_batched_bench(BATCHED)
    assert [(r["pp"], r["pl"]) for r in rows] == [(1, 8), (1, 32), (8192, 8), (8192, 32)]
    assert bench.batched_figures(rows) == {0: {8: 160.0, 32: 80.0},
                                           8192: {8: 100.0, 32: 130.0}}
    with pytest.raises(ValueError, match="no jsonl rows"):
        bench.parse_batched_bench("main: error: unable to load model")


def test_llama_profile_runs():
    """The profiled llama.cpp runs: at batch 1 llama-bench's depth-0 decode (a warm-up
    token and LLAMA_PROFILE_GEN), at batch 32 llama-batched-bench's (a 16-token warm-up
    pass, the 32 one-token prompts' pass, LLAMA_PROFILE_GEN of 32 tokens); the prefill
    llama-bench's either way; the extra arguments on every run."""
    gen = bench.LLAMA_PROFILE_GEN

    def flag(cmd, f):
        return cmd[cmd.index(f) + 1]
    one = bench.llama_profile_runs("llama-bench", "m.gguf", 512, extra=["-fa", "1"])
    (decode, steps), (prefill, one_step) = one["decode"], one["prefill"]
    assert decode[0] == "llama-bench" and steps == gen + 1 and one_step == 1
    assert (flag(decode, "-p"), flag(decode, "-n"), flag(decode, "-d")) == ("0", str(gen), "0")
    assert (flag(prefill, "-p"), flag(prefill, "-n")) == ("512", "0")
    wide = bench.llama_profile_runs("llama-bench", "m.gguf", 512, 32, "llama-batched-bench",
                                    extra=["-fa", "1"])
    decode, steps = wide["decode"]
    assert decode[0] == "llama-batched-bench" and steps == gen + 2
    assert (flag(decode, "-npp"), flag(decode, "-ntg"), flag(decode, "-npl")) == (
        "1", str(gen), "32")
    assert int(flag(decode, "-c")) >= 32 * (1 + gen)
    assert wide["prefill"] == one["prefill"]
    assert all(run[-2:] == ["-fa", "1"] for run, _ in [*one.values(), *wide.values()])


def test_profile_batch_arguments(capsys):
    """A profiled batch the engine's max_num_seqs (the largest of --batches) cannot hold,
    or one above 1 where llama.cpp is profiled without llama-batched-bench: refused, with
    a message naming it, before anything runs."""
    base = ["--gguf", "m.gguf", "--profile", "--batches", "1", "32"]
    with pytest.raises(SystemExit):
        bench.main([*base, "--profile-batch", "64"])
    assert "largest of --batches" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main([*base, "--profile-batch", "32", "--llama-profile", "ncu",
                    "--llama-bench", "llama-bench"])
    assert "through --llama-batched-bench" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # any of several
        bench.main([*base, "--profile-batch", "1", "64"])
    assert "largest of --batches" in capsys.readouterr().err


def test_several_profiled_batches(monkeypatch, tmp_path):
    """--profile-batch 1 32: llama.cpp profiled at each batch (llama-bench at 1,
    llama-batched-bench at 32, each kind keyed by its batch) and the prefill once, and every
    path's worker asked for both batches."""
    profiled, workers, real_run = {}, [], subprocess.run

    def fake_profiles(ncu, runs):
        profiled.update(runs)
        return {kind: {"launches": 1, "steps": steps, "gpu_us_per_step": 1.0, "shares": {}}
                for kind, (_, steps) in runs.items()}

    def fake_run(cmd, **kw):
        if "--path" in cmd:
            workers.append(cmd)
            Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps({"rows": []}))
            return subprocess.CompletedProcess(cmd, 0, "", "")
        if cmd[0] == "llama-batched-bench":
            return subprocess.CompletedProcess(cmd, 0, BATCHED, "")
        return real_run(cmd, **kw)  # what vLLM's imports run

    monkeypatch.setattr(bench, "llama_profiles", fake_profiles)
    monkeypatch.setattr(bench, "run_llama_bench", lambda args: ([], []))
    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    import vllm_gguf_plugin.gguf_model as gm
    monkeypatch.setattr(gm, "config_from_gguf",
                        lambda f: types.SimpleNamespace(num_hidden_layers=10))
    report = bench.main(["--gguf", str(gguf), "--paths", "sm120", "--batches", "1", "32",
                         "--profile", "--profile-batch", "1", "32", "--llama-profile", "ncu",
                         "--llama-bench", "llama-bench", "--llama-batched-bench",
                         "llama-batched-bench", "--prompts", "512", "--depths", "0"])
    assert set(profiled) == {"decode b1", "decode b32", "prefill"}
    assert profiled["decode b1"][0][0] == "llama-bench"
    assert profiled["decode b32"][0][0] == "llama-batched-bench"
    profiles = report["llama_cpp"]["profiles"]
    assert (profiles["decode b1"]["batch"], profiles["decode b32"]["batch"]) == (1, 32)
    (cmd,) = workers
    at = cmd.index("--profile-batch")
    assert cmd[at + 1:at + 3] == ["1", "32"]


def test_ratios_against_targets():
    llama = bench.llama_figures(bench.parse_llama_bench(PP) + bench.parse_llama_bench(TG))
    llama["aggregate"] = bench.batched_figures(bench.parse_batched_bench(BATCHED))
    rows = [{"kind": "prefill", "prompt": 512, "tok_s": 8200.0},
            {"kind": "prefill", "prompt": 8192, "tok_s": 1750.0}]
    for depth, per_batch in ((0, {1: 120.0, 8: 500.0, 32: 200.0}),
                             (8192, {1: 40.0, 8: 300.0, 32: 400.0})):
        rows += [{"kind": "decode", "depth": depth, "batch": b, "tok_s": v}
                 for b, v in per_batch.items()]
    got = {(r["name"], r.get("depth", r.get("prompt"))): r
           for r in bench.ratios(llama, bench.vllm_figures(rows))}
    assert got[("decode_b1", 0)]["ratio"] == pytest.approx(1.2)
    assert got[("decode_b1", 0)]["meets_target"] is True
    assert got[("decode_b1", 8192)]["ratio"] == pytest.approx(0.5)
    assert got[("decode_b1", 8192)]["target"] == 1.2  # at depth 8192: 1.2x
    assert got[("decode_b1", 8192)]["meets_target"] is False
    # batch 32's aggregate against llama-batched-bench's at 32, no target of its own
    assert got[("decode_b32_aggregate", 0)]["ratio"] == pytest.approx(2.5)
    assert got[("decode_b32_aggregate", 8192)]["ratio"] == pytest.approx(400 / 130)
    assert got[("decode_b8_aggregate", 0)]["ratio"] == pytest.approx(500 / 160)
    assert all(got[(f"decode_b{b}_aggregate", d)]["target"] is None
               for b in (8, 32) for d in (0, 8192))
    # 32 sequences against llama.cpp's best at the depth: batch 8 at depth 0 (160 over
    # tg's 100 and batch 32's 80): 200/160 < 3; batch 32 at 8192 (130 over 80 and 100)
    best0, best8k = got[("decode_b32_vs_best", 0)], got[("decode_b32_vs_best", 8192)]
    assert (best0["llama_batch"], best0["llama_tok_s"]) == (8, 160.0)
    assert best0["ratio"] == pytest.approx(1.25) and best0["meets_target"] is False
    assert (best8k["llama_batch"], best8k["llama_tok_s"]) == (32, 130.0)
    assert best8k["ratio"] == pytest.approx(400 / 130) and best8k["meets_target"] is True
    assert got[("prefill", 512)]["ratio"] == pytest.approx(2.0)  # against the best ubatch
    assert got[("prefill", 512)]["target"] == 1.0
    assert got[("prefill", 8192)]["target"] == 1.5
    assert got[("prefill", 8192)]["meets_target"] is False
    assert len(got) == 10
    md = bench.markdown({"paths": {"portable": {"settings": "x", "ratios": list(got.values())},
                                   "upstream": {"error": "boom", "ratios": []}}})
    assert "| decode batch 32 at depth 8192 | 400.0 | 130.0 | 3.08 | - |" in md
    assert ("| decode batch 32 at depth 8192, llama.cpp's best (batch 32) | 400.0 | 130.0 | "
            "3.08 | >= 3x: met |") in md
    assert ("| decode batch 32 at depth 0, llama.cpp's best (batch 8) | 200.0 | 160.0 | "
            "1.25 | >= 3x: not met |") in md
    assert "| prefill 8192 | 1750.0 | 3500.0 | 0.50 | >= 1.5x: not met |" in md
    assert "**upstream**: failed" in md
    # a case llama.cpp did not measure, or a run without it, keeps the overlay's figure
    figures = {"prefill": {512: 900.0}, "decode": {0: {1: 120.0, 8: 500.0}}}
    md = bench.markdown({"paths": {"portable": {"settings": "x", "figures": figures,
                                                "ratios": [got[("prefill", 512)]]}}})
    prefill = [line for line in md.splitlines() if line.startswith("| prefill 512 |")]
    assert len(prefill) == 1 and "| - |" not in prefill[0]  # the compared row only
    assert "| decode batch 1 at depth 0 | 120.0 | - | - | - |" in md
    assert "| decode batch 8 at depth 0 | 500.0 | - | - | - |" in md
    assert "load" not in md  # rows without the host's load (earlier reports)
    rows_ = [{"kind": "decode", "load_1m": 14.26}, {"kind": "prefill", "load_1m": 0.52}]
    md = bench.markdown({"paths": {"portable": {"settings": "x", "rows": rows_, "ratios": []}}})
    assert "The host's load (1-minute average) over the rows: 0.5-14.3" in md
    shares = bench.kernel_shares([("moe_vec_q", 1.0)])
    md = bench.markdown({"paths": {"portable": {
        "settings": "x", "ratios": [], "profile_decode": {
            "depth": 0, "gpu_us_per_step": 1660.4, "shares": shares}}},
        "llama_cpp": {"profiles": {"decode": {"launches": 1035, "steps": 9,
                                              "gpu_us_per_step": 1031.7, "shares": shares}}}})
    assert "GPU time of a decode step (batch 1, depth 0), 1660 us: indexer 0%" in md
    assert "llama.cpp decode (ncu, 1035 launches over 9 steps, 1032 us a step)" in md
    assert "Host work" not in md  # profiles without the host sections (earlier reports)
    host = {"gpu_model_runner: preprocess": 612.4, "gpu_model_runner: sample": 80.0}
    md = bench.markdown({"paths": {"portable": {"settings": "x", "ratios": [], "profile_decode": {
        "depth": 0, "gpu_us_per_step": 1660.4, "shares": shares, "host_us_per_step": host}}}})
    assert ("Host work of a decode step (CPU us in vLLM's sections): "
            "gpu_model_runner: preprocess 612, gpu_model_runner: sample 80") in md
    md = bench.markdown({"paths": {"portable": {
        "settings": "x", "ratios": [], "profile_decode": {
            "depth": 0, "batch": 32, "gpu_us_per_step": 5100.0, "shares": shares}}},
        "llama_cpp": {"profiles": {"decode": {"launches": 900, "steps": 10, "batch": 32,
                                              "gpu_us_per_step": 7900.0, "shares": shares}}}})
    assert "GPU time of a decode step (batch 32, depth 0), 5100 us" in md
    assert "llama.cpp decode at batch 32 (ncu, 900 launches over 10 steps, 7900 us" in md
    # several profiled batches (--profile-batch 1 32): a line each, both engines
    md = bench.markdown({"paths": {"sm120": {
        "settings": "x", "ratios": [], "profile_decodes": [
            {"depth": 0, "batch": 1, "gpu_us_per_step": 3300.0, "shares": shares,
             "host_us_per_step": host},
            {"depth": 0, "batch": 32, "gpu_us_per_step": 20100.0, "shares": shares}]}},
        "llama_cpp": {"profiles": {
            "decode b1": {"launches": 800, "steps": 9, "batch": 1, "gpu_us_per_step": 3600.0,
                          "shares": shares},
            "decode b32": {"launches": 900, "steps": 10, "batch": 32,
                           "gpu_us_per_step": 41000.0, "shares": shares}}}})
    assert "\nGPU time of a decode step (batch 1, depth 0), 3300 us" in md
    assert "\nGPU time of a decode step (batch 32, depth 0), 20100 us" in md
    assert md.count("Host work of a decode step") == 1
    assert "llama.cpp decode (ncu, 800 launches over 9 steps, 3600 us a step)" in md
    assert "llama.cpp decode at batch 32 (ncu, 900 launches over 10 steps, 41000 us" in md
    # cases only one side measured are left out
    only_depth0 = bench.vllm_figures(rows[2:3])
    assert bench.ratios({"prefill": {}, "decode": {8192: 100.0}}, only_depth0) == []


def test_llama_figures_from_an_earlier_report(tmp_path):
    """--llama-from: llama.cpp's figures of an earlier report of the same file, as the
    ratios need them (integer keys where JSON wrote strings); another file, another size
    of it or a report without llama.cpp stop with a message naming it."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    figures = {"prefill": {512: 2000.0}, "decode": {0: 100.0, 8192: 80.0},
               "aggregate": {0: {8: 300.0, 32: 400.0}}}
    earlier = tmp_path / "2L.json"
    earlier.write_text(json.dumps({"args": {"gguf": str(gguf)}, "gguf_bytes": 64,
                                   "llama_cpp": {"commands": ["llama-bench"], "figures": figures}}))
    part, llama = bench.llama_from(str(earlier), str(gguf))
    assert llama == figures and part["from"] == str(earlier)
    assert part["commands"] == ["llama-bench"]
    ours = {"prefill": {512: 1000.0}, "decode": {0: {1: 50.0, 32: 1200.0}}}
    got = {(r["name"], r.get("depth", r.get("prompt"))): r["ratio"]
           for r in bench.ratios(llama, ours)}
    # llama.cpp's best at depth 0: batch 32's 400 (tg 100, batch 8 300)
    assert got == {("decode_b1", 0): 0.5, ("decode_b32_aggregate", 0): 3.0,
                   ("decode_b32_vs_best", 0): 3.0, ("prefill", 512): 0.5}
    gguf.write_bytes(b"GGUF" + bytes(61))
    with pytest.raises(SystemExit, match="65|64 bytes"):
        bench.llama_from(str(earlier), str(gguf))
    with pytest.raises(SystemExit, match="not"):
        bench.llama_from(str(earlier), str(tmp_path / "other.gguf"))
    earlier.write_text(json.dumps({"args": {"gguf": str(gguf)}, "gguf_bytes": 65}))
    with pytest.raises(SystemExit, match="no llama.cpp figures"):
        bench.llama_from(str(earlier), str(gguf))


def test_decode_row_keeps_the_fastest_run():
    """A decode case runs REPS times: the row is the fastest run's (the first may pay a
    one-time cost mid-decode, e.g. a kernel compiled for a new batch size), with every
    run's step."""
    from types import SimpleNamespace

    def outs(step_s, cached, tokens=((5,) * 129, (5,) * 129)):  # 2 requests, 129 tokens each
        metrics = SimpleNamespace(first_token_ts=1.0, last_token_ts=1.0 + 128 * step_s,
                                  num_generation_tokens=129)
        return [SimpleNamespace(metrics=metrics, num_cached_tokens=cached,
                                outputs=[SimpleNamespace(token_ids=list(t))]) for t in tokens]

    apart = ((5,) * 129, (5,) * 43 + (6,) * 86)  # the same token at 43 of 129 positions
    reps = [(1.4, outs(0.0044, 0)), (0.4, outs(0.0028, 63, apart)), (0.5, outs(0.0030, 63))]
    row = bench.decode_row(64, 2, 128, 64, reps)
    assert row["step_ms"] == pytest.approx(2.8) and row["tok_s"] == pytest.approx(2 / 0.0028)
    assert row["wall_s"] == 0.4 and row["cached_prompt_tokens"] == 126
    assert row["step_ms_reps"] == pytest.approx([4.4, 2.8, 3.0])
    assert row["prompt_tokens"] == 128 and (row["depth"], row["batch"]) == (64, 2)
    assert row["distinct_tokens_reps"] == pytest.approx([1.0, 1 + 86 / 129, 1.0])


def test_kernel_shares():
    shares = bench.kernel_shares([("fused_moe_kernel", 50.0), ("_sparse_mla_decode_kernel", 20.0),
                                  ("triton_indexer_logits_decode", 10.0), ("gemv_bf16", 20.0)])
    assert shares == pytest.approx({"moe": 0.5, "attention": 0.2, "indexer": 0.1,
                                    "quantized": 0.0, "gemm16": 0.0, "other": 0.2})


def test_kernel_classes_of_both_engines():
    """The plugin's and llama.cpp's kernel names land in the same classes: quantized
    products (MMVQ/MMQ and their activation quantization), MoE, 16-bit GEMMs."""
    names = {"void mul_mat_vec_q<(ggml_type)12, 1, false>(...)": "quantized",
             "void mul_mat_q<(ggml_type)14, 64, false>(...)": "quantized",
             "void quantize_mmq_q8_1<(mmq_q8_1_ds_layout)1>(...)": "quantized",
             "dequantize_block_q4_K": "quantized",
             "_q4_k_kernel": "quantized", "_q6_k_kernel": "quantized",
             "moe_vec_q4_K_q8_1": "moe",
             "void flash_attn_ext_f16<576, 512, 4, 8, 64, 1, false>(...)": "attention",
             "sm90_xmma_gemm_bf16bf16_bf16f32": "gemm16",
             "nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NNT": "gemm16",
             "rms_norm_f32<1024>": "other"}
    for name, cls in names.items():
        shares = bench.kernel_shares([(name, 1.0)])
        assert shares[cls] == 1.0, (name, shares)


def test_ncu_csv():
    text = "\n".join([
        "==PROF== Connected to process 42",
        '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
        '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
        '"Metric Value"',
        '"0","42","llama-bench","h","mul_mat_vec_q","1","7","(32, 1, 1)","(1, 1, 1)","0",'
        '"9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","12.50"',
        '"1","42","llama-bench","h","rms_norm_f32","1","7","(32, 1, 1)","(1, 1, 1)","0",'
        '"9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","1,500"',
        '"2","42","llama-bench","h","mul_mat_vec_q","1","7","(32, 1, 1)","(1, 1, 1)","0",'
        '"9.0","Command line profiler metrics","gpu__time_duration.sum","msecond","0.01"',
        # ncu 2025 (the H200 host's) writes the short unit names
        '"3","42","llama-bench","h","rms_norm_f32","1","7","(32, 1, 1)","(1, 1, 1)","0",'
        '"9.0","Command line profiler metrics","gpu__time_duration.sum","ns","2,500"'])
    kernels = bench.ncu_kernels(text)
    assert kernels == [("mul_mat_vec_q", 12.5), ("rms_norm_f32", 1.5), ("mul_mat_vec_q", 10.0),
                       ("rms_norm_f32", 2.5)]
    assert bench.summed(kernels) == [("mul_mat_vec_q", 22.5), ("rms_norm_f32", 4.0)]
    summary = bench.profile_summary(kernels, steps=2)
    assert summary["gpu_us"] == pytest.approx(26.5)
    assert summary["gpu_us_per_step"] == pytest.approx(13.25)
    assert summary["shares"]["quantized"] == pytest.approx(22.5 / 26.5)
    with pytest.raises(ValueError, match="no gpu__time_duration"):
        bench.ncu_kernels("==PROF== nothing")


def test_trace_gpu_activities(tmp_path):
    """GPU activities from the torch profiler traces vLLM's profiler_config writes, only
    those that appeared since the call's start: kernels, copies and sets, no CPU ops."""
    import gzip

    def trace(name, events):
        with gzip.open(tmp_path / name, "wt") as f:
            json.dump({"traceEvents": events}, f)

    trace("rank0.1.pt.trace.json.gz", [{"cat": "kernel", "name": "old", "dur": 5.0}])
    before = set(tmp_path.glob("*"))
    trace("rank0.2.pt.trace.json.gz", [
        {"cat": "kernel", "name": "moe_vec_q", "dur": 7.5},
        {"cat": "cpu_op", "name": "aten::mm", "dur": 90.0},
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "dur": 1.0},
        {"cat": "kernel", "name": "moe_vec_q", "dur": 2.5},
        {"cat": "ac2g", "name": "flow"}])
    assert bench.gpu_activities(bench.trace_events(tmp_path, before)) == [
        ("moe_vec_q", 7.5), ("Memcpy HtoD (Pinned -> Device)", 1.0), ("moe_vec_q", 2.5)]
    with pytest.raises(RuntimeError, match="no new profiler trace"):
        bench.trace_events(tmp_path, set(tmp_path.glob("*")))
    with pytest.raises(RuntimeError, match="no GPU activity"):
        bench.gpu_activities([{"cat": "cpu_op", "name": "aten::mm", "dur": 90.0}])


def test_host_sections():
    """vLLM's annotated host sections a step, summed by name over the trace's steps,
    largest first; other CPU events and the GPU side's copies of the annotations
    (gpu_user_annotation) left out."""
    events = [
        {"cat": "user_annotation", "name": "gpu_model_runner: preprocess", "dur": 300.0},
        {"cat": "user_annotation", "name": "gpu_model_runner: sample", "dur": 50.0},
        {"cat": "user_annotation", "name": "gpu_model_runner: preprocess", "dur": 500.0},
        {"cat": "user_annotation", "name": "schedule: allocate_slots", "dur": 20.0},
        {"cat": "gpu_user_annotation", "name": "gpu_model_runner: forward", "dur": 900.0},
        {"cat": "user_annotation", "name": "ProfilerStep#1", "dur": 5000.0},
        {"cat": "cpu_op", "name": "aten::copy_", "dur": 70.0},
        {"cat": "user_annotation", "name": "gpu_model_runner: forward"}]  # no duration
    got = bench.host_sections(events, steps=2)
    assert list(got) == ["gpu_model_runner: preprocess", "gpu_model_runner: sample",
                         "schedule: allocate_slots"]
    assert got == pytest.approx({"gpu_model_runner: preprocess": 400.0,
                                 "gpu_model_runner: sample": 25.0,
                                 "schedule: allocate_slots": 10.0})


def _report(layers, llama_ms, ours_ms):
    """A report as main() writes it (JSON keys as strings), from step times in ms."""
    def tok_s(case, ms):
        n = int(case.split()[1]) if case.startswith("prefill") else int(case.split()[2])
        return 1e3 * n / ms
    llama = {"prefill": {}, "decode": {}, "aggregate": {}}
    ours = {"prefill": {}, "decode": {}}
    for case, ms in llama_ms.items():
        words = case.split()
        if words[0] == "prefill":
            llama["prefill"][words[1]] = tok_s(case, ms)
        elif words[2] == "1":
            llama["decode"][words[-1]] = tok_s(case, ms)
        else:
            llama["aggregate"].setdefault(words[-1], {})[words[2]] = tok_s(case, ms)
    for case, ms in ours_ms.items():
        words = case.split()
        if words[0] == "prefill":
            ours["prefill"][words[1]] = tok_s(case, ms)
        else:
            ours["decode"].setdefault(words[-1], {})[words[2]] = tok_s(case, ms)
    return json.loads(json.dumps({"layers": layers, "llama_cpp": {"figures": llama},
                                  "paths": {"portable": {"figures": ours},
                                            "upstream": {"error": "boom"}}}))


def test_per_layer():
    """Time per added layer on each engine: llama.cpp's fixed costs and its last layer's
    skipped MoE (the same in both files) drop out of the difference."""
    shallow = _report(2, {"prefill 512": 10.0, "decode batch 1 at depth 0": 1.0,
                          "decode batch 32 at depth 0": 8.0},
                      {"prefill 512": 20.0, "decode batch 1 at depth 0": 2.0,
                       "decode batch 32 at depth 0": 10.0, "decode batch 8 at depth 0": 3.0})
    deep = _report(4, {"prefill 512": 18.0, "decode batch 1 at depth 0": 1.5,
                       "decode batch 32 at depth 0": 12.0},
                   {"prefill 512": 26.0, "decode batch 1 at depth 0": 2.4,
                    "decode batch 32 at depth 0": 12.0, "decode batch 8 at depth 0": 3.2})
    got = bench.per_layer(shallow, deep)
    assert got["layers"] == [2, 4]
    assert got["llama_cpp_ms"] == pytest.approx({"prefill 512": 4.0,
                                                  "decode batch 1 at depth 0": 0.25,
                                                  "decode batch 32 at depth 0": 2.0})
    ours = got["paths"]["portable"]
    assert set(got["paths"]) == {"portable"}  # a failed path has no figures
    assert ours["prefill 512"]["ms"] == pytest.approx(3.0)
    assert ours["prefill 512"]["ratio"] == pytest.approx(4.0 / 3.0)
    assert ours["decode batch 1 at depth 0"]["ratio"] == pytest.approx(0.25 / 0.2)
    assert ours["decode batch 32 at depth 0"]["ratio"] == pytest.approx(2.0)
    assert "decode batch 8 at depth 0" not in ours  # llama.cpp did not measure it
    md = bench.per_layer_markdown(got)
    assert "| prefill 512 | 4.000 | 3.000 | 1.33 |" in md
    with pytest.raises(ValueError, match="layers"):
        bench.per_layer(deep, shallow)


def test_only_reports_need_the_test_plugin(monkeypatch):
    """The paths the test plugin reports for need it installed: the as-on-SM120 path (its
    capability) and the portable ones (no DeepGEMM reported, so that the indexer takes its
    Triton kernels on the H200); a path that only sets the overlay's own variables (the
    16-bit key cache's on upstream's path) does not (2026-12-04: such a path refused to
    start for want of it)."""
    from tests.plugins.vllm_report_capability import vllm_report_capability as hook

    monkeypatch.setattr(hook.importlib.util, "find_spec", lambda name: None)
    missing = {p for p in bench.PATHS if bench.capability_plugin_missing(p)}
    assert missing == {"sm120"} | {p for p in bench.PATHS if p.startswith("portable")}
    assert "upstream-keys16" not in missing
    assert bench.path_env("portable-gguf-moe") == {hook.DEEP_GEMM_ENV: "0",
                                                   "VLLM_GGUF_MOE_MARLIN": "0"}
    monkeypatch.setattr(hook.importlib.util, "find_spec", lambda name: object())
    assert not any(bench.capability_plugin_missing(p) for p in bench.PATHS)


def test_depth_model():
    """Fixed plus per-layer cost fitted over three depths and projected to 78 layers:
    exact where the step times lie on a line, with each file's distance from it where
    one does not."""
    def line(fixed, per_layer, layers, off=0.0):
        return fixed + per_layer * layers + off

    reports = [_report(n, {"prefill 512": line(5.0, 2.0, n), "decode batch 1 at depth 0":
                           line(0.5, 0.3, n), "decode batch 32 at depth 0": line(2.0, 1.0, n)},
                       {"prefill 512": line(10.0, 1.0, n), "decode batch 1 at depth 0":
                        line(2.0, 0.2, n, 0.05 if n == 3 else 0.0),
                        "decode batch 32 at depth 0": line(4.0, 0.5, n)})
               for n in (2, 3, 10)]
    got = bench.depth_model(reports)
    assert got["layers"] == [2, 3, 10] and got["project"] == 78
    theirs = got["llama_cpp"]["prefill 512"]
    assert (theirs["fixed"], theirs["per_layer"]) == pytest.approx((5.0, 2.0))
    assert theirs["projected"] == pytest.approx(5.0 + 2.0 * 78)
    assert set(got["paths"]) == {"portable"}  # the failed path has no figures
    ours = got["paths"]["portable"]
    assert ours["prefill 512"]["projected"] == pytest.approx(88.0)
    assert ours["prefill 512"]["ratio"] == pytest.approx(161.0 / 88.0)
    assert ours["decode batch 32 at depth 0"]["ratio"] == pytest.approx(80.0 / 43.0)
    assert all(r == pytest.approx(0.0, abs=1e-12)
               for r in ours["prefill 512"]["residuals"].values())
    # the 3-layer file's step lies 0.05 ms above the others' line: the fit's residuals
    # sum to zero and the 3-layer file's is the positive one
    res = ours["decode batch 1 at depth 0"]["residuals"]
    assert res[3] > 0 and res[2] < 0 and res[10] < 0
    points = {2: 2.4, 3: 2.65, 10: 4.0}
    fixed, per = bench.linear_fit(points)
    assert sum(ms - fixed - per * n for n, ms in points.items()) == pytest.approx(0.0, abs=1e-12)
    # 32 sequences against llama.cpp's best projected aggregate: its batch 32 (400 tok/s
    # over batch 1's 41.8), ours 32 / 43 ms
    (vs,) = got["vs_best"]["portable"]
    assert (vs["depth"], vs["llama_batch"]) == (0, 32)
    assert vs["llama_tok_s"] == pytest.approx(400.0)
    assert vs["ratio"] == pytest.approx(32e3 / 43.0 / 400.0) and vs["meets_target"] is False
    md = bench.depth_model_markdown(got)
    assert "| prefill 512 | 5.000 + 2.000 | 10.000 + 1.000 | 161.00 | 88.00 | 1.83 | +0.0% |" in md
    assert ("32 sequences at depth 0 over llama.cpp's best at 78 layers (its batch 32): "
            "1.86x, target 3x: not met") in md
    with pytest.raises(ValueError, match="different depths"):
        bench.depth_model(reports[:1])
    with pytest.raises(ValueError, match="different depths"):
        bench.depth_model([reports[0], reports[0]])
