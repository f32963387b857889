# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Check, on this GPU and in about two minutes, the path a GLM-5 GGUF takes.

    python -m vllm_gguf_plugin.selfcheck [--json PATH] [--dir DIR] [--enforce-eager]
        [--dtype auto] [--kv-cache-dtype auto] [--attention-backend NAME]
        [--max-tokens 8] [--gpu-memory-utilization 0.5]

Before downloading 400 GB: writes a tiny GLM-5 GGUF with random weights
(`gguf_model/synthetic.py`: llama.cpp's tensor names, metadata and Q4_K_M
types; GLM-5's attention heads, MLA and indexer dimensions and top-k, so that
vLLM chooses for it what it chooses for GLM-5), prints what vLLM chooses on
this GPU (attention backend, indexer logits kernel, model dtype, KV-cache
dtype, from the GPU's compute capability and shared memory), serves the file
through `vllm.LLM` and generates a few tokens greedily, a prompt longer than
the indexer's top-k among them. Whatever fails is named with the exception and
the setting to change. Exit code 0 when everything ran, 1 otherwise; the last
line is the verdict, `--json` writes the whole report.

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0 unless set),
so that an error reaches the report with its own class and message.
"""

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

# GLM-5's attention (64 heads: vLLM's SM100 order depends on the head count) and
# top-k (FLASHINFER_MLA_SPARSE_SM120 needs 2048) on the tiny model's other dimensions
SHAPE_NAME = "tiny"
SHAPE_OVERRIDES = {"num_attention_heads": 64, "index_topk": 2048}
LAYERS = 4  # a dense layer, then MoE ones
MAX_MODEL_LEN = 4096
PROMPTS = ("The capital of France is",
           # about 2500 tokens, more than the top-k (2048): the indexer's selection runs
           " ".join(f"item {i}: the quick brown fox jumps over the lazy dog." for i in range(130)))

# (what an error's text says, what to change): the first match is the hint
HINTS = (
    (("deep_gemm", "deepgemm"),
     "DeepGEMM failed; the indexer's 16-bit key cache takes the portable Triton kernels, "
     "which need none: VLLM_SPARSE_INDEXER_CACHE=16bit"),
    (("no valid attention backend",),
     "no attention backend accepts this GPU, dtype and KV-cache dtype: try "
     "--kv-cache-dtype bfloat16 (or float16), or --attention-backend TRITON_MLA_SPARSE"),
    (("flashinfer",),
     "FlashInfer failed (its kernels compile on first use and need the CUDA toolkit): "
     "--attention-backend TRITON_MLA_SPARSE avoids it"),
    (("driver version is insufficient", "cuda driver", "cuda_error_unsupported_ptx",
      "unsupported toolchain", "no kernel image"),
     "the NVIDIA driver is older than this build's CUDA, or this GPU is not among the "
     "wheel's targets: update the driver (nvidia-smi shows its CUDA version)"),
    (("error in memory profiling",),
     "another process on this GPU freed or took memory while vLLM measured its own: run the "
     "self-check with the GPU otherwise idle"),
    (("no available memory for the cache blocks",),
     "nothing was left for the KV cache: raise --gpu-memory-utilization or stop other "
     "processes on the GPU"),
    (("out of memory", "outofmemory"),
     "GPU memory: lower --gpu-memory-utilization or stop other processes on the GPU"),
    (("outofresources", "out of resource", "shared memory"),
     "a Triton kernel does not fit this GPU's shared memory: report it with --json's file"),
    (("nvcc", "ninja", "cuda_home"),
     "a kernel compiles on first use and needs the CUDA toolkit (nvcc) and ninja on PATH"),
)


def hint(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".lower()
    for needles, advice in HINTS:
        if any(n in text for n in needles):
            return advice
    return "see the traceback in the report (--json) and the log above"


def model_shape():
    from vllm_gguf_plugin.gguf_model.synthetic import SHAPES

    return dataclasses.replace(SHAPES[SHAPE_NAME], **SHAPE_OVERRIDES)


def gpu_report() -> dict:
    """The GPU as vLLM's platform reports it (a test hook may change what it reports)."""
    from vllm.platforms import current_platform

    report = {"platform": type(current_platform).__name__}
    cap = current_platform.get_device_capability()
    report["capability"] = cap.as_version_str() if cap is not None else None
    for key, read in (("name", current_platform.get_device_name),
                      ("shared_memory_per_block",
                       getattr(current_platform, "get_max_shared_memory_per_block", None))):
        try:
            report[key] = read() if read is not None else None
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            report[key] = f"unknown ({type(e).__name__}: {e})"
    return report


