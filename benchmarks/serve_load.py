# SPDX-License-Identifier: Apache-2.0
"""Bounded load against a local `vllm serve`: OpenAI completions and chat, greedy.

    # the reference: the same prompts through vllm.LLM in this process
    python benchmarks/serve_load.py offline --model M [--tokenizer T] --out ref.json
    # the load: CONCURRENCY clients for ROUNDS rounds against the server
    python benchmarks/serve_load.py load --base-url http://127.0.0.1:8000 --model M \
        --reference ref.json --concurrency 64 --rounds 3 --json report.json

Every prompt is sent as a completion (even index) or a chat message (odd index),
each round in a new random order. The offline reference generates every prompt
twice (in one engine) and lists the prompts whose two texts differ. The load
passes when no request failed, every prompt got the same text in every round,
and (with --reference) the offline texts were stable and the server's text is
the offline greedy text. The report lists request counts, errors, mismatches and
latency percentiles; the exit status is 1 when the load did not pass.
"""

import argparse
import concurrent.futures
import json
import random
import sys
import time
import urllib.error
import urllib.request


def prompts(n: int) -> list[str]:
    rng = random.Random(0)
    words = ("sparse attention indexer latent cache expert router token layer head "
             "prefill decode graph kernel block slot query key value norm").split()
    return [f"Request {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(8, 60)))
            for i in range(n)]


def request_body(kind: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "seed": 0}
    if kind == "completion":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    return body


def post(base_url: str, kind: str, body: dict, timeout: float) -> str:
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    req = urllib.request.Request(base_url.rstrip("/") + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        out = json.loads(resp.read())
    choice = out["choices"][0]
    return choice["text"] if kind == "completion" else choice["message"]["content"]


def kinds(n: int) -> list[str]:
    return ["completion" if i % 2 == 0 else "chat" for i in range(n)]


def offline(args) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, tokenizer=args.tokenizer, max_model_len=args.max_model_len,
              seed=0, enforce_eager=args.eager,
              gpu_memory_utilization=args.gpu_memory_utilization,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, seed=0)
    ps, ks = prompts(args.num_prompts), kinds(args.num_prompts)
    comp = [i for i, k in enumerate(ks) if k == "completion"]
    chat = [i for i, k in enumerate(ks) if k == "chat"]
    runs = []
    for _ in range(2):  # twice: is the offline reference itself reproducible?
        texts = {}
        for i, o in zip(comp, llm.generate([ps[i] for i in comp], params)):
            texts[i] = o.outputs[0].text
        for i, o in zip(chat, llm.chat([[{"role": "user", "content": ps[i]}] for i in chat],
                                       params)):
            texts[i] = o.outputs[0].text
        runs.append([texts[i] for i in range(len(ps))])
    unstable = [i for i, (a, b) in enumerate(zip(*runs)) if a != b]
    with open(args.out, "w") as f:
        json.dump({"max_tokens": args.max_tokens, "texts": runs[0], "unstable": unstable}, f)


def load(args) -> int:
    ps, ks = prompts(args.num_prompts), kinds(args.num_prompts)
    reference, offline_unstable = None, []
    if args.reference:
        with open(args.reference) as f:
            ref = json.load(f)
        reference, offline_unstable = ref["texts"], ref.get("unstable", [])
        if len(reference) != len(ps):
            sys.exit(f"{args.reference}: {len(reference)} texts for {len(ps)} prompts")
    texts: dict[int, set[str]] = {i: set() for i in range(len(ps))}
    errors, latencies = [], []

    def one(i: int):
        t0 = time.perf_counter()
        try:
            text = post(args.base_url, ks[i], request_body(ks[i], args.model, ps[i],
                                                           args.max_tokens), args.timeout)
        except (urllib.error.URLError, OSError, KeyError, ValueError) as e:
            return i, None, f"{type(e).__name__}: {e}", time.perf_counter() - t0
        return i, text, None, time.perf_counter() - t0

    rng = random.Random(1)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        for r in range(args.rounds):
            order = list(range(len(ps)))
            rng.shuffle(order)
            for i, text, err, dt in pool.map(one, order):
                latencies.append(dt)
                if err is not None:
                    errors.append({"round": r, "prompt": i, "kind": ks[i], "error": err})
                else:
                    texts[i].add(text)
    wall = time.perf_counter() - start
    unstable = [i for i, t in texts.items() if len(t) > 1]
    off = [i for i, t in texts.items()
           if reference is not None and len(t) == 1 and next(iter(t)) != reference[i]]
    latencies.sort()

    def pct(p):
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] if latencies else None

    report = {
        "requests": len(latencies), "concurrency": args.concurrency, "rounds": args.rounds,
        "errors": len(errors), "error_samples": errors[:5],
        "unstable_prompts": unstable, "offline_unstable_prompts": offline_unstable,
        "differs_from_offline": off,
        # the texts of the first mismatches, to tell a near-tie from a real divergence
        "mismatch_samples": [{"prompt": i, "kind": ks[i], "offline": reference[i],
                              "server": next(iter(texts[i]))} for i in off[:8]],
        "wall_s": wall, "latency_s": {"p50": pct(0.5), "p90": pct(0.9), "max": pct(1.0)},
        "passed": not errors and not unstable and not offline_unstable and not off,
    }
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["passed"] else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("offline", "load"):
        s = sub.add_parser(name)
        s.add_argument("--model", required=True)
        s.add_argument("--num-prompts", type=int, default=128)
        s.add_argument("--max-tokens", type=int, default=32)
    o = sub.choices["offline"]
    o.add_argument("--tokenizer", default=None)
    o.add_argument("--out", required=True)
    o.add_argument("--max-model-len", type=int, default=2048)
    o.add_argument("--eager", action="store_true")
    o.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    o.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    ld = sub.choices["load"]
    ld.add_argument("--base-url", default="http://127.0.0.1:8000")
    ld.add_argument("--reference", default=None)
    ld.add_argument("--concurrency", type=int, default=64)
    ld.add_argument("--rounds", type=int, default=3)
    ld.add_argument("--timeout", type=float, default=300.0)
    ld.add_argument("--json", default=None)
    args = p.parse_args()
    if args.cmd == "offline":
        offline(args)
    else:
        sys.exit(load(args))


if __name__ == "__main__":
    main()
