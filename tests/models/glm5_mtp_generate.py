# SPDX-License-Identifier: Apache-2.0
"""Greedy generation, MTP acceptance and decode speed of vLLM on the trained tiny
GLM-5 (glm5_trained.py), with or without MTP speculative decoding.

    python -m tests.models.glm5_mtp_generate --model DIR|FILE.gguf --out OUT.json
        [--num-speculative-tokens N] [--attention-backend NAME]
        [--indexer auto|deepgemm|triton] [--dtype D] [--eager]

N = 0: no speculative decoding; else `speculative_config={"method": "mtp",
"num_speculative_tokens": N}`. Prompts are corpus sequences of the trained model
(PROMPT_LENS tokens, some longer than its index_topk, 128). Steps, in one engine
(in this process, VLLM_ENABLE_V1_MULTIPROCESSING=0, so that the portable indexer's
calls can be counted):
- greedy, --max-tokens new tokens for all prompts; vLLM's spec-decode counters
  over this run give the acceptance length (1 + accepted / drafts: tokens per
  verification step) and the acceptance rate per draft position;
- decode speed at batch 1 and 8: after a warm-up, each batch is generated once with
  one new token and once with --speed-tokens; the decode rate is the extra tokens
  over the extra time (the prefill cancels out); --speed-tokens 0 leaves it out.
The attention backends of the target's layers and of the draft's (its MTP
layers, model.layers.<num_hidden_layers + i>) are reported apart.
"""

import argparse
import json
import os
import re
import time

from tests.plugins.vllm_report_capability import vllm_report_capability as hook

PROMPT_LENS = (40, 64, 96, 128, 160, 200, 256, 320)
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def llm_kwargs(args) -> dict:
    """vLLM's LLM arguments for this run."""
    return dict(
        model=args.model, skip_tokenizer_init=True, dtype=args.dtype, max_model_len=2048,
        block_size=64, max_num_seqs=8, enforce_eager=args.eager, seed=0,
        # a fixed KV cache (no memory profiling), small: several runs share the GPU
        gpu_memory_utilization=0.1, kv_cache_memory_bytes=1 << 30,
        disable_log_stats=False,  # the spec-decode counters
        attention_config={"backend": args.attention_backend} if args.attention_backend else None,
        # vLLM selects the draft's attention backend on its own unless the
        # speculative config names one (it does not inherit --attention-backend;
        # v1/spec_decode/llm_base_proposer.py): the same backend for the draft
        speculative_config=({"method": "mtp",
                             "num_speculative_tokens": args.num_speculative_tokens,
                             **({"attention_backend": args.attention_backend}
                                if args.attention_backend else {})}
                            if args.num_speculative_tokens else None),
    )


def spec_counts(metrics) -> dict:
    """The spec-decode counters of `LLM.get_metrics()` (summed over label sets):
    {name: value}, and the accepted tokens per draft position."""
    from vllm.v1.metrics.reader import Counter, Vector

    counts = {name: 0 for name in SPEC_COUNTERS}
    per_pos: list[int] = []
    for m in metrics:
        if isinstance(m, Counter) and m.name in counts:
            counts[m.name] += m.value
        elif isinstance(m, Vector) and m.name == SPEC_PER_POS:
            per_pos += [0] * (len(m.values) - len(per_pos))
            for i, v in enumerate(m.values):
                per_pos[i] += v
    counts[SPEC_PER_POS] = per_pos
    return counts


def acceptance(before: dict, after: dict) -> dict:
    """Acceptance between two spec_counts: the mean tokens per verification step
    (the accepted drafts plus the target's own token) and the rate per position."""
    d = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    pos = [a - (before[SPEC_PER_POS][i] if i < len(before[SPEC_PER_POS]) else 0)
           for i, a in enumerate(after[SPEC_PER_POS])]
    drafts = d["vllm:spec_decode_num_drafts"]
    if not drafts:
        return {"drafts": 0, "acceptance_length": None, "per_position": []}
    assert sum(pos) == d["vllm:spec_decode_num_accepted_tokens"], (d, pos)
    return {"drafts": drafts, "draft_tokens": d["vllm:spec_decode_num_draft_tokens"],
            "accepted_tokens": d["vllm:spec_decode_num_accepted_tokens"],
            "acceptance_length": 1 + d["vllm:spec_decode_num_accepted_tokens"] / drafts,
            "per_position": [p / drafts for p in pos]}


def decode_rate(n_seqs: int, tokens: int, seconds: float, seconds_one: float) -> float:
    """Decode tokens/s of a batch: the tokens after the first over the time they took
    (the run with `tokens` new tokens less the run with one)."""
    assert tokens > 1 and seconds > seconds_one, (tokens, seconds, seconds_one)
    return n_seqs * (tokens - 1) / (seconds - seconds_one)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--num-speculative-tokens", type=int, default=0)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--indexer", default="auto", choices=["auto", "deepgemm", "triton"])
    p.add_argument("--dtype", default="float16")
    p.add_argument("--eager", action="store_true")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--speed-tokens", type=int, default=256, help="0: no speed runs")
    args = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # triton: the platform reports no DeepGEMM (the test hook, applied in this process)
    hook.use_indexer(args.indexer)

    from tests.models.glm5_generate import attention_backend_name, count_triton_indexer_calls
    from tests.models.glm5_trained import prompts
    from vllm import LLM, SamplingParams
    from vllm.v1.attention.ops import triton_indexer_logits as il

    calls = count_triton_indexer_calls()

    llm = LLM(**llm_kwargs(args))
    # DeepSeekMTP names its layers after the target's: model.layers.<num_hidden_layers + i>
    n_target = llm.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers

    def is_draft(name: str) -> bool:
        m = re.match(r"model\.layers\.(\d+)\.", name)
        return m is not None and int(m[1]) >= n_target
    batch = [{"prompt_token_ids": ids} for ids in prompts(PROMPT_LENS)]

    def sampling(n):
        return SamplingParams(temperature=0.0, max_tokens=n, logprobs=2, detokenize=False,
                              ignore_eos=True)

    before = spec_counts(llm.get_metrics())
    outs = llm.generate(batch, sampling(args.max_tokens), use_tqdm=False)
    spec = acceptance(before, spec_counts(llm.get_metrics()))
    speed = {}
    for n in (1, 8) if args.speed_tokens else ():
        llm.generate(batch[:n], sampling(args.speed_tokens), use_tqdm=False)  # warm-up
        times = []
        for tokens in (1, args.speed_tokens):
            start = time.perf_counter()
            llm.generate(batch[:n], sampling(tokens), use_tqdm=False)
            times.append(time.perf_counter() - start)
        speed[f"batch_{n}"] = decode_rate(n, args.speed_tokens, times[1], times[0])
    result = {
        "args": vars(args),
        "attention_backend": attention_backend_name(llm),
        "target_attention_backend": attention_backend_name(llm, lambda n: not is_draft(n)),
        "draft_attention_backend": attention_backend_name(llm, is_draft),
        "indexer_backend": il.indexer_logits_backend(),
        "triton_indexer_calls": calls,
        "acceptance": spec,
        "decode_tokens_per_s": speed,
        "outputs": [{"prompt_len": len(o.prompt_token_ids), "tokens": list(o.outputs[0].token_ids),
                     "logprobs": [{str(t): v.logprob for t, v in lp.items()}
                                  for lp in o.outputs[0].logprobs]} for o in outs],
    }
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(json.dumps({"out": args.out, "acceptance": spec, "speed": speed}))


if __name__ == "__main__":
    main()