def default_dtype() -> str:
    """What dtype "auto" becomes for a GGUF: the plugin's float16 on compute
    capability >= 10.0, else GLM-5's bfloat16 where the GPU has it."""
    from vllm.platforms import current_platform
    from vllm_gguf_plugin.plugin import _gguf_prefers_float16

    if _gguf_prefers_float16() or not current_platform.has_device_capability(80):
        return "float16"
    return "bfloat16"


def selection(hf_config, dtype: str = "auto", kv_cache_dtype: str = "auto",
              attention_backend: str | None = None) -> dict:
    """vLLM's choices for this model on this GPU: the attention backend (the
    platform's get_attn_backend_cls, as vLLM's selector calls it), the indexer's
    logits kernel and, for the Triton one, its dots."""
    import torch
    from vllm import envs
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.ops import triton_indexer_logits as il
    from vllm.v1.attention.selector import AttentionSelectorConfig

    dtype = default_dtype() if dtype == "auto" else dtype
    report = {"dtype": dtype, "kv_cache_dtype": kv_cache_dtype if kv_cache_dtype != "auto"
              else f"auto ({dtype}, the model's)"}
    config = VllmConfig()
    # what the sparse backends read of the model config (index_topk, MLA dims)
    config.model_config = SimpleNamespace(hf_config=hf_config, hf_text_config=hf_config)
    selector_config = AttentionSelectorConfig(
        head_size=hf_config.kv_lora_rank + hf_config.qk_rope_head_dim,
        dtype=getattr(torch, dtype), kv_cache_dtype=kv_cache_dtype, block_size=None,
        use_mla=True, has_sink=False, use_sparse=True, use_mm_prefix=False,
        use_per_head_quant_scales=False, attn_type="decoder",
        use_batch_invariant=envs.VLLM_BATCH_INVARIANT)
    selected = AttentionBackendEnum[attention_backend] if attention_backend else None
    with set_current_vllm_config(config):
        try:
            path = current_platform.get_attn_backend_cls(
                selected, selector_config, hf_config.num_attention_heads)
            report["attention_backend"] = next(
                b.name for b in AttentionBackendEnum if b.value and b.get_path() == path)
        except Exception as e:  # noqa: BLE001 - the engine would fail the same way
            report["attention_backend"] = None
            report["attention_error"] = f"{type(e).__name__}: {e}"
        il.indexer_logits_backend.cache_clear()
        try:
            # the keys' dtype: the model's with the opt-in 16-bit key cache, else fp8
            # bytes; deep_gemm_computes is the indexer's own rule for them
            keys16 = il.indexer_cache_16bit()
            if il.deep_gemm_computes(getattr(torch, dtype) if keys16 else torch.uint8):
                report["indexer"] = "DeepGEMM"
            else:
                il.check_triton_indexer_supported(keys16)
                dots = "16-bit" if keys16 else {"fp8": "fp8", "16bit": "16-bit"}[
                    il.triton_indexer_dots()]
                report["indexer"] = f"Triton, {dots} dots"
        except Exception as e:  # noqa: BLE001
            report["indexer"] = None
            report["indexer_error"] = f"{type(e).__name__}: {e}"
        finally:
            il.indexer_logits_backend.cache_clear()
    return report


def serve_and_generate(model: Path, args) -> dict:
    """The file through vllm.LLM: greedy tokens for PROMPTS, their logprobs finite."""
    import math

    from vllm import LLM, SamplingParams

    kwargs = {"model": str(model), "max_model_len": MAX_MODEL_LEN, "seed": 0,
              "enforce_eager": args.enforce_eager, "dtype": args.dtype,
              "kv_cache_dtype": args.kv_cache_dtype,
              "gpu_memory_utilization": args.gpu_memory_utilization}
    if args.attention_backend:
        kwargs["attention_backend"] = args.attention_backend
    start = time.monotonic()
    llm = LLM(**kwargs)
    result = {"load_s": round(time.monotonic() - start, 1)}
    vllm_config = getattr(llm.llm_engine, "vllm_config", None)
    if vllm_config is not None:
        result["dtype"] = str(vllm_config.model_config.dtype).removeprefix("torch.")
        result["kv_cache_dtype"] = str(vllm_config.cache_config.cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            logprobs=1)
    start = time.monotonic()
    outputs = llm.generate(list(PROMPTS), params, use_tqdm=False)
    result["generate_s"] = round(time.monotonic() - start, 2)
    result["outputs"] = []
    for prompt, out in zip(PROMPTS, outputs):
        completion = out.outputs[0]
        logprobs = [next(iter(step.values())).logprob for step in completion.logprobs or []]
        result["outputs"].append({"prompt_tokens": len(out.prompt_token_ids),
                                  "token_ids": list(completion.token_ids),
                                  "text": completion.text})
        if len(completion.token_ids) != args.max_tokens:
            raise RuntimeError(f"generated {len(completion.token_ids)} tokens for a "
                               f"{len(out.prompt_token_ids)}-token prompt, expected "
                               f"{args.max_tokens}")
        if not all(math.isfinite(lp) for lp in logprobs):
            raise FloatingPointError(f"non-finite logprobs {logprobs} for a "
                                     f"{len(out.prompt_token_ids)}-token prompt: the "
                                     f"model's {result.get('dtype')} activations overflow "
                                     "or a kernel computes garbage on this GPU")
    return result


