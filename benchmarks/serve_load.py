# SPDX-License-Identifier: Apache-2.0
"""Bounded load against a local `vllm serve`: OpenAI completions and chat, greedy.

    # the reference: the same prompts through vllm.LLM in this process
    python -m benchmarks.serve_load offline --model M [--tokenizer T] --out ref.json
    # the load: CONCURRENCY clients for ROUNDS rounds against the server
    python -m benchmarks.serve_load load --base-url http://127.0.0.1:8000 --model M \
        --reference ref.json --concurrency 64 --rounds 3 --json report.json

Every prompt is sent as a completion (even index) or a chat message (odd index),
each round in a new random order. The offline reference generates every prompt
twice (in one engine) and lists the prompts whose two texts differ. The load
passes when no request failed, every prompt got the same text in every round,
and (with --reference) the offline texts were stable and the server's text is
the offline greedy text. The report lists request counts, errors, mismatches and
latency percentiles; the exit status is 1 when the load did not pass.

Both sides ask for token ids and the top-2 logprobs of each generated token, so
that a mismatch report shows whether the prompts were the same tokens, the first
generated token that differs and the top-1/top-2 margin there on each side (a
near tie flips on a rounding difference; a wide margin does not). After the
rounds, the differing prompts are sent once more one at a time ("solo"): a solo
text equal to the offline one puts the difference on what a request was batched
with; a solo text equal to the loaded server's puts it on the server's setup.
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
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "seed": 0,
            "return_token_ids": True}
    if kind == "completion":
        body.update(prompt=prompt, logprobs=2)
    else:
        body.update(messages=[{"role": "user", "content": prompt}], logprobs=True,
                    top_logprobs=2)
    return body


def margin(top: list[float]) -> float | None:
    """Top-1 minus top-2 logprob of one generated token."""
    top = sorted(top, reverse=True)
    return top[0] - top[1] if len(top) > 1 else None


def post(base_url: str, kind: str, body: dict, timeout: float) -> dict:
    """The generated text, and where the server gave them, the prompt and output
    token ids and the top-1/top-2 margin of each generated token."""
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    req = urllib.request.Request(base_url.rstrip("/") + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        out = json.loads(resp.read())
    choice = out["choices"][0]
    logprobs = choice.get("logprobs") or {}
    if kind == "completion":
        text, prompt_ids = choice["text"], choice.get("prompt_token_ids")
        tops = [list(t.values()) for t in logprobs.get("top_logprobs") or []]
    else:
        text, prompt_ids = choice["message"]["content"], out.get("prompt_token_ids")
        tops = [[t["logprob"] for t in c["top_logprobs"]] for c in logprobs.get("content") or []]
    return {"text": text, "token_ids": choice.get("token_ids"), "prompt_token_ids": prompt_ids,
            "margins": [margin(t) for t in tops] or None}


def first_difference(a: list | None, b: list | None) -> int | None:
    """Index of the first differing element of two token lists (None if unknown)."""
    if a is None or b is None:
        return None
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def at(values: list | None, k: int | None):
    return values[k] if values is not None and k is not None and k < len(values) else None


def mismatch(i: int, kind: str, off: dict, srv: dict, solo: dict | None) -> dict:
    k = first_difference(off.get("token_ids"), srv.get("token_ids"))
    same_prompt = (None if off.get("prompt_token_ids") is None
                   or srv.get("prompt_token_ids") is None
                   else off["prompt_token_ids"] == srv["prompt_token_ids"])
    return {"prompt": i, "kind": kind, "offline": off["text"], "server": srv["text"],
            "same_prompt_tokens": same_prompt, "first_different_token": k,
            "offline_margin": at(off.get("margins"), k),
            "server_margin": at(srv.get("margins"), k),
            "solo": None if solo is None else solo["text"],
            "solo_matches_offline": None if solo is None else solo["text"] == off["text"]}


def kinds(n: int) -> list[str]:
    return ["completion" if i % 2 == 0 else "chat" for i in range(n)]


def offline(args) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, tokenizer=args.tokenizer, max_model_len=args.max_model_len,
              seed=0, enforce_eager=args.eager,
              gpu_memory_utilization=args.gpu_memory_utilization,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, seed=0, logprobs=2)
    ps, ks = prompts(args.num_prompts), kinds(args.num_prompts)
    comp = [i for i, k in enumerate(ks) if k == "completion"]
    chat = [i for i, k in enumerate(ks) if k == "chat"]

    def result(o) -> dict:
        out = o.outputs[0]
        return {"text": out.text, "token_ids": list(out.token_ids),
                "prompt_token_ids": list(o.prompt_token_ids),
                "margins": [margin([lp.logprob for lp in d.values()])
                            for d in out.logprobs or []]}

    runs = []
    for _ in range(2):  # twice: is the offline reference itself reproducible?
        res = {}
        for i, o in zip(comp, llm.generate([ps[i] for i in comp], params)):
            res[i] = result(o)
        for i, o in zip(chat, llm.chat([[{"role": "user", "content": ps[i]}] for i in chat],
                                       params)):
            res[i] = result(o)
        runs.append([res[i] for i in range(len(ps))])
    unstable = [i for i, (a, b) in enumerate(zip(*runs)) if a["text"] != b["text"]]
    with open(args.out, "w") as f:
        json.dump({"max_tokens": args.max_tokens, "texts": [r["text"] for r in runs[0]],
                   "results": runs[0], "unstable": unstable}, f)


def load(args) -> int:
    ps, ks = prompts(args.num_prompts), kinds(args.num_prompts)
    reference, offline_unstable, ref_results = None, [], []
    if args.reference:
        with open(args.reference) as f:
            ref = json.load(f)
        reference, offline_unstable = ref["texts"], ref.get("unstable", [])
        ref_results = ref.get("results") or [{"text": t} for t in reference]
        if len(reference) != len(ps):
            sys.exit(f"{args.reference}: {len(reference)} texts for {len(ps)} prompts")
    texts: dict[int, set[str]] = {i: set() for i in range(len(ps))}
    first_result: dict[int, dict] = {}
    errors, latencies = [], []

    def one(i: int):
        t0 = time.perf_counter()
        try:
            res = post(args.base_url, ks[i], request_body(ks[i], args.model, ps[i],
                                                          args.max_tokens), args.timeout)
        except (urllib.error.URLError, OSError, KeyError, ValueError, TypeError) as e:
            return i, None, f"{type(e).__name__}: {e}", time.perf_counter() - t0
        return i, res, None, time.perf_counter() - t0

    rng = random.Random(1)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        for r in range(args.rounds):
            order = list(range(len(ps)))
            rng.shuffle(order)
            for i, res, err, dt in pool.map(one, order):
                latencies.append(dt)
                if err is not None:
                    errors.append({"round": r, "prompt": i, "kind": ks[i], "error": err})
                else:
                    texts[i].add(res["text"])
                    first_result.setdefault(i, res)
    wall = time.perf_counter() - start
    unstable = [i for i, t in texts.items() if len(t) > 1]
    off = [i for i, t in texts.items()
           if reference is not None and len(t) == 1 and next(iter(t)) != reference[i]]
    # the first differing prompts once more, one request at a time
    solo = {}
    for i in off[:8]:
        _, res, _, _ = one(i)
        solo[i] = res
    latencies.sort()

    def pct(p):
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] if latencies else None

    report = {
        "requests": len(latencies), "concurrency": args.concurrency, "rounds": args.rounds,
        "errors": len(errors), "error_samples": errors[:5],
        "unstable_prompts": unstable, "offline_unstable_prompts": offline_unstable,
        "differs_from_offline": off,
        # the first mismatches, to tell a near tie from a real divergence
        "mismatch_samples": [mismatch(i, ks[i], ref_results[i], first_result[i], solo[i])
                             for i in off[:8]],
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
    # vLLM's default differs between vllm.LLM (16384 on an H200) and `vllm serve`
    # (8192); give the server's
    o.add_argument("--max-num-batched-tokens", type=int, default=None)
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
