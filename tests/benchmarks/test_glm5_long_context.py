# SPDX-License-Identifier: Apache-2.0
"""The long-context benchmark reads vLLM's own figures of its memory from the engine's
log, keeps what names a failure, passes vLLM's defaults through untouched (only the
arguments given reach the engine), and reports a path that died with its rows."""

import json
import sys
from pathlib import Path

import pytest

from benchmarks import glm5_long_context as bench

# lines as vLLM 0.26's worker and engine core write them
LOG = """\
INFO 12-05 13:01:02 [gpu_model_runner.py:4101] Model loading took 11.52 GiB memory and 41.0 seconds
INFO 12-05 13:01:40 [gpu_worker.py:410] Available KV cache memory: 98.31 GiB
INFO 12-05 13:01:40 [kv_cache_utils.py:1310] GPU KV cache size: 2,184,576 tokens
INFO 12-05 13:01:40 [kv_cache_utils.py:1315] Maximum concurrency for 202,752 tokens per request: 10.77x
"""


def test_log_figures():
    assert bench.log_figures(LOG) == {"weights_gib": 11.52, "kv_cache_gib": 98.31,
                                      "kv_cache_tokens": 2184576, "max_concurrency": 10.77}
    assert bench.log_figures("nothing here") == {}


def test_error_lines_name_the_fault():
    log = LOG + "\n".join([
        "Traceback (most recent call last):",
        '  File "/x/vllm/model_executor/layers/sparse_attn_indexer.py", line 580, in f',
        "    torch.ops._C.persistent_topk(",
        "torch.AcceleratorError: CUDA error: an illegal memory access was encountered",
        "INFO unrelated line",
    ])
    lines = bench.error_lines(log)
    # the exception first (the root cause), then the frames
    assert lines[0].startswith("torch.AcceleratorError: CUDA error: an illegal memory")
    assert any("persistent_topk" in ln for ln in lines)
    assert not any("unrelated" in ln for ln in lines)


def run_fake_path(tmp_path, monkeypatch, argv, child):
    """main() with the child process replaced: `child(cmd, out, log)` writes its report
    and its log."""
    seen = {}

    def fake_run(cmd, stdout, stderr, env, timeout):
        seen["cmd"], seen["env"] = cmd, env
        out = Path(cmd[cmd.index("--out") + 1])
        stdout.write(LOG)
        rc = child(cmd, out, stdout)
        stdout.flush()
        return type("Done", (), {"returncode": rc})()

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    report = bench.main(["--gguf", str(gguf), "--json", str(tmp_path / "r.json"), *argv])
    return report, seen


def test_only_given_arguments_reach_the_engine(tmp_path, monkeypatch):
    def child(cmd, out, log):
        out.write_text(json.dumps({"started": True, "rows": [], "max_model_len": 202752}))
        return 0

    report, seen = run_fake_path(tmp_path, monkeypatch, ["--paths", "sm120"], child)
    cmd = seen["cmd"]
    assert cmd[:3] == [sys.executable, "-m", "benchmarks.glm5_long_context"]
    for flag in ("--max-model-len", "--max-num-batched-tokens", "--gpu-memory-utilization",
                 "--eager"):
        assert flag not in cmd
    assert seen["env"]["VLLM_TEST_REPORT_CAPABILITY"] == "12.0"
    assert "CUDA_LAUNCH_BLOCKING" not in seen["env"]
    row = report["paths"]["sm120"]
    assert row["rc"] == 0 and row["kv_cache_tokens"] == 2184576 and "error_lines" not in row
    assert report["overrides"] == {}
    assert json.loads((tmp_path / "r.json").read_text())["paths"]["sm120"]["rc"] == 0


