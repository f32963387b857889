# SPDX-License-Identifier: Apache-2.0
"""benchmarks/llama_cpp_logits.py, which gives llama.cpp's side of the accuracy
comparison (benchmarks/glm5_gguf_accuracy.py), reads llama.cpp's logits at the right
positions: on the CPU build the tests make (libllama.so beside llama-quantize), the tiny
GLM-5's bf16 GGUF against transformers fp32 on the file's dequantized weights, in the
metric of tests/models/glm5_runs.compare().

Measured here (2 cores): 0.18 nats mean; the same logits read one position off give
0.96. The bound sits between them (0.5, and 1.5 times it for the shifted read)."""

import json
import subprocess
import sys
from pathlib import Path

from tests.models.glm5_runs import compare
from tests.models.quantization import gguf_reference as gr

ROOT = Path(__file__).resolve().parents[3]

BOUND = 0.5  # nats, mean |delta logprob| of the prompt tokens


def _run(module, *args):
    res = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]


def test_llama_cpp_cpu_logits_against_fp32(glm5_gguf, tmp_path):
    llama_cpp, model, bf16 = glm5_gguf
    lib = gr.llama_tool("llama").parent
    _run("benchmarks.llama_cpp_logits", "--gguf", bf16, "--lib", lib,
         "--out", tmp_path / "llama.json", "--n-gpu-layers", "0", "--max-tokens", "2")
    ckpt = gr.dequantized_checkpoint(gr.gguf_module(llama_cpp), bf16, model, tmp_path / "deq")
    _run("tests.models.glm5_hf_reference", "--model", ckpt, "--out",
         tmp_path / "ref.json", "--device", "cpu", "--max-tokens", "2")
    ref = json.loads((tmp_path / "ref.json").read_text())
    llama = json.loads((tmp_path / "llama.json").read_text())
    assert llama["engine"] == "llama.cpp"
    assert [o["prompt_len"] for o in llama["outputs"]] == [o["prompt_len"] for o in ref["outputs"]]
    got = compare(ref, llama)
    assert got["mean"] < BOUND, got
    # one position off: the comparison sees it
    for o in llama["outputs"]:
        o["prompt_logprobs"] = [None] + o["prompt_logprobs"][2:] + [o["prompt_logprobs"][-1]]
    assert compare(ref, llama)["mean"] > 1.5 * BOUND


def test_c_runner_gives_the_ctypes_runners_logits(glm5_gguf, tmp_path):
    """--runner c (llama_cpp_logits_server.c over a pipe) makes the same calls as the
    ctypes runner: the same logprobs and tokens, exactly."""
    _, _, bf16 = glm5_gguf
    lib = gr.llama_tool("llama").parent
    runs = {}
    for runner in ("ctypes", "c"):
        out = tmp_path / f"{runner}.json"
        _run("benchmarks.llama_cpp_logits", "--gguf", bf16, "--lib", lib, "--out", out,
             "--n-gpu-layers", "0", "--max-tokens", "2", "--runner", runner)
        runs[runner] = json.loads(out.read_text())["outputs"]
    assert runs["c"] == runs["ctypes"]
