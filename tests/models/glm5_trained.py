# SPDX-License-Identifier: Apache-2.0
"""A tiny GLM-5 (`glm_moe_dsa`) trained on the CPU, with an MTP head that predicts.

The random tiny GLM-5 (glm5_tiny.py) has near-tied logits, which make greedy
comparisons weak, and its MTP block predicts nothing, so speculative decoding
accepts no draft. This one is trained, main model and MTP head together, on a
synthetic corpus with learnable structure:

- 256 content tokens (ids 16..271); each next token is, with probability 0.7,
  S1[current] (a fixed random successor of the current token), with 0.25
  S2[previous] (a successor of the token before it: attention has to fetch it),
  else uniform. The greedy next token is S1[current] at a margin of log(0.7/0.25)
  nats over the runner-up, whatever the context, so greedy runs are confident;
  the 0.25 that attention decides keeps the logits sensitive to attention.
- The main model learns next-token prediction; the MTP head, DeepSeek-V3's MTP
  module as vLLM runs it (models/deepseek_mtp.py), predicts token t+2 from the
  main model's final (normed) hidden state of token t and the embedding of token
  t+1 (zeroed at position 0, as vLLM's DeepSeekMultiTokenPredictorLayer does):
  enorm/hnorm, eh_proj over [embedding; hidden], one decoder layer (GLM-5's,
  transformers' GlmMoeDsaDecoderLayer), the shared head (shared_head.norm, then
  the main model's output head). The loss is the sum of both cross-entropies.

The architecture keeps GLM-5's attention head dims (MLA: kv_lora 512, rope 64,
nope 192, v 256; the DSA indexer: 32 heads x 128) with a small hidden size, 4
heads, vocab 512 and two layers (dense, then MoE with 8 experts, 2 per token, a
shared expert) plus the MTP block (MoE). Training sequences (128 tokens) do not
exceed index_topk (128), where the DSA top-k selects every earlier token: the
indexer takes no part in training (transformers' indexer has no gradient either)
and keeps its seeded initialization, scaled like glm5_tiny's, so that longer
prompts select by scores of order one.

Seeded (torch and numpy); a few minutes on 2 CPU cores. The result (checkpoint,
tokenizer, the measured metrics) is cached under build.py's cache folder
(VLLM_OVERLAY_CACHE, else ~/.cache/vllm-overlay) keyed by a hash of the recipe
and of this module's training code, so CI pays for it once;
VLLM_OVERLAY_GLM5_TRAINED names a ready one (e.g. carried to the offline GPU host).
Bitwise, a run reproduces only with the same torch version and thread count.

    python -m tests.models.glm5_trained [--out DIR]   # train (or find) and print metrics
"""

import hashlib
import inspect
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from tests.models.glm5_tiny import TINY_GLM5

N_LAYERS = 2
TRAINED_GLM5 = {
    **TINY_GLM5,
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_hidden_layers": N_LAYERS,
    "first_k_dense_replace": 1,
    "mlp_layer_types": ["dense"] + ["sparse"] * (N_LAYERS - 1),
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 256,
    "routed_scaling_factor": 1.0,
    "indexer_types": ["full"] * N_LAYERS,
    "layer_types": ["deepseek_sparse_attention"] * N_LAYERS,
    "max_position_embeddings": 4096,
}
# The corpus and the optimization.
RECIPE = {
    "seed": 0,
    "content_tokens": (16, 272),  # [first, end) of the ids the corpus uses
    "p_current": 0.7,  # S1[current]
    "p_previous": 0.25,  # S2[previous]; the rest: uniform
    "seq_len": 128,
    "batch": 8,
    "steps": 320,
    "lr": 3e-3,
    "warmup": 30,
    "mtp_weight": 1.0,
    "eval_sequences": 32,
}


def corpus_rules(recipe: dict = RECIPE) -> tuple[np.ndarray, np.ndarray]:
    """The successor tables S1 and S2, indexed by token id (content tokens only)."""
    lo, hi = recipe["content_tokens"]
    rng = np.random.default_rng(recipe["seed"])
    s1 = np.zeros(hi, dtype=np.int64)
    s2 = np.zeros(hi, dtype=np.int64)
    s1[lo:] = lo + rng.permutation(hi - lo)
    s2[lo:] = lo + rng.permutation(hi - lo)
    return s1, s2


def sample(n: int, length: int, seed: int, recipe: dict = RECIPE) -> torch.Tensor:
    """`n` corpus sequences of `length` tokens, from `seed`."""
    lo, hi = recipe["content_tokens"]
    s1, s2 = corpus_rules(recipe)
    rng = np.random.default_rng([recipe["seed"], seed])
    x = np.zeros((n, length), dtype=np.int64)
    x[:, :2] = rng.integers(lo, hi, size=(n, 2))
    for t in range(2, length):
        u = rng.random(n)
        x[:, t] = np.where(u < recipe["p_current"], s1[x[:, t - 1]],
                           np.where(u < recipe["p_current"] + recipe["p_previous"],
                                    s2[x[:, t - 2]], rng.integers(lo, hi, size=n)))
    return torch.from_numpy(x)


