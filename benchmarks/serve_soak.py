# SPDX-License-Identifier: Apache-2.0
"""Sustained mixed load against a running `vllm serve`, for as long as asked.

    python -m benchmarks.serve_soak --base-url http://127.0.0.1:8000 --model M \
        --duration-s 1200 --concurrency 64 --server-pid PID --json soak.json --md soak.md

First, on the idle server, two probes:
  - prefix: a few prompts with a long random prefix, each sent cold and then again
    (a prefix-cache hit); the two greedy texts, the TTFTs and the cached prompt tokens
    (`usage.prompt_tokens_details`, with `--enable-prompt-tokens-details`).
  - stop: short greedy prompts whose whole text is the reference of the stop-string
    requests below.
Then CONCURRENCY clients send, until the duration is over, a mix of: short chats,
8K-32K-token prompts (random token ids), continuations of a few long shared histories
(agent and chat turns: a prefix-cache hit each), streams the client closes after a few
chunks (a disconnect), `n>1` sampled completions and greedy requests with a stop string.
Every request streams.

A failure is a request that did not complete as asked: an HTTP or connection error, a
timeout, a missing `[DONE]`, fewer choices than `n`, a text that holds its stop string.
A stall is a stream silent for more than --stall-s seconds after its first chunk, or a
span of more than --stall-s seconds in which requests were in flight and no stream got
a chunk (what a livelocked kernel looks like: the GPU busy, no output). At a stall's start
the report records its UTC time and the server's processes (state, CPU seconds, command
line); --stall-signal SIG sends SIG to those of them that catch it (tools/gpu-host/stackdump
makes the server's Python processes print their stacks). The GPU memory of the
server's processes (nvidia-smi; the whole GPU's where it lists no process of the server)
and the server's host RSS (its process tree) are sampled all along; growth
is the last sample, after the load drained, against the first one under load. After
the load, the server's /metrics must show no request running or waiting.

With --json, the report so far is written at every memory sample ("partial": true), so that
a soak cut short leaves one. The exit status is 1 when the soak did not pass: a failure, a stall, memory growth
beyond --max-gpu-growth-mib / --max-rss-growth-mib, or requests left in the server.
"""

import argparse
import concurrent.futures
import json
import os
import random
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

WORDS = ("sparse attention indexer latent cache expert router token layer head prefill "
         "decode graph kernel block slot query key value norm").split()
# what a request that did not complete raises (a connection, HTTP or timeout error, a
# malformed event)
REQUEST_ERRORS = (urllib.error.URLError, OSError, ValueError, KeyError, TypeError)
# relative weights of the request kinds in the mixed load
MIX = {"chat": 30, "long": 12, "history": 20, "disconnect": 10, "n": 10, "stop": 18}


class Stream:
    """One request's timings: chunk arrival times and what came back."""

    def __init__(self, kind: str):
        self.kind, self.t0 = kind, time.monotonic()
        self.chunks: list[float] = []
        self.texts: dict[int, str] = {}
        self.finish: dict[int, str | None] = {}
        self.usage: dict | None = None
        self.done = False

    def ttft(self) -> float | None:
        return self.chunks[0] - self.t0 if self.chunks else None

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]


class Watch:
    """Requests in flight and the last time any of them made progress."""

    def __init__(self):
        self.lock = threading.Lock()
        self.in_flight = 0
        self.last = time.monotonic()
        self.stalls: list[dict] = []
        self._open: float | None = None

    def progress(self):
        with self.lock:
            self.last = time.monotonic()

    def enter(self):
        with self.lock:
            if self.in_flight == 0:
                self.last = time.monotonic()
            self.in_flight += 1

    def leave(self):
        with self.lock:
            self.in_flight -= 1
            self.last = time.monotonic()

    def check(self, now: float, stall_s: float, t_start: float) -> dict | None:
        """Open, extend or close the current stall; the stall's row when this call opens it."""
        with self.lock:
            silent = now - self.last
            if self.in_flight > 0 and silent > stall_s:
                opened = None
                if self._open is None:
                    self._open = self.last
                    began = time.time() - silent
                    opened = {"at_s": round(self.last - t_start, 1),
                              "utc": time.strftime("%H:%M:%S", time.gmtime(began)),
                              "in_flight": self.in_flight, "silent_s": silent}
                    self.stalls.append(opened)
                self.stalls[-1]["silent_s"] = round(silent, 1)
                return opened
            if self._open is not None and silent <= stall_s:
                self._open = None
            return None


