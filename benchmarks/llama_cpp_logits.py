# SPDX-License-Identifier: Apache-2.0
"""llama.cpp's logits on glm5_generate.py's prompts, in glm5_generate.py's output format.

    python -m benchmarks.llama_cpp_logits --gguf FILE.gguf --lib DIR --out OUT.json
        [--bindings DIR] [--max-tokens 32] [--n-gpu-layers 999] [--n-ubatch 512]
        [--runner ctypes|c] [--llama-src DIR]

DIR holds libllama.so (and its libggml*.so) of the pinned llama.cpp, e.g. a shared build
of tools/gpu-host/build-llama-cpp-cuda.sh (SHARED=ON) or of the tests' CPU build. The
bindings are llama-cpp-python's own ctypes module (`llama_cpp/llama_cpp.py` of the
pinned sdist, which matches its vendored llama.cpp): `--bindings` names the sdist's
folder, else it is extracted from build.py's cache. Only that module is loaded, not the
package's high-level API (which needs more packages). `--runner c` instead compiles
llama_cpp_logits_server.c (beside this file) against DIR's libllama.so and the headers of
`--llama-src` (a llama.cpp source tree; else the pinned sdist's, from build.py's cache) and
drives it over a pipe: the same calls, made from C (the CUDA library crashed under ctypes).

For each prompt (glm5_generate.prompts: fixed random token ids): the whole prompt in one
llama_decode with logits for every position, then `--max-tokens` greedy steps of one
token each (as llama.cpp decodes); the top-5 logprobs (log-softmax of the float32
logits) and the prompt token's own, the greedy tokens and their top-5, as
glm5_generate.py writes them, so tests/models/glm5_runs.compare() reads both. Logits
are what llama.cpp computes: its activations' types (int8 for quantized products on
CUDA) and its float32 output.
"""

import argparse
import ctypes
import importlib
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np



def bindings_dir(explicit: str | None) -> Path:
    """The folder holding llama-cpp-python's `llama_cpp/` package (the pinned sdist's)."""
    if explicit:
        return Path(explicit)
    from tests.models.quantization import gguf_reference as gr
    from tools import upstream

    return gr.extract_sdist(upstream.cache_dir() / f"bindings-{gr.SDIST_TOP}", "llama_cpp/")


def llama_headers(explicit: str | None) -> list[Path]:
    """The include folders of llama.h and ggml.h: `explicit` (a llama.cpp source tree) or
    the pinned sdist's vendored llama.cpp, extracted once into build.py's cache."""
    if explicit:
        root = Path(explicit)
    else:
        from tests.models.quantization import gguf_reference as gr
        from tools import upstream

        llama = "vendor/llama.cpp/"
        root = gr.extract_sdist(upstream.cache_dir() / f"headers-{gr.SDIST_TOP}",
                                llama + "include/", llama + "ggml/include/") / llama
    dirs = [root / "include", root / "ggml" / "include"]
    if not (dirs[0] / "llama.h").exists():
        raise FileNotFoundError(f"no include/llama.h under {root}")
    return dirs


