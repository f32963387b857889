# SPDX-License-Identifier: Apache-2.0
"""The transformers fp32 reference for glm5_generate.py's prompts and output format.

    python -m tests.models.glm5_hf_reference --model DIR --out OUT.json [--device cuda]

transformers' `GlmMoeDsaForCausalLM` (with its DSA indexer) in float32 computes,
for the same fixed prompts, the top-5 prompt logprobs (plus the prompt token's
own) and 32 greedy tokens with their top-5 logprobs; each greedy step is a full
forward pass over prompt + generated tokens (no KV cache), so nothing but the
model itself is involved.
"""

import argparse
import json

import torch

from tests.models.glm5_generate import prompts


def top(logprobs: torch.Tensor, also: int | None = None) -> dict[str, float]:
    v, i = logprobs.topk(5)
    out = {str(t): float(x) for t, x in zip(i.tolist(), v.tolist())}
    if also is not None:
        out[str(also)] = float(logprobs[also])
    return out


@torch.no_grad()
def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device)
    model.eval()
    outputs = []
    for ids in prompts(model.config.vocab_size):
        x = torch.tensor([ids], device=args.device)
        lp = model(x).logits[0].float().log_softmax(-1)
        prompt_lps = [None] + [top(lp[i - 1], ids[i]) for i in range(1, len(ids))]
        tokens, logprobs = [], []
        for _ in range(args.max_tokens):
            step = lp[-1]
            t = int(step.argmax())
            tokens.append(t)
            logprobs.append(top(step, t))
            x = torch.cat([x, torch.tensor([[t]], device=args.device)], dim=1)
            lp = model(x).logits[0, -1:].float().log_softmax(-1)
        outputs.append({"prompt_len": len(ids), "tokens": tokens, "logprobs": logprobs,
                        "prompt_logprobs": prompt_lps})
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "outputs": outputs}, f)
    print(json.dumps({"out": args.out}))


if __name__ == "__main__":
    main()