def run(args) -> dict:
    """The check's report; report["ok"] says whether everything ran."""
    from vllm_gguf_plugin.gguf_model.config import config_from_gguf
    from vllm_gguf_plugin.gguf_model.synthetic import write_glm_dsa_gguf

    report: dict = {"ok": False, "versions": versions()}
    stage = "plugins"
    try:
        # the general plugins (this one, test hooks) as the engine loads them
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        stage = "gpu"
        report["gpu"] = gpu_report()
        stage = "write"
        start = time.monotonic()
        directory = Path(args.dir or tempfile.mkdtemp(prefix="vllm-gguf-selfcheck-"))
        directory.mkdir(parents=True, exist_ok=True)
        model = write_glm_dsa_gguf(directory / "glm5-selfcheck-Q4_K_M.gguf", model_shape(),
                                   layers=LAYERS)
        report["model"] = {"path": str(model), "bytes": model.stat().st_size,
                           "write_s": round(time.monotonic() - start, 1)}
        stage = "select"
        hf_config = config_from_gguf(model)
        report["selection"] = selection(hf_config, args.dtype, args.kv_cache_dtype,
                                        args.attention_backend)
        print_selection(report)
        stage = "engine"
        report["engine"] = serve_and_generate(model, args)
        engine = report["engine"]
        chosen = report["selection"]
        if engine.get("dtype") not in (None, chosen["dtype"]):
            # the engine resolved another dtype than predicted: its own choices
            chosen = report["selection"] = selection(hf_config, engine["dtype"],
                                                     args.kv_cache_dtype,
                                                     args.attention_backend)
            print_selection(report)
        report["ok"] = True
    except Exception as e:  # noqa: BLE001 - every failure is the report's
        report["error"] = {"stage": stage, "type": type(e).__name__, "message": str(e),
                           "hint": hint(e), "traceback": traceback.format_exc()}
    return report


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("vllm", "vllm-gguf-plugin", "torch", "triton", "deep_gemm", "flashinfer-python"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def print_selection(report: dict) -> None:
    gpu, sel = report["gpu"], report["selection"]
    smem = gpu.get("shared_memory_per_block")
    print(f"GPU: {gpu.get('name')}, compute capability {gpu.get('capability')}, "
          f"shared memory per block {smem // 1024 if isinstance(smem, int) else smem} KiB")
    print(f"vLLM chooses: attention backend {sel['attention_backend'] or 'none'}, "
          f"indexer {sel['indexer'] or 'none'}, dtype {sel['dtype']}, "
          f"KV cache {sel['kv_cache_dtype']}")
    for key in ("attention_error", "indexer_error"):
        if key in sel:
            print(f"  {key.replace('_', ' ')}: {sel[key]}")


def verdict(report: dict) -> str:
    sel = report.get("selection") or {}
    choice = (f"{sel.get('attention_backend')}, indexer {sel.get('indexer')}, "
              f"{sel.get('dtype')}" if sel else "")
    if report["ok"]:
        engine = report["engine"]
        return (f"SELF-CHECK OK: {choice}; loaded in {engine['load_s']} s, generated "
                f"{sum(len(o['token_ids']) for o in engine['outputs'])} tokens")
    err = report["error"]
    return (f"SELF-CHECK FAILED at {err['stage']}: {err['type']}: "
            f"{err['message'].splitlines()[0] if err['message'] else ''} -- {err['hint']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_gguf_plugin.selfcheck",
                                description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, help="write the report there")
    p.add_argument("--dir", help="where the tiny GGUF goes (default: a temporary folder)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no torch.compile and CUDA graphs (faster, not the default path)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    report = run(args)
    if not report["ok"]:
        print(report["error"]["traceback"], file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    print(verdict(report), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
