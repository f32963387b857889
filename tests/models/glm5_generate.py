# SPDX-License-Identifier: Apache-2.0
"""Generate with vLLM from a (tiny) GLM-5 checkpoint and dump tokens and logprobs.

    python -m tests.models.glm5_generate --model DIR|FILE.gguf --out OUT.json
        [--attention-backend NAME] [--indexer auto|deepgemm|triton] [--kv-cache-dtype D]
        [--eager] [--inspect]

Prompts are fixed random token ids (300 to 1000 tokens, longer than the tiny
model's index_topk, so the indexer's selection matters). Greedy, 32 new tokens,
top-5 logprobs for prompt and output tokens. The engine runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the calls into the portable indexer
kernels and into the Q4_K experts' Marlin MoE can be counted.
"""

import argparse
import importlib
import json
import os
import random

from tests.plugins.vllm_report_capability import vllm_report_capability as hook

PROMPT_LENS = (300, 450, 700, 1000)


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]


def count_into(counts: dict[str, int], key: str, module, name: str) -> None:
    """Replace module.name with a wrapper that adds one to counts[key] at each call."""
    fn = getattr(module, name)

    def counted(*a, **kw):
        result = fn(*a, **kw)
        counts[key] += 1
        return result

    setattr(module, name, counted)


def count_triton_indexer_calls() -> dict[str, int]:
    """Count the portable indexer's prefill and decode calls (in-process engine):
    {"prefill": n, "decode": n}, updated as the engine runs."""
    from vllm.v1.attention.ops import triton_indexer_logits as il

    calls = {"prefill": 0, "decode": 0}
    for kind, name in (("prefill", "triton_mqa_logits"), ("decode", "triton_paged_mqa_logits")):
        count_into(calls, kind, il, name)
    return calls


def count_keys16_cache_calls() -> dict[str, int]:
    """Count the 16-bit indexer key cache's writes and prefill gathers (in-process
    engine; VLLM_SPARSE_INDEXER_CACHE=16bit): {"write": n, "gather": n}."""
    from vllm.v1.attention.ops import triton_indexer_logits as il

    calls = {"write": 0, "gather": 0}
    for kind in calls:
        count_into(calls, kind, il, f"{kind}_k_cache_16bit")
    return calls


def count_marlin_moe_calls() -> dict[str, int] | None:
    """Count the calls into the Q4_K experts' Marlin MoE (in-process engine); None where
    VLLM_GGUF_MOE_MARLIN=0 turns it off."""
    from vllm_gguf_plugin.quantization import gguf_kernels, moe_marlin

    if not gguf_kernels.moe_marlin_enabled():
        return None

    calls = {"moe": 0}
    count_into(calls, "moe", moe_marlin, "fused_moe")
    return calls