def build_server(lib: Path, include: list[Path], out: Path) -> Path:
    """llama_cpp_logits_server.c compiled against lib/libllama.so (found at run time
    through its rpath)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("--runner c needs a C compiler (cc)")
    src = Path(__file__).with_name("llama_cpp_logits_server.c")
    cmd = [cc, "-O2", "-o", str(out), str(src), *(f"-I{d}" for d in include),
           f"-L{lib}", "-lllama", f"-Wl,-rpath,{lib.resolve()}"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"compiling {src.name} failed:\n{res.stderr[-3000:]}")
    return out


class ServerRunner:
    """LlamaRunner's interface over llama_cpp_logits_server (its stdin/stdout); the
    server's log (llama.cpp's) goes to this process's stderr."""

    def __init__(self, server: Path, gguf: str, n_ctx: int, n_batch: int, n_ubatch: int,
                 n_gpu_layers: int):
        self.proc = subprocess.Popen(
            [str(server), gguf, str(n_gpu_layers), str(n_ctx), str(n_batch), str(n_ubatch)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.vocab = self._i32()
        self.n_batch = n_batch

    def _read(self, n: int) -> bytes:
        data = self.proc.stdout.read(n)
        if len(data) != n:
            rc = self.proc.wait()
            raise RuntimeError(f"llama_cpp_logits_server stopped (exit status {rc})")
        return data

    def _i32(self) -> int:
        return int(np.frombuffer(self._read(4), dtype=np.int32)[0])

    def _send(self, line: str) -> None:
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def clear(self):
        self._send("c")
        self._i32()

    def logits(self, tokens: list[int], start: int) -> np.ndarray:
        n = len(tokens)
        if n > self.n_batch:
            raise ValueError(f"{n} tokens in one batch, n_batch is {self.n_batch}")
        self._send(f"d {start} {n} " + " ".join(map(str, tokens)))
        if (rc := self._i32()) != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return np.frombuffer(self._read(4 * n * self.vocab), dtype=np.float32).reshape(
            n, self.vocab).copy()

    def close(self):
        if self.proc.poll() is None:
            self._send("q")
            self.proc.wait()


def load_bindings(src: Path, lib: Path):
    """llama_cpp.llama_cpp (ctypes) bound to DIR/libllama.so, without the package's
    __init__ (which imports the high-level API and its dependencies)."""
    import os

    os.environ["LLAMA_CPP_LIB_PATH"] = str(lib)
    pkg = types.ModuleType("llama_cpp")
    pkg.__path__ = [str(src / "llama_cpp")]
    sys.modules["llama_cpp"] = pkg
    return importlib.import_module("llama_cpp.llama_cpp")


def top(logprobs: np.ndarray, also: int | None = None) -> dict[str, float]:
    idx = np.argpartition(-logprobs, 5)[:5]
    idx = idx[np.argsort(-logprobs[idx], kind="stable")]
    out = {str(int(t)): float(logprobs[t]) for t in idx}
    if also is not None:
        out[str(also)] = float(logprobs[also])
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


class LlamaRunner:
    """One llama.cpp model and context; `logits(tokens, start)` decodes tokens at
    positions start.. of sequence 0 and returns their logits [n, vocab]."""

    def __init__(self, L, gguf: str, n_ctx: int, n_batch: int, n_ubatch: int, n_gpu_layers: int):
        self.L = L
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = n_gpu_layers
        self.model = L.llama_model_load_from_file(gguf.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, n_ubatch
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context for {gguf}")
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.n_batch = n_batch

    def clear(self):
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def logits(self, tokens: list[int], start: int) -> np.ndarray:
        L, n = self.L, len(tokens)
        if n > self.n_batch:
            raise ValueError(f"{n} tokens in one batch, n_batch is {self.n_batch}")
        batch = L.llama_batch_init(n, 0, 1)
        try:
            for i, t in enumerate(tokens):
                batch.token[i] = t
                batch.pos[i] = start + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1
            batch.n_tokens = n
            rc = L.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            ptr = L.llama_get_logits(self.ctx)
            return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                         shape=(n, self.vocab)).copy()
        finally:
            L.llama_batch_free(batch)

    def close(self):
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)


def run(runner: LlamaRunner, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    outputs = []
    for ids in prompts:
        runner.clear()
        lp = log_softmax(runner.logits(ids, 0))
        prompt_lps = [None] + [top(lp[i - 1], ids[i]) for i in range(1, len(ids))]
        tokens, logprobs, step = [], [], lp[-1]
        for k in range(max_tokens):
            t = int(step.argmax())
            tokens.append(t)
            logprobs.append(top(step, t))
            step = log_softmax(runner.logits([t], len(ids) + k))[0]
        outputs.append({"prompt_len": len(ids), "tokens": tokens, "logprobs": logprobs,
                        "prompt_logprobs": prompt_lps})
    return outputs


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--lib", required=True, help="the folder holding libllama.so")
    p.add_argument("--out", required=True)
    p.add_argument("--bindings", default=None)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--n-gpu-layers", type=int, default=999)
    p.add_argument("--n-ubatch", type=int, default=512)
    p.add_argument("--runner", choices=("ctypes", "c"), default="ctypes")
    p.add_argument("--llama-src", default=None, help="llama.cpp source tree (--runner c)")
    args = p.parse_args()
    import faulthandler

    faulthandler.enable()  # a crash inside libllama still names the call it happened in
    from tests.models.glm5_generate import prompts

    longest = max(map(len, prompts(1000)))
    sizes = dict(n_ctx=longest + args.max_tokens + 64, n_batch=max(2048, longest),
                 n_ubatch=args.n_ubatch, n_gpu_layers=args.n_gpu_layers)
    if args.runner == "c":
        server = build_server(Path(args.lib), llama_headers(args.llama_src),
                              Path(args.out).with_suffix(".server"))
        runner = ServerRunner(server, args.gguf, **sizes)
    else:
        L = load_bindings(bindings_dir(args.bindings), Path(args.lib))
        runner = LlamaRunner(L, args.gguf, **sizes)
    try:
        outputs = run(runner, prompts(runner.vocab), args.max_tokens)
    finally:
        runner.close()
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "engine": "llama.cpp", "outputs": outputs}, f)
    print(json.dumps({"out": args.out, "vocab": runner.vocab}))


if __name__ == "__main__":
    main()