def request(base_url: str, path: str, body: dict, timeout: float, watch: Watch | None,
            stream: Stream, close_after: int | None = None) -> Stream:
    """POST one streamed request and read its server-sent events into `stream`.
    `close_after`: close the connection after that many chunks (a client that goes away)."""
    req = urllib.request.Request(base_url.rstrip("/") + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    chat = path.endswith("chat/completions")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                stream.done = True
                break
            out = json.loads(data)
            if out.get("usage"):
                stream.usage = out["usage"]
            for c in out.get("choices") or []:
                piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                i = c.get("index", 0)
                stream.texts[i] = stream.texts.get(i, "") + (piece or "")
                if c.get("finish_reason"):
                    stream.finish[i] = c["finish_reason"]
            if out.get("choices"):
                stream.chunks.append(time.monotonic())
                if watch is not None:
                    watch.progress()
            if close_after is not None and len(stream.chunks) >= close_after:
                break  # leaving the `with` closes the connection mid-stream
    return stream


def get(base_url: str, path: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(base_url.rstrip("/") + path, timeout=timeout) as resp:
        return resp.read().decode()


def metrics(base_url: str) -> dict[str, float]:
    """vLLM's Prometheus counters and gauges this soak reads, summed over labels."""
    want = ("vllm:num_requests_running", "vllm:num_requests_waiting",
            "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
            "vllm:kv_cache_usage_perc", "vllm:request_success")
    out: dict[str, float] = {}
    try:
        text = get(base_url, "/metrics")
    except (urllib.error.URLError, OSError):
        return out
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{")[0].split(" ")[0]
        for w in want:
            if name in (w, w + "_total"):
                try:
                    out[w] = out.get(w, 0.0) + float(line.rsplit(" ", 1)[1])
                except ValueError:
                    pass
    return out


def process_tree(pid: int | None) -> dict[int, int]:
    """Each process of the tree under `pid` (itself included), with its resident pages."""
    if pid is None:
        return {}
    children: dict[int, list[int]] = {}
    pages: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/statm") as f:
                pages[int(d)] = int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    tree, todo = {}, [pid] if pid in pages else []
    while todo:
        p = todo.pop()
        tree[p] = pages.get(p, 0)
        todo += children.get(p, [])
    return tree


def processes(pids) -> list[dict]:
    """What each process is doing: its state, CPU seconds so far and command line (a
    compiler under the server, nvcc or ptxas, is a step held by a JIT build)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for pid in sorted(pids):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        out.append({"pid": pid, "state": fields[0],
                    "cpu_s": round((int(fields[11]) + int(fields[12])) / tick, 1),
                    "cmd": cmd[:200]})
    return out


def catches(pid: int, sig: int) -> bool:
    """Whether the process has a handler for the signal (/proc's SigCgt), so that sending
    it cannot end the process."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def signal_catchers(pids, sig: int) -> list[int]:
    """Send the signal to the processes that catch it (a stack dump, with
    tools/gpu-host/stackdump on the server's PYTHONPATH); the others are left alone."""
    sent = []
    for pid in sorted(pids):
        if catches(pid, sig):
            try:
                os.kill(pid, sig)
                sent.append(pid)
            except OSError:
                pass
    return sent


def gpu_used_mib(pids) -> tuple[float | None, str]:
    """GPU memory of the given processes, or of the whole GPU where nvidia-smi lists
    none of them (another PID namespace); and which of the two it is."""
    def smi(*query):
        return subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20, check=True).stdout
    try:
        apps = [line.split(",") for line in smi("--query-compute-apps=pid,used_memory")
                .splitlines() if line.strip()]
        mine = [float(m) for p, m in apps if int(p) in pids]
        if mine:
            return sum(mine), "server"
        return sum(float(x) for x in smi("--query-gpu=memory.used").split()), "device"
    except (OSError, subprocess.SubprocessError, ValueError):
        return None, "none"


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(p * len(values)))], 4)


