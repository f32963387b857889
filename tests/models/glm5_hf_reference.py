# SPDX-License-Identifier: Apache-2.0
"""The transformers fp32 reference for glm5_generate.py's prompts and output format.

    python -m tests.models.glm5_hf_reference --model DIR --out OUT.json [--device cuda]
        [--dtype float32] [--max-tokens 32] [--indexer-fp8 [qk|q|k]] [--fp16-residual-scale]

transformers' `GlmMoeDsaForCausalLM` (with its DSA indexer) in float32 computes,
for the same fixed prompts, the top-5 prompt logprobs (plus the prompt token's
own) and 32 greedy tokens with their top-5 logprobs; each greedy step is a full
forward pass over prompt + generated tokens (no KV cache), so nothing but the
model itself is involved. In `--dtype` bfloat16 or float16 the same model gives what
rounding to that dtype alone costs against float32 (logprobs taken in float32). With
`--indexer-fp8` the indexer's queries and keys are rounded to float8_e4m3 (one scale per
head row, absmax / 448) before its dot products, as vLLM's indexer quantizes them for its
fp8 key cache and logits kernels (`--indexer-fp8 k` or `q`: only the keys or only the
queries, to tell which rounding costs what); everything else stays in `--dtype`. With
`--fp16-residual-scale` the decoder's RMSNorms see the residual stream as vLLM's DeepSeek
layers carry it in float16 (divided by routed_scaling_factor, against overflow): the same as
their eps times routed_scaling_factor squared.
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


def e4m3_rows(x: torch.Tensor) -> torch.Tensor:
    """x (float32) through float8_e4m3fn with one scale per last-dim row, back in float32."""
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


def use_fp8_indexer(which: str = "qk") -> None:
    """GlmMoeDsaIndexer with its q and k (or those of `which`) rounded to e4m3 after RoPE,
    as vLLM's indexer rounds both."""
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m

    def forward(self, hidden_states, q_resid, position_embeddings, attention_mask,
                position_ids=None, past_key_values=None):
        b, s, _ = hidden_states.shape
        rope = self.qk_rope_head_dim
        q = self.wq_b(q_resid).view(b, s, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
        q_rot, k_rot = m.apply_rotary_pos_emb_interleave(q[..., :rope], k[..., :rope],
                                                         *position_embeddings, unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., rope:]], dim=-1)
        k = torch.cat([k_rot, k[..., rope:]], dim=-1).squeeze(2)
        if past_key_values is not None:
            k = past_key_values.update_indexer(k, self.layer_idx)
        q, k = q.float(), k.float()
        if "q" in which:
            q = e4m3_rows(q)
        if "k" in which:
            k = e4m3_rows(k)
        scores = torch.relu(q @ k.transpose(-1, -2).unsqueeze(1) * self.softmax_scale)
        w = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float()
        index = (w * self.n_heads**-0.5).unsqueeze(-2) @ scores  # [b, s, 1, t]
        index = index.squeeze(-2)
        if attention_mask.dtype == torch.bool:
            index = index.masked_fill(~attention_mask, float("-inf"))
        else:
            index = index + attention_mask
        return index.topk(min(self.index_topk, index.shape[-1]), dim=-1).indices.to(torch.int32)

    m.GlmMoeDsaIndexer.forward = forward


def use_fp16_residual_scale(model) -> None:
    """vLLM's DeepseekV2DecoderLayer in float16 divides the attention output and, in layer 0,
    the residual by routed_scaling_factor (its MoE and MLP outputs follow), so from layer 0's
    attention on every RMSNorm of the residual stream sees it divided by that factor: for an
    RMSNorm, the same as eps times the factor squared. Layer 0's input norm sees the
    embeddings as they are."""
    rsf = model.config.routed_scaling_factor
    layers = model.model.layers
    for norm in ([layer.post_attention_layernorm for layer in layers]
                 + [layer.input_layernorm for layer in layers[1:]] + [model.model.norm]):
        norm.variance_epsilon *= rsf**2


@torch.no_grad()
def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--indexer-fp8", nargs="?", const="qk", choices=("qk", "q", "k"))
    p.add_argument("--fp16-residual-scale", action="store_true")
    args = p.parse_args()
    if args.indexer_fp8:
        use_fp8_indexer(args.indexer_fp8)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(args.device)
    model.eval()
    if args.fp16_residual_scale:
        use_fp16_residual_scale(model)
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