def prompts(lengths, seed: int = 1000, recipe: dict = RECIPE) -> list[list[int]]:
    """Corpus prompts of the given lengths (for the engine tests)."""
    return [sample(1, n, seed + i, recipe)[0].tolist() for i, n in enumerate(lengths)]


def _config(num_layers: int):
    from transformers import GlmMoeDsaConfig

    cfg = {k: v for k, v in TRAINED_GLM5.items()
           if k not in ("architectures", "model_type", "torch_dtype")}
    extra = num_layers - N_LAYERS
    cfg.update(num_hidden_layers=num_layers,
               mlp_layer_types=cfg["mlp_layer_types"] + ["sparse"] * extra,
               indexer_types=cfg["indexer_types"] + ["full"] * extra,
               layer_types=cfg["layer_types"] + ["deepseek_sparse_attention"] * extra)
    config = GlmMoeDsaConfig(**cfg)
    config._attn_implementation = "sdpa"
    return config


class TrainedGlm5(torch.nn.Module):
    """transformers' GlmMoeDsaForCausalLM with the MTP block as its layer N
    (N = num_hidden_layers), plus the MTP module's own tensors."""

    def __init__(self):
        super().__init__()
        from transformers import GlmMoeDsaForCausalLM

        self.lm = GlmMoeDsaForCausalLM(_config(N_LAYERS + 1))
        h = TRAINED_GLM5["hidden_size"]
        eps = TRAINED_GLM5["rms_norm_eps"]
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaRMSNorm

        self.enorm = GlmMoeDsaRMSNorm(h, eps)
        self.hnorm = GlmMoeDsaRMSNorm(h, eps)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.shared_head_norm = GlmMoeDsaRMSNorm(h, eps)

    def _layers(self, x, layers, positions):
        b, s, _ = x.shape
        pos = positions.expand(b, s)
        rotary = self.lm.model.rotary_emb(x, position_ids=pos)
        mask = torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s)
        for layer in layers:
            x, _ = layer(x, attention_mask=mask, position_embeddings=rotary, position_ids=pos)
        return x

    def forward(self, ids: torch.Tensor):
        """(main logits for tokens 1.., MTP logits for tokens 2..)."""
        m = self.lm.model
        s = ids.shape[1]
        emb = m.embed_tokens(ids)
        h = m.norm(self._layers(emb, m.layers[:N_LAYERS], torch.arange(s)[None]))
        logits = self.lm.lm_head(h)
        # MTP at position t: embedding of token t+1, hidden state of token t
        e = emb[:, 1:]
        positions = torch.arange(s - 1)[None]
        e = torch.where(positions[..., None] == 0, torch.zeros_like(e), e)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h[:, :-1])], -1))
        x = self._layers(x, m.layers[N_LAYERS:], positions)
        mtp_logits = self.lm.lm_head(self.shared_head_norm(x))
        return logits[:, :-1], mtp_logits[:, :-1]


class _AllTokensIndexer:
    """The DSA top-k of a sequence no longer than index_topk: every token (what
    transformers' GlmMoeDsaIndexer returns then, without computing scores)."""

    def __enter__(self):
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as mod

        self.mod, self.forward = mod, mod.GlmMoeDsaIndexer.forward

        def forward(indexer, hidden_states, *args, **kwargs):
            b, s, _ = hidden_states.shape
            assert s <= indexer.index_topk
            return torch.arange(s, dtype=torch.int32).expand(b, s, s)

        mod.GlmMoeDsaIndexer.forward = forward
        return self

    def __exit__(self, *exc):
        self.mod.GlmMoeDsaIndexer.forward = self.forward