def test_a_path_that_dies_keeps_its_rows(tmp_path, monkeypatch):
    def child(cmd, out, log):
        out.write_text(json.dumps({"started": True, "max_model_len": 131136,
                                   "max_num_batched_tokens": 16384, "rows": [
            {"kind": "prompt", "prompt": 16384, "ttft_s": 1.5, "prefill_tok_s": 10922.7,
             "decode_step_ms": 4.0, "decode_tok_s": 250.0, "cached_tokens": 16384}]}))
        log.write("torch.AcceleratorError: CUDA error: an illegal memory access\n")
        return 1

    argv = ["--paths", "upstream", "--max-model-len", "131136", "--max-num-batched-tokens",
            "16384", "--eager", "--launch-blocking", "--batch", "0"]
    report, seen = run_fake_path(tmp_path, monkeypatch, argv, child)
    cmd = seen["cmd"]
    assert cmd[cmd.index("--max-model-len") + 1] == "131136"
    assert cmd[cmd.index("--max-num-batched-tokens") + 1] == "16384" and "--eager" in cmd
    assert seen["env"]["CUDA_LAUNCH_BLOCKING"] == "1"
    row = report["paths"]["upstream"]
    assert row["rc"] == 1 and row["rows"][0]["prompt"] == 16384
    assert row["error_lines"] == ["torch.AcceleratorError: CUDA error: an illegal memory access"]
    assert report["overrides"] == {"max_model_len": 131136, "max_num_batched_tokens": 16384,
                                   "enforce_eager": True}
    text = bench.markdown(report)
    assert "| upstream | 1 | 131136 | 16384 |" in text and "prompt 16384 | 1.50 | 250.0" in text


def llama_bench_record(depth, gen, prompt, tok_s):
    """One row of `llama-bench -o json` (the fields read, as llama.cpp writes them)."""
    return {"model_filename": "m.gguf", "n_prompt": prompt, "n_gen": gen, "n_depth": depth,
            "avg_ns": int(gen / tok_s * 1e9), "avg_ts": tok_s, "samples_ts": [tok_s]}


def test_llama_cpp_at_the_prompts_depths(tmp_path):
    """llama-bench's decode rows go beside the prompt rows of the same depth, as ratios;
    its prompt-processing rows and depths no prompt ran are left out of the ratios."""
    bench_file = tmp_path / "llama-bench.json"
    bench_file.write_text(json.dumps([
        llama_bench_record(131072, 16, 0, 400.0), llama_bench_record(200000, 16, 0, 250.0),
        llama_bench_record(0, 0, 512, 9000.0), llama_bench_record(65536, 16, 0, 600.0)]))
    report = {"gguf": "/x/m.gguf", "overrides": {}, "paths": {"sm80": {
        "path": "sm80", "rc": 0, "rows": [
            {"kind": "prompt", "prompt": 131072, "ttft_s": 4.5, "decode_tok_s": 500.0},
            {"kind": "prompt", "prompt": 200000, "ttft_s": 4.9, "decode_tok_s": 200.0},
            {"kind": "prompt", "prompt": 16384, "skipped": "longer than max_model_len"},
            {"kind": "batch", "batch": 8, "depth": 32768, "decode_tok_s": 1900.0}]}}}
    (tmp_path / "r.json").write_text(json.dumps(report))
    merged = bench.main(["--from", str(tmp_path / "r.json"), "--llama-bench", str(bench_file),
                         "--json", str(tmp_path / "m.json")])
    rows = merged["paths"]["sm80"]["rows"]
    assert rows[0]["x_llama_cpp"] == 500.0 / 400.0 and rows[1]["x_llama_cpp"] == 200.0 / 250.0
    assert "x_llama_cpp" not in rows[2] and "x_llama_cpp" not in rows[3]
    assert merged["llama_cpp"]["decode_tok_s_by_depth"] == {
        "131072": 400.0, "200000": 250.0, "65536": 600.0}
    assert json.loads((tmp_path / "m.json").read_text()) == merged
    text = bench.markdown(merged)
    assert "prompt 131072 | 4.50 | 500.0 | 400.0 | 1.25 |" in text
    assert "8 x 32768 | - | 1900.0 | - | - |" in text


def test_llama_bench_without_decode_rows_is_refused(tmp_path):
    bench_file = tmp_path / "llama-bench.json"
    bench_file.write_text(json.dumps([llama_bench_record(0, 0, 512, 9000.0)]))
    with pytest.raises(ValueError, match="no decode rows"):
        bench.llama_bench_decode(str(bench_file))
