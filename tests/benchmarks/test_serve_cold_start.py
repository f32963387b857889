# SPDX-License-Identifier: Apache-2.0
"""benchmarks/serve_cold_start.py: the time to healthy of a stand-in server that
becomes healthy after a delay, a server that dies, and vLLM's log lines of a start."""

import socket
import sys

from benchmarks import serve_cold_start

SERVER = r'''
import sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
delay, port = float(sys.argv[1]), int(sys.argv[2])
start = time.monotonic()
ballast = bytearray(64 << 20)  # resident memory the sampler sees
for i in range(0, len(ballast), 4096):
    ballast[i] = 1
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        ok = self.path == "/health" and time.monotonic() - start > delay
        self.send_response(200 if ok else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()
HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_time_to_healthy_waits_for_200_and_stops_the_server(tmp_path):
    port = free_port()
    r = serve_cold_start.time_to_healthy(
        [sys.executable, "-c", SERVER, "1.5", str(port)], None,
        f"http://127.0.0.1:{port}/health", tmp_path / "log", timeout=60)
    assert r["end"] == "healthy"
    assert 1.5 <= r["healthy_s"] < 30
    assert r["peak_rss_mib"] >= 64
    # stopped: the port is free again
    assert not serve_cold_start.healthy(f"http://127.0.0.1:{port}/health")


def test_a_server_that_dies_has_no_time(tmp_path):
    port = free_port()
    r = serve_cold_start.time_to_healthy(
        [sys.executable, "-c", "import sys; sys.exit(3)"], None,
        f"http://127.0.0.1:{port}/health", tmp_path / "log", timeout=60)
    assert r["healthy_s"] is None and r["end"] == "exited with 3"


def test_vllm_phases_from_its_log():
    log = "\n".join([
        "(EngineCore pid=1) INFO 12-05 [gpu_model_runner.py:5348] Model loading took 7.41 GiB "
        "memory and 12.345678 seconds",
        "(EngineCore pid=1) INFO 12-05 [monitor.py:20] torch.compile took 21.50 s in total",
        "(EngineCore pid=1) INFO 12-05 [gpu_model_runner.py:6845] Graph capturing finished in "
        "9 secs, took 0.52 GiB",
        "(EngineCore pid=1) INFO 12-05 [core.py:341] init engine (profile, create kv cache, "
        "warmup model) took 48.07 s (compilation: 21.50 s)",
        "(EngineCore pid=1) INFO 12-06 [monitor.py:81] Initial profiling/warmup run took 54.50 s",
        "(EngineCore pid=1) INFO 12-06 [mla_prefill_warmup.py:155] Warmed up the MLA prefill "
        "kernels (FLASH_ATTN) in 31.02 s."])
    assert serve_cold_start.vllm_phases(log) == {
        "load_s": 12.345678, "compile_s": 21.5, "graph_capture_s": 9.0, "engine_init_s": 48.07,
        "profile_run_s": 54.5, "mla_prefill_warmup_s": 31.02}
    assert serve_cold_start.vllm_phases("nothing") == dict.fromkeys(serve_cold_start.VLLM_PHASES)


def test_evict_drops_a_file_from_the_page_cache(tmp_path):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"\0" * (1 << 20))
    assert serve_cold_start.evict(f) is True
    assert f.read_bytes() == b"\0" * (1 << 20)  # the file itself is untouched


def test_a_cold_start_has_every_cache_fresh(tmp_path):
    """Every compile and JIT cache a start fills points under the cold start's own folder,
    the CUDA driver's PTX cache included (a kept one hid 31 s of FA2 compilation as on
    SM120 from the second file's "cold" start)."""
    env = serve_cold_start.fresh_caches(tmp_path / "c")
    assert {"VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
            "DG_JIT_CACHE_DIR", "CUDA_CACHE_PATH"} <= set(env)
    assert all(v.startswith(str(tmp_path / "c")) for v in env.values())
