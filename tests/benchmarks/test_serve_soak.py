# SPDX-License-Identifier: Apache-2.0
"""benchmarks/serve_soak.py against a stand-in streaming OpenAI server on 127.0.0.1:
it passes a server that answers every request as asked, and catches failed
requests, a stream that goes silent, a text that holds its stop string and
requests the server still holds after the load."""

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from benchmarks import serve_soak


def text_of(body: dict) -> str:
    prompt = body.get("prompt") or body["messages"][0]["content"]
    words = [str(x) for x in prompt] if isinstance(prompt, list) else prompt.split()
    return " ".join(f"w{len(w) * 7 % 13}" for w in words[:40])


class Handler(BaseHTTPRequestHandler):
    mode = "ok"
    lock = threading.Lock()
    count = 0
    seen: list = []
    frozen_until = 0.0
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        running = 1.0 if self.mode == "leak" else 0.0
        out = (f'vllm:num_requests_running{{model_name="m"}} {running}\n'
               f'vllm:num_requests_waiting{{model_name="m"}} 0.0\n'
               f'vllm:prefix_cache_queries_total{{model_name="m"}} 10.0\n').encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def event(self, data) -> None:
        chunk = f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
        self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        self.wfile.flush()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            Handler.count += 1
            k = Handler.count
        if self.mode == "error" and k % 7 == 0:
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path == "/tokenize":  # an id for each distinct word
            words = sorted(set(body["prompt"].split()))
            out = json.dumps({"tokens": [100 + words.index(w) for w in body["prompt"].split()]})
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out.encode())
            return
        chat = self.path.endswith("chat/completions")
        prompt = body.get("prompt") or []
        with self.lock:  # a prefix cache: the longest prefix of an earlier prompt
            cached = max((next((i for i, (a, b) in enumerate(zip(p, prompt)) if a != b),
                               min(len(p), len(prompt))) for p in self.seen), default=0)
            self.seen.append(prompt)
        text, finish = text_of(body), "length"
        if self.mode == "placeholders" and not body.get("allowed_token_ids"):
            text = ""  # a random model's greedy ids with no text
        stop = (body.get("stop") or [None])[0]
        if stop and stop in text and self.mode != "nostop":
            text, finish = text[:text.index(stop)], "stop"
        pieces = [text[i:i + 4] for i in range(0, len(text), 4)] or [""]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for j, piece in enumerate(pieces):
                if self.mode == "stall" and k == 30 and j == 1:
                    time.sleep(1.5)
                if self.mode == "freeze":  # from the 30th request on, every stream waits
                    with self.lock:
                        if k == 30 and not Handler.frozen_until:
                            Handler.frozen_until = time.monotonic() + 1.5
                    time.sleep(max(0.0, Handler.frozen_until - time.monotonic()))
                for i in range(body.get("n", 1)):
                    c = {"index": i, "finish_reason": finish if j == len(pieces) - 1 else None}
                    c.update({"delta": {"content": piece}} if chat else {"text": piece})
                    self.event({"choices": [c]})
            self.event({"choices": [], "usage": {
                "prompt_tokens": len(prompt),
                "prompt_tokens_details": {"cached_tokens": cached}}})
            self.event("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away mid-stream


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    Handler.count, Handler.seen, Handler.frozen_until = 0, [], 0.0
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def soak(url: str, tmp_path, mode: str) -> dict:
    Handler.mode = mode
    args = serve_soak.parse([
        "--base-url", url, "--model", "m", "--duration-s", "1.5", "--concurrency", "4",
        "--server-pid", str(os.getpid()), "--long-tokens", "20", "40",
        "--history-tokens", "60", "--histories", "2", "--prefix-probes", "2",
        "--stop-probes", "3", "--stall-s", "0.8", "--timeout", "10", "--warmup-s", "0.2",
        "--sample-s", "0.3", "--drain-s", "0", "--max-rss-growth-mib", "1e6",
        "--max-gpu-growth-mib", "1e6", "--json", str(tmp_path / "soak.json")])
    rep = serve_soak.Soak(args).run()
    serve_soak.markdown(rep)  # renders
    return rep


def test_passes_a_server_that_answers_as_asked(server, tmp_path):
    rep = soak(server, tmp_path, "ok")
    assert rep["passed"], rep["failure_samples"]
    assert rep["requests_ok"] > 20 and rep["requests_failed"] == 0
    # every kind of the mix was sent, and the stop requests stopped on their probe's text
    assert all(v["ok"] > 0 for v in rep["by_kind"].values()), rep["by_kind"]
    assert rep["stop"]["requests"] == rep["stop"]["stopped"] == rep["stop"]["text_equal"] > 0
    # the probe's second request is a hit of the whole prompt; the shared histories hit too
    assert all(p["same_text"] and p["cached_tokens_hit"] == p["prompt_tokens"]
               and p["cached_tokens_cold"] == 0 for p in rep["prefix_probe"])
    assert rep["history_cached_share"] > 0
    assert rep["memory"]["first_under_load"]["server_rss_mib"] > 0
    assert rep["left_in_server"] == {"num_requests_running": 0.0, "num_requests_waiting": 0.0}
    assert rep["partial"] is False


def test_stop_requests_where_greedy_text_is_placeholders(server, tmp_path):
    # no probe text without a constraint: the probes and the stop requests then choose
    # among /tokenize's ids of a sentence, and the stop strings are still checked
    rep = soak(server, tmp_path, "placeholders")
    assert rep["passed"], rep["failure_samples"]
    assert rep["stop"]["allowed_token_ids"] == len(set(serve_soak.WORDS))
    assert rep["stop"]["requests"] == rep["stop"]["stopped"] == rep["stop"]["text_equal"] > 0


def test_a_soak_cut_short_leaves_its_report_so_far(server, tmp_path):
    """The report is written at every memory sample while the load runs."""
    import subprocess
    import sys
    Handler.mode = "ok"
    out = tmp_path / "soak.json"
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.serve_soak", "--base-url", server,
                             "--model", "m", "--duration-s", "60", "--concurrency", "2",
                             "--long-tokens", "20", "40", "--history-tokens", "60",
                             "--warmup-s", "0.2", "--sample-s", "0.3", "--json", str(out)],
                            cwd=serve_soak.__file__.rsplit("/benchmarks/", 1)[0])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not out.exists():
            time.sleep(0.2)
        time.sleep(1.0)
    finally:
        proc.kill()
        proc.wait()
    rep = json.loads(out.read_text())
    assert rep["partial"] is True and rep["requests_ok"] > 0 and rep["duration_s"] > 0