class Soak:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.watch = Watch()
        self.lock = threading.Lock()
        self.results: list[dict] = []
        self.failures: list[dict] = []
        self.gaps: list[float] = []
        self.stream_stalls: list[dict] = []
        self.samples: list[dict] = []
        self.t_start = time.monotonic()
        self.stop_extra: dict = {}  # what the stop probes needed to have a text
        lo, hi = args.vocab_range
        self.ids = lambda rng, n: [rng.randrange(lo, hi) for _ in range(n)]
        self.histories = [self.ids(self.rng, args.history_tokens) for _ in range(args.histories)]

    # -- requests --------------------------------------------------------------
    def body(self, prompt, max_tokens: int, chat: bool = False, **extra) -> dict:
        b = {"model": self.args.model, "max_tokens": max_tokens, "temperature": 0.0,
             "seed": 0, **extra}
        if chat:
            b["messages"] = [{"role": "user", "content": prompt}]
        else:
            b["prompt"] = prompt
        if b.get("stream"):
            b["stream_options"] = {"include_usage": True}
        return b

    def send(self, kind: str, path: str, body: dict,
             close_after: int | None = None) -> Stream | None:
        """One request, read as it streams; None where it raised (counted as a failure)."""
        s = Stream(kind)
        self.watch.enter()
        try:
            return request(self.args.base_url, path, body, self.args.timeout, self.watch, s,
                           close_after)
        except REQUEST_ERRORS as e:
            self.fail(kind, f"{type(e).__name__}: {e}", s.t0)
            return None
        finally:
            self.watch.leave()

    def one(self, rng: random.Random, kind: str) -> None:
        a, cp, cc = self.args, "/v1/completions", "/v1/chat/completions"
        n, stop, close_after, ref = 1, None, None, None
        if kind == "chat":
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 120)))
            path, body = cc, self.body(text, rng.randint(16, 96), chat=True, stream=True)
        elif kind == "long":
            path, body = cp, self.body(self.ids(rng, rng.randint(*a.long_tokens)), 32,
                                       stream=True)
        elif kind == "history":
            h = rng.randrange(len(self.histories))
            path, body = cp, self.body(self.histories[h] + self.ids(rng, rng.randint(64, 512)),
                                       32, stream=True)
        elif kind == "disconnect":
            close_after = rng.randint(1, 5)
            path, body = cp, self.body(self.ids(rng, rng.randint(256, 8192)), 256, stream=True)
        elif kind == "n":
            n = rng.randint(2, 4)
            path, body = cp, self.body(self.ids(rng, rng.randint(32, 512)), 24, n=n,
                                       temperature=0.8, seed=rng.randrange(1 << 30),
                                       stream=True)
        else:  # stop: a probe prompt, its stop string taken from its own greedy text
            ref = rng.choice(self.stop_refs)
            stop = ref["stop"]
            path, body = cp, self.body(ref["prompt"], a.stop_max_tokens, stop=[stop],
                                       stream=True, skip_special_tokens=False,
                                       **self.stop_extra)
        t0 = time.monotonic()
        s = self.send(kind, path, body, close_after)
        if s is None:
            return
        why = None
        if close_after is None and not s.done:
            why = "the stream ended without [DONE]"
        elif close_after is None and len(s.texts) < n:
            why = f"{len(s.texts)} choices for n={n}"
        elif close_after is None and any(s.finish.get(i) is None for i in range(n)):
            why = "a choice without finish_reason"
        elif stop is not None and stop in s.texts.get(0, ""):
            why = f"the text holds its stop string {stop!r}"
        if why:
            self.fail(kind, why, t0)
            return
        gaps = s.gaps()
        big = max(gaps, default=0.0)
        row = {"kind": kind, "at_s": round(t0 - self.t_start, 2), "ttft_s": s.ttft(),
               "chunks": len(s.chunks), "max_gap_s": big,
               "prompt_tokens": (s.usage or {}).get("prompt_tokens"),
               "cached_tokens": ((s.usage or {}).get("prompt_tokens_details") or {})
               .get("cached_tokens")}
        if stop is not None:
            # greedy: the text is the probe's text up to the stop string (equal unless
            # batching moved a near tie; counted, not a failure)
            row["stop_hit"] = s.finish.get(0) == "stop"
            row["stop_text_equal"] = s.texts.get(0) == ref["text"][:ref["text"].index(stop)]
        with self.lock:
            self.results.append(row)
            if close_after is None:
                self.gaps += gaps
            if big > a.stall_s:
                self.stream_stalls.append(row)

    def fail(self, kind: str, why: str, t0: float) -> None:
        with self.lock:
            self.failures.append({"kind": kind, "at_s": round(t0 - self.t_start, 2),
                                  "error": why[:300]})

    # -- probes ----------------------------------------------------------------
    def probe(self, body: dict) -> Stream | None:
        """One probe request on the idle server; a failure is counted as any other."""
        s = self.send("probe", "/v1/completions", body)
        if s is not None and not s.done:
            self.fail("probe", "the stream ended without [DONE]", s.t0)
            return None
        return s

    def probe_prefix(self) -> list[dict]:
        rows = []
        for k in range(self.args.prefix_probes):
            rng = random.Random(1000 + k)
            prompt = self.ids(rng, self.args.history_tokens) + self.ids(rng, 200)
            body = self.body(prompt, 16, stream=True)
            cold = self.probe(body)
            hit = self.probe(body)
            if cold is None or hit is None:
                continue
            rows.append({"prompt_tokens": len(prompt),
                         "ttft_cold_s": cold.ttft(), "ttft_hit_s": hit.ttft(),
                         "cached_tokens_cold": ((cold.usage or {}).get("prompt_tokens_details")
                                                or {}).get("cached_tokens"),
                         "cached_tokens_hit": ((hit.usage or {}).get("prompt_tokens_details")
                                               or {}).get("cached_tokens"),
                         "same_text": cold.texts.get(0) == hit.texts.get(0),
                         "text_cold": cold.texts.get(0), "text_hit": hit.texts.get(0)})
        return rows

    def probe_stop(self) -> list[dict]:
        refs = self.stop_probes_with({})
        if not refs:
            # a random model's greedy ids may all be placeholders with no text (a
            # synthetic file's [PAD<i>]): then the probes and the stop requests choose
            # among the ids of a tokenized sentence (vLLM's allowed_token_ids)
            ids = self.text_token_ids()
            if ids:
                self.stop_extra = {"allowed_token_ids": ids}
                refs = self.stop_probes_with(self.stop_extra)
        return refs

    def stop_probes_with(self, extra: dict) -> list[dict]:
        refs, self.stop_probe_chars = [], []
        for k in range(self.args.stop_probes):
            rng = random.Random(2000 + k)
            prompt = self.ids(rng, rng.randint(16, 256))
            s = self.probe(self.body(prompt, self.args.stop_max_tokens, stream=True,
                                     skip_special_tokens=False, **extra))
            text = "" if s is None else s.texts.get(0, "")
            self.stop_probe_chars.append(len(text))
            # a stop string from the middle of the text: 2-4 characters after some output
            cut = len(text) // 2
            stop = text[cut:cut + 3]
            if len(stop) == 3 and text.index(stop) > 0:
                refs.append({"prompt": prompt, "text": text, "stop": stop})
        return refs

    def text_token_ids(self) -> list[int]:
        """The distinct ids of WORDS as the server's /tokenize gives them; [] where it fails."""
        req = urllib.request.Request(
            self.args.base_url.rstrip("/") + "/tokenize",
            data=json.dumps({"model": self.args.model, "prompt": " ".join(WORDS),
                             "add_special_tokens": False}).encode(),
            headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.args.timeout) as resp:
                return sorted(set(json.loads(resp.read())["tokens"]))
        except REQUEST_ERRORS:
            return []

    # -- the load --------------------------------------------------------------
    def client(self, c: int, until: float) -> None:
        rng = random.Random(self.args.seed * 1000 + c)
        # without a probe text to take a stop string from, no stop requests (reported)
        kinds = [k for k in MIX if k != "stop" or self.stop_refs]
        weights = [MIX[k] for k in kinds]
        while time.monotonic() < until:
            self.one(rng, rng.choices(kinds, weights)[0])

    def sample(self, phase: str) -> None:
        tree = process_tree(self.args.server_pid)
        gpu, scope = gpu_used_mib(tree)
        rss = sum(tree.values()) * os.sysconf("SC_PAGE_SIZE") / 2**20 if tree else None
        self.samples.append({"at_s": round(time.monotonic() - self.t_start, 1), "phase": phase,
                             "gpu_used_mib": gpu, "gpu_scope": scope,
                             "server_rss_mib": None if rss is None else round(rss, 1),
                             **{k.split(":")[1]: v for k, v in metrics(self.args.base_url).items()}})

    def run(self) -> dict:
        a = self.args
        self.sample("idle")
        self.stop_refs = self.probe_stop()
        prefix = self.probe_prefix()
        until = time.monotonic() + a.duration_s
        stop_watch = threading.Event()

        def watchdog():
            next_sample = time.monotonic() + a.warmup_s
            while not stop_watch.wait(0.5):
                now = time.monotonic()
                opened = self.watch.check(now, a.stall_s, self.t_start)
                if opened is not None:  # what the server does while it stalls
                    tree = process_tree(a.server_pid)
                    opened["processes"] = processes(tree)
                    if a.stall_signal:
                        opened["signalled"] = signal_catchers(tree, a.stall_signal)
                if now >= next_sample:
                    self.sample("load")
                    next_sample = now + a.sample_s
                    if a.json:  # the report so far: a soak cut short still leaves one
                        with self.lock:
                            rep = self.report(prefix, now - load_start, partial=True)
                        write_json(a.json, rep)

        load_start = time.monotonic()
        w = threading.Thread(target=watchdog, daemon=True)
        w.start()
        with concurrent.futures.ThreadPoolExecutor(a.concurrency) as pool:
            for f in [pool.submit(self.client, c, until) for c in range(a.concurrency)]:
                f.result()
        load_s = time.monotonic() - load_start
        stop_watch.set()
        w.join()
        time.sleep(a.drain_s)  # aborted requests leave the scheduler
        self.sample("drained")
        return self.report(prefix, load_s)

    def report(self, prefix: list[dict], load_s: float, partial: bool = False) -> dict:
        a = self.args
        by_kind: dict[str, dict] = {}
        for k in MIX:
            rows = [r for r in self.results if r["kind"] == k]
            ttft = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
            by_kind[k] = {"ok": len(rows), "failed": sum(f["kind"] == k for f in self.failures),
                          "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99)}
        stops = [r for r in self.results if "stop_hit" in r]
        hist = [r for r in self.results if r["kind"] == "history"]
        load = [s for s in self.samples if s["phase"] == "load"]
        first, last = (load[0] if load else None), self.samples[-1]

        def growth(key):
            if first is None or first.get(key) is None or last.get(key) is None:
                return None
            return round(last[key] - first[key], 1)

        left = {k: last.get(k) for k in ("num_requests_running", "num_requests_waiting")}
        gpu_growth, rss_growth = growth("gpu_used_mib"), growth("server_rss_mib")
        ttft_all = [r["ttft_s"] for r in self.results if r["ttft_s"] is not None]
        rep = {
            "partial": partial, "duration_s": round(load_s, 1), "concurrency": a.concurrency,
            "mix": MIX,
            "requests_ok": len(self.results), "requests_failed": len(self.failures),
            "failure_samples": self.failures[:10], "by_kind": by_kind,
            "stalls": self.watch.stalls, "stream_stalls": len(self.stream_stalls),
            "stream_stall_samples": self.stream_stalls[:5], "stall_s": a.stall_s,
            "ttft_p50_s": pct(ttft_all, 0.5), "ttft_p99_s": pct(ttft_all, 0.99),
            "itl_p50_s": pct(self.gaps, 0.5), "itl_p99_s": pct(self.gaps, 0.99),
            "itl_max_s": pct(self.gaps, 1.0),
            "prefix_probe": prefix,
            "history_cached_share": (round(sum(r["cached_tokens"] or 0 for r in hist)
                                           / max(1, sum(r["prompt_tokens"] or 0 for r in hist)),
                                           3) if hist else None),
            "stop": {"probes": len(self.stop_refs), "probe_text_chars": self.stop_probe_chars,
                     "allowed_token_ids": len(self.stop_extra.get("allowed_token_ids", [])),
                     "requests": len(stops), "stopped": sum(r["stop_hit"] for r in stops),
                     "text_equal": sum(r["stop_text_equal"] for r in stops)},
            "memory": {"first_under_load": first, "end": last,
                       "gpu_growth_mib": gpu_growth, "rss_growth_mib": rss_growth},
            "samples": self.samples, "left_in_server": left,
        }
        rep["passed"] = (not self.failures and not self.watch.stalls and not self.stream_stalls
                         and (gpu_growth is None or gpu_growth <= a.max_gpu_growth_mib)
                         and (rss_growth is None or rss_growth <= a.max_rss_growth_mib)
                         and not any(v for v in left.values()))
        return rep


def write_json(path: str, report: dict) -> None:
    tmp = f"{path}.partial"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


def markdown(r: dict) -> str:
    m = r["memory"]
    rows = [("duration under load", f"{r['duration_s']:.0f} s, {r['concurrency']} clients"),
            ("requests served / failed", f"{r['requests_ok']} / {r['requests_failed']}"),
            ("stalls (server-wide / in a stream)", f"{len(r['stalls'])} / {r['stream_stalls']}"),
            ("server-wide stalls: UTC start, silent s, processes signalled",
             ", ".join(f"{s.get('utc')} {s['silent_s']} s {len(s.get('signalled', []))}"
                       for s in r["stalls"]) or "-"),
            ("TTFT p50 / p99", f"{r['ttft_p50_s']} / {r['ttft_p99_s']} s"),
            ("inter-token p50 / p99 / max", f"{r['itl_p50_s']} / {r['itl_p99_s']} / "
                                            f"{r['itl_max_s']} s"),
            ("GPU memory growth", f"{m['gpu_growth_mib']} MiB"),
            ("server host RSS growth", f"{m['rss_growth_mib']} MiB"),
            ("left running / waiting", f"{r['left_in_server']}"),
            ("history requests' cached share", f"{r['history_cached_share']}"),
            ("stop requests: stopped / same text", f"{r['stop']['stopped']} / "
                                                   f"{r['stop']['text_equal']} of "
                                                   f"{r['stop']['requests']}"),
            ("passed", str(r["passed"]))]
    out = ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    out += ["", "| kind | ok | failed | TTFT p50 | TTFT p99 |", "|---|---|---|---|---|"]
    out += [f"| {k} | {v['ok']} | {v['failed']} | {v['ttft_p50_s']} | {v['ttft_p99_s']} |"
            for k, v in r["by_kind"].items()]
    out += ["", "| prefix probe | tokens | TTFT cold | TTFT hit | cached | same text |",
            "|---|---|---|---|---|---|"]
    out += [f"| {i} | {p['prompt_tokens']} | {p['ttft_cold_s']:.3f} | {p['ttft_hit_s']:.3f} "
            f"| {p['cached_tokens_hit']} | {p['same_text']} |"
            for i, p in enumerate(r["prefix_probe"])]
    return "\n".join(out) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--duration-s", type=float, default=1200.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--server-pid", type=int, default=None,
                   help="the server's process: its tree's host RSS is sampled")
    p.add_argument("--long-tokens", type=int, nargs=2, default=[8192, 32768])
    p.add_argument("--history-tokens", type=int, default=16384)
    p.add_argument("--histories", type=int, default=6)
    p.add_argument("--prefix-probes", type=int, default=3)
    p.add_argument("--stop-probes", type=int, default=8)
    p.add_argument("--stop-max-tokens", type=int, default=48)
    p.add_argument("--vocab-range", type=int, nargs=2, default=[1000, 100000],
                   help="random prompt ids are drawn from [LO, HI)")
    p.add_argument("--stall-s", type=float, default=10.0)
    p.add_argument("--stall-signal", type=lambda s: int(signal.Signals[s]) if not s.isdigit()
                   else int(s), default=None,
                   help="at each stall, send this signal number to the server's processes "
                        "that catch it (a stack dump); the processes, their states and "
                        "command lines are recorded at each stall in any case")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--warmup-s", type=float, default=60.0,
                   help="the first memory sample under load comes this long after the start")
    p.add_argument("--sample-s", type=float, default=30.0)
    p.add_argument("--drain-s", type=float, default=5.0)
    p.add_argument("--max-gpu-growth-mib", type=float, default=256.0)
    p.add_argument("--max-rss-growth-mib", type=float, default=512.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    return p.parse_args(argv)


def main() -> None:
    args = parse()
    rep = Soak(args).run()
    text = markdown(rep)
    print(text)
    if args.json:
        write_json(args.json, rep)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    raise SystemExit(0 if rep["passed"] else 1)


if __name__ == "__main__":
    main()