def attention_backend_name(llm, layer_filter=None) -> str | None:
    """The attention backend the engine's layers use (in-process engine only): those
    whose name `layer_filter` takes, else all."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    config = llm.llm_engine.vllm_config
    try:
        layers = get_layers_from_vllm_config(config, AttentionLayerBase)
    except Exception:  # noqa: BLE001 - reporting only
        return None
    names = {layer.get_attn_backend().get_name() for name, layer in layers.items()
             if layer_filter is None or layer_filter(name)}
    # the sparse indexer's key cache is a layer of its own; report the attention
    names -= {"DEEPSEEK_V32_INDEXER"}
    if not names:
        return None
    return names.pop() if len(names) == 1 else ",".join(sorted(names))


def inspect_model(llm) -> dict:
    """The loaded model as the engine holds it (in-process engine only): each
    parameter's dtype, shape and a digest of its values, each module's quant
    method, and the model config vLLM built."""
    import hashlib

    import torch

    def collect(model):
        params = {
            name: [str(p.dtype), list(p.shape),
                   hashlib.sha1(p.detach().cpu().contiguous().view(-1).view(
                       torch.uint8).numpy().tobytes()).hexdigest()]
            for name, p in model.named_parameters()
        }
        methods = {name: type(m.quant_method).__name__ for name, m in model.named_modules()
                   if getattr(m, "quant_method", None) is not None}
        return params, methods

    (params, methods), = llm.apply_model(collect)
    config = llm.llm_engine.vllm_config.model_config.hf_text_config.to_dict()
    return {"params": params, "quant_methods": methods,
            "hf_config": json.loads(json.dumps(config, default=str))}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--indexer", default="auto", choices=["auto", "deepgemm", "triton"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--eager", action="store_true")
    p.add_argument("--max-tokens", type=int, default=32)
    # with a fixed KV cache size this only bounds the engine's start-up check of free
    # memory (the tiny model takes a few GiB); small, so that several runs share a GPU
    p.add_argument("--gpu-memory-utilization", type=float, default=0.1)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step (small: prompts are prefilled in chunks, "
                        "mixed with other requests' decodes)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30,
                   help="fixed KV cache size (default 1 GiB, plenty for 8 x 2K tokens of "
                        "the tiny model; 0: size it by profiling). A fixed size skips vLLM's "
                        "memory profiling, which fails while other engines on the GPU "
                        "release memory, so runs can share the GPU")
    p.add_argument("--inspect", action="store_true",
                   help="also dump parameter digests, quant methods and the config")
    args = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # triton: the platform reports no DeepGEMM (the test hook, applied in this process)
    hook.use_indexer(args.indexer)

    from vllm import LLM, SamplingParams
    from vllm.v1.attention.ops import triton_indexer_logits as il

    calls = count_triton_indexer_calls()
    keys16_calls = count_keys16_cache_calls()
    marlin_calls = count_marlin_moe_calls()

    # launches of Hopper's Gluon sparse MLA tiles (none where they cannot run): the
    # warp-specialized one and the 8-head fp8 one
    gluon_calls = {"ws": 0, "rows": 0}
    for module_name, fn_name, key in (("gluon_sparse_mla", "sparse_mla_attention_ws", "ws"),
                                      ("gluon_sparse_mla_fp8", "sparse_mla_attention_fp8",
                                       "rows")):
        try:
            module = importlib.import_module(f"vllm.v1.attention.ops.{module_name}")
        except ImportError:
            continue
        count_into(gluon_calls, key, module, fn_name)

    if args.model.endswith(".gguf"):
        from vllm_gguf_plugin.gguf_model import config_from_gguf

        vocab = config_from_gguf(args.model).vocab_size
    else:
        with open(os.path.join(args.model, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=2048,
        block_size=64,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        tensor_parallel_size=args.tensor_parallel_size,
        enforce_eager=args.eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes or None,
        seed=0,
        attention_config={"backend": args.attention_backend} if args.attention_backend else None,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=5,
                            prompt_logprobs=5, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts(vocab)], params)

    def top(lp):
        return {str(t): v.logprob for t, v in lp.items()} if lp else None

    if args.indexer != "auto" and il.indexer_logits_backend() != args.indexer:
        raise SystemExit(f"--indexer {args.indexer}: this platform's indexer computes on "
                         f"{il.indexer_logits_backend()}")
    model_config = llm.llm_engine.vllm_config.model_config
    result = {
        "args": vars(args),
        "dtype": str(model_config.dtype),
        "kv_cache_dtype": llm.llm_engine.vllm_config.cache_config.cache_dtype,
        "ws_sparse_mla_calls": gluon_calls["ws"],
        "rows_sparse_mla_calls": gluon_calls["rows"],
        "attention_backend": attention_backend_name(llm),
        "indexer_backend": il.indexer_logits_backend(),
        "indexer_dots": il.triton_indexer_dots(),
        "triton_indexer_calls": calls,
        "keys16_cache_calls": keys16_calls,
        "marlin_moe_calls": marlin_calls and marlin_calls["moe"],
        "outputs": [
            {
                "prompt_len": len(o.prompt_token_ids),
                "tokens": list(o.outputs[0].token_ids),
                "logprobs": [top(lp) for lp in o.outputs[0].logprobs],
                "prompt_logprobs": [top(lp) for lp in o.prompt_logprobs],
            }
            for o in outs
        ],
    }
    if args.inspect:
        result["model"] = inspect_model(llm)
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(json.dumps({"out": args.out, "indexer": result["indexer_backend"], "calls": calls}))


if __name__ == "__main__":
    main()