@pytest.mark.parametrize("mode", ["error", "stall", "nostop", "leak"])
def test_catches_what_a_soak_is_for(server, tmp_path, mode):
    rep = soak(server, tmp_path, mode)
    assert not rep["passed"]
    if mode == "error":
        assert rep["requests_failed"] > 0
        assert any("500" in f["error"] for f in rep["failure_samples"])
    elif mode == "stall":
        assert rep["stream_stalls"] == 1
        assert rep["stream_stall_samples"][0]["max_gap_s"] >= 1.4
        assert rep["requests_failed"] == 0
    elif mode == "nostop":
        assert any("stop string" in f["error"] for f in rep["failure_samples"])
    else:
        assert rep["requests_failed"] == 0 and not rep["stalls"]
        assert rep["left_in_server"]["num_requests_running"] == 1.0


def test_a_silent_server_is_a_stall():
    """No chunk from any request in flight for longer than the limit opens one stall,
    which closes when a chunk comes."""
    w = serve_soak.Watch()
    t0 = w.last
    w.enter()
    assert w.check(t0 + 0.5, 1.0, t0) is None
    assert w.stalls == []
    opened = w.check(t0 + 3.0, 1.0, t0)  # the row, once: where the soak looks at the server
    assert w.check(t0 + 5.0, 1.0, t0) is None
    assert w.stalls == [opened]
    assert len(w.stalls) == 1 and w.stalls[0]["in_flight"] == 1
    assert w.stalls[0]["silent_s"] == pytest.approx(5.0, abs=0.1)
    w.progress()
    w.check(w.last + 0.1, 1.0, t0)
    w.leave()
    w.check(w.last + 9.0, 1.0, t0)  # nothing in flight: silence is no stall
    assert len(w.stalls) == 1


def test_a_server_wide_stall_records_what_the_server_does(server, tmp_path):
    """At a stall's start the report has its UTC time and the server's processes with their
    command lines; --stall-signal reaches only the processes that catch it (here a Python
    process with tools/gpu-host/stackdump on its path, which prints its stacks and runs on),
    not its child that would die of it."""
    import re
    import signal
    import subprocess
    import sys
    root = serve_soak.__file__.rsplit("/benchmarks/", 1)[0]
    err = tmp_path / "server.err"
    env = dict(os.environ, PYTHONPATH=f"{root}/tools/gpu-host/stackdump")
    with open(err, "w") as f:
        fake = subprocess.Popen(
            [sys.executable, "-c", "import subprocess, time\n"
             "child = subprocess.Popen(['sleep', '60'])\n"
             "print('ready', flush=True)\n"
             "time.sleep(60)"], env=env, stdout=subprocess.PIPE, stderr=f, text=True)
    try:
        assert fake.stdout.readline().strip() == "ready"
        Handler.mode = "freeze"
        args = serve_soak.parse([
            "--base-url", server, "--model", "m", "--duration-s", "2.5", "--concurrency", "4",
            "--server-pid", str(fake.pid), "--long-tokens", "20", "40",
            "--history-tokens", "60", "--histories", "2", "--prefix-probes", "2",
            "--stop-probes", "3", "--stall-s", "0.8", "--timeout", "10", "--warmup-s", "0.2",
            "--sample-s", "0.3", "--drain-s", "0", "--max-rss-growth-mib", "1e6",
            "--max-gpu-growth-mib", "1e6", "--stall-signal", "SIGUSR2"])
        rep = serve_soak.Soak(args).run()
        assert not rep["passed"] and len(rep["stalls"]) == 1
        stall = rep["stalls"][0]
        assert re.fullmatch(r"\d\d:\d\d:\d\d", stall["utc"])
        cmds = {p["pid"]: p["cmd"] for p in stall["processes"]}
        sleeper = [pid for pid, cmd in cmds.items() if cmd == "sleep 60"]
        assert fake.pid in cmds and len(sleeper) == 1, cmds
        assert stall["signalled"] == [fake.pid]
        time.sleep(0.3)
        assert fake.poll() is None  # both still run
        os.kill(sleeper[0], 0)
        assert "most recent call first" in err.read_text()
        assert serve_soak.catches(fake.pid, signal.SIGUSR2)
        assert f"{stall['utc']} {stall['silent_s']} s 1" in serve_soak.markdown(rep)
        assert not serve_soak.catches(sleeper[0], signal.SIGUSR2)
    finally:
        for p in serve_soak.process_tree(fake.pid):
            if p != fake.pid:
                os.kill(p, signal.SIGKILL)
        fake.kill()
        fake.wait()
