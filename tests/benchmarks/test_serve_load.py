# SPDX-License-Identifier: Apache-2.0
"""benchmarks/serve_load.py against a stand-in OpenAI server on 127.0.0.1: it
passes a deterministic server and catches failed requests, texts that change
between rounds and texts that differ from the offline reference."""

import json
import threading
from argparse import Namespace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from benchmarks import serve_load


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
        prompt = body.get("prompt") or body["messages"][0]["content"]
        ids, prompt_ids = [ord(c) for c in text], [ord(c) for c in prompt]
        # top-2 logprobs of each token: a margin of 0.5 + index / 100
        tops = [(-0.1, -0.6 - k / 100) for k in range(len(text))]
        if self.path == "/v1/completions":
            choice = {"text": text, "token_ids": ids, "prompt_token_ids": prompt_ids,
                      "logprobs": {"top_logprobs": [{"a": a, "b": b} for a, b in tops]}}
            out = {"choices": [choice]}
        else:
            content = [{"token": "a", "logprob": a,
                        "top_logprobs": [{"token": "a", "logprob": a},
                                         {"token": "b", "logprob": b}]} for a, b in tops]
            choice = {"message": {"role": "assistant", "content": text}, "token_ids": ids,
                      "logprobs": {"content": content}}
            out = {"choices": [choice], "prompt_token_ids": prompt_ids}
        out = json.dumps(out).encode()
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
    ps = serve_load.prompts(40)
    texts = [answer({"prompt": p}) for p in ps]
    if change is not None:
        texts[change] = texts[change][:3] + "?" + texts[change][4:]
    results = [{"text": t, "token_ids": [ord(c) for c in t],
                "prompt_token_ids": [ord(c) for c in p], "margins": [0.25] * len(t)}
               for t, p in zip(texts, ps)]
    f = tmp_path / "ref.json"
    f.write_text(json.dumps({"texts": texts, "results": results, "unstable": list(unstable)}))
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
    # prompt 5 is a chat request: the same prompt tokens, the 4th token differs,
    # with the margins both sides gave there; sent alone it still differs
    assert sample["kind"] == "chat" and sample["same_prompt_tokens"] is True
    assert sample["first_different_token"] == 3
    assert sample["offline_margin"] == 0.25
    assert abs(sample["server_margin"] - 0.53) < 1e-9
    assert sample["solo"] == sample["server"] and sample["solo_matches_offline"] is False


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_request_asks_for_token_ids_and_logprobs(server, kind):
    # what the report's mismatch fields are read from, for both endpoints
    Handler.mode = "ok"
    body = serve_load.request_body(kind, "m", "Request 1: a b c", 8)
    assert body["return_token_ids"] is True
    res = serve_load.post(server, kind, body, 10.0)
    assert res["text"] == answer(body) and res["token_ids"] == [ord(c) for c in res["text"]]
    assert res["prompt_token_ids"] == [ord(c) for c in "Request 1: a b c"]
    assert res["margins"][:2] == pytest.approx([0.5, 0.51])


def test_fails_when_the_offline_reference_was_unstable(server, tmp_path):
    Handler.mode = "ok"
    rc, report = run(server, tmp_path, reference_file(tmp_path, unstable=[3]))
    assert rc == 1 and not report["passed"] and report["offline_unstable_prompts"] == [3]
    assert not report["differs_from_offline"]
