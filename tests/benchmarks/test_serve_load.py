# SPDX-License-Identifier: Apache-2.0
"""benchmarks/serve_load.py against a stand-in OpenAI server on 127.0.0.1: it
passes a deterministic server and catches failed requests, texts that change
between rounds and texts that differ from the offline reference."""

import importlib.util
import json
import threading
from argparse import Namespace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("serve_load", ROOT / "benchmarks" / "serve_load.py")
serve_load = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serve_load)


def answer(body: dict) -> str:
    prompt = body.get("prompt") or body["messages"][0]["content"]
    return f"{len(prompt)}:{prompt[-7:]}"


class Handler(BaseHTTPRequestHandler):
    mode = "ok"
    seen: dict = {}
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = answer(body)
        with self.lock:
            n = self.seen[text] = self.seen.get(text, 0) + 1
        if self.mode == "flaky" and n == 2:
            self.send_response(500)
            self.end_headers()
            return
        if self.mode == "unstable" and n == 3:
            text += "!"
        choice = ({"text": text} if self.path == "/v1/completions"
                  else {"message": {"role": "assistant", "content": text}})
        out = json.dumps({"choices": [choice]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


class Server(ThreadingHTTPServer):
    request_queue_size = 128  # listen backlog for 16 concurrent clients


@pytest.fixture
def server():
    httpd = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    Handler.seen = {}
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def run(base_url, tmp_path, reference=None):
    args = Namespace(base_url=base_url, model="m", num_prompts=40, max_tokens=8,
                     reference=reference, concurrency=16, rounds=3, timeout=10.0,
                     json=str(tmp_path / "report.json"))
    rc = serve_load.load(args)
    return rc, json.loads((tmp_path / "report.json").read_text())


def reference_file(tmp_path, change=None, unstable=()):
    texts = [answer({"prompt": p}) for p in serve_load.prompts(40)]
    if change is not None:
        texts[change] += "?"
    f = tmp_path / "ref.json"
    f.write_text(json.dumps({"texts": texts, "unstable": list(unstable)}))
    return str(f)


def test_passes_a_deterministic_server(server, tmp_path):
    Handler.mode = "ok"
    rc, report = run(server, tmp_path, reference_file(tmp_path))
    assert rc == 0 and report["passed"] and report["requests"] == 120
    assert report["errors"] == 0 and not report["unstable_prompts"]


@pytest.mark.parametrize("mode,field", [("flaky", "errors"), ("unstable", "unstable_prompts")])
def test_catches_errors_and_unstable_texts(server, tmp_path, mode, field):
    Handler.mode = mode
    rc, report = run(server, tmp_path)
    assert rc == 1 and not report["passed"] and report[field]


def test_catches_a_difference_from_offline(server, tmp_path):
    Handler.mode = "ok"
    rc, report = run(server, tmp_path, reference_file(tmp_path, change=5))
    assert rc == 1 and report["differs_from_offline"] == [5]
    sample = report["mismatch_samples"][0]
    assert sample["prompt"] == 5 and sample["offline"] != sample["server"]


def test_fails_when_the_offline_reference_was_unstable(server, tmp_path):
    Handler.mode = "ok"
    rc, report = run(server, tmp_path, reference_file(tmp_path, unstable=[3]))
    assert rc == 1 and not report["passed"] and report["offline_unstable_prompts"] == [3]
    assert not report["differs_from_offline"]