def _init(model: TrainedGlm5, seed: int) -> None:
    """transformers' initialization, but the indexer and the MTP tensors scaled
    like glm5_tiny's random model (weights N(0, 0.5 / sqrt(fan_in)), norms 1)."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".indexer." in name or name == "eh_proj.weight":
                if "norm" in name:
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5 / p.shape[-1] ** 0.5)
            elif name.endswith("norm.weight"):
                p.fill_(1.0)


def train(recipe: dict = RECIPE, log=print) -> tuple[TrainedGlm5, dict]:
    torch.manual_seed(recipe["seed"])
    model = TrainedGlm5()
    _init(model, recipe["seed"])
    params = [p for n, p in model.named_parameters() if ".indexer." not in n]
    opt = torch.optim.AdamW(params, lr=recipe["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    steps, warmup = recipe["steps"], recipe["warmup"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min((i + 1) / warmup, 1.0) * (
        0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * min(i / steps, 1.0)))))
    ce = torch.nn.functional.cross_entropy
    start = time.perf_counter()
    model.train()
    with _AllTokensIndexer():
        for step in range(steps):
            ids = sample(recipe["batch"], recipe["seq_len"], seed=step)
            logits, mtp = model(ids)
            main_loss = ce(logits.flatten(0, 1), ids[:, 1:].flatten())
            mtp_loss = ce(mtp.flatten(0, 1), ids[:, 2:].flatten())
            loss = main_loss + recipe["mtp_weight"] * mtp_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            if step % 40 == 0 or step == steps - 1:
                log(f"step {step}: main {main_loss.item():.3f} mtp {mtp_loss.item():.3f} "
                    f"({time.perf_counter() - start:.0f} s)")
    seconds = time.perf_counter() - start
    model.eval()
    # what the checkpoint holds: bf16
    model.to(torch.bfloat16).float()
    metrics = evaluate(model, recipe)
    metrics.update(train_seconds=round(seconds, 1), threads=torch.get_num_threads(),
                   torch=torch.__version__)
    return model, metrics


@torch.no_grad()
def evaluate(model: TrainedGlm5, recipe: dict = RECIPE) -> dict:
    """On held-out corpus sequences: the main model's greedy confidence and
    accuracy, the MTP head's accuracy at token t+2, against chance."""
    ids = sample(recipe["eval_sequences"], recipe["seq_len"], seed=10 ** 6)
    with _AllTokensIndexer():
        logits, mtp = model(ids)
    p = logits.float().softmax(-1)
    top2 = p.topk(2, -1).values
    lo, hi = recipe["content_tokens"]
    mtp_pred = mtp.argmax(-1)
    return {
        "main_top1_prob": round(top2[..., 0].mean().item(), 4),
        "main_top1_margin_nats": round((top2[..., 0].log() - top2[..., 1].log()).mean().item(), 3),
        "main_accuracy": round((logits.argmax(-1) == ids[:, 1:]).float().mean().item(), 4),
        # the best any predictor can do: the rule's token, p_current plus its share
        # of the uniform rest
        "main_accuracy_ceiling": round(recipe["p_current"] + (1 - recipe["p_current"]
                                                               - recipe["p_previous"])
                                       / (hi - lo), 4),
        "mtp_accuracy": round((mtp_pred == ids[:, 2:]).float().mean().item(), 4),
        # drafts are checked against the target's greedy token: how often the
        # MTP's token t+2 is the rule's greedy one, S1[token t+1]
        "mtp_agrees_with_main_greedy_rule": round(
            (mtp_pred == torch.from_numpy(corpus_rules(recipe)[0])[ids[:, 1:-1]]).float()
            .mean().item(), 4),
        "chance": round(1 / (hi - lo), 4),
        "eval_tokens": int(ids[:, 2:].numel()),
    }


def _digest(recipe: dict) -> str:
    code = "".join(inspect.getsource(f) for f in (
        corpus_rules, sample, _config, TrainedGlm5, _AllTokensIndexer, _init, train, save))
    blob = json.dumps({"config": TRAINED_GLM5, "recipe": recipe}, sort_keys=True) + code
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def save(model: TrainedGlm5, path: Path) -> None:
    """An HF checkpoint as GLM-5's: the main model, the MTP block as
    model.layers.<N>.* (its decoder layer, eh_proj, enorm, hnorm,
    shared_head.norm, shared_head.head: a copy of lm_head, as GLM-5 stores it)."""
    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    model.lm.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    file = path / "model.safetensors"
    tensors = load_file(file)
    mtp = f"model.layers.{N_LAYERS}."
    tensors[mtp + "eh_proj.weight"] = model.eh_proj.weight.detach().bfloat16()
    tensors[mtp + "enorm.weight"] = model.enorm.weight.detach().bfloat16()
    tensors[mtp + "hnorm.weight"] = model.hnorm.weight.detach().bfloat16()
    tensors[mtp + "shared_head.norm.weight"] = model.shared_head_norm.weight.detach().bfloat16()
    tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, file, metadata={"format": "pt"})
    # save_pretrained wrote the N + 1 layer config: GLM-5's has N and one MTP block
    (path / "config.json").write_text(json.dumps(TRAINED_GLM5, indent=1))


def cache_root() -> Path:
    from tools import upstream

    return upstream.cache_dir()


def trained_glm5(recipe: dict = RECIPE, log=print) -> Path:
    """The trained checkpoint's folder (config.json, model.safetensors, the test
    tokenizer, metrics.json), trained once and cached."""
    if os.environ.get("VLLM_OVERLAY_GLM5_TRAINED"):
        return Path(os.environ["VLLM_OVERLAY_GLM5_TRAINED"])
    home = cache_root() / f"glm5-trained-{_digest(recipe)}"
    if (home / "metrics.json").exists():
        return home
    # the test tokenizer, as for the random tiny model
    from tests.models.quantization import gguf_reference as gr

    work = home.with_name(f"{home.name}.partial-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    model, metrics = train(recipe, log=log)
    save(model, work)
    gr.write_tokenizer(work, TRAINED_GLM5["vocab_size"])
    (work / "metrics.json").write_text(json.dumps(metrics, indent=1))
    try:
        work.rename(home)
    except OSError:  # another session finished first
        shutil.rmtree(work)
    return home


def metrics(path: Path) -> dict:
    return json.loads((Path(path) / "metrics.json").read_text())


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="copy the checkpoint here too")
    args = p.parse_args()
    home = trained_glm5()
    if args.out:
        shutil.copytree(home, args.out, dirs_exist_ok=True)
    print(json.dumps({"path": str(home), **metrics(home)}))
