# SPDX-License-Identifier: Apache-2.0
"""vLLM's GlmMoeDsaForCausalLM built and filled on CPU from a glm-dsa GGUF, the way
the GGUF plugin's loader does it in the engine, for tests without a GPU.

    python -m tests.models.quantization.glm5_vllm_cpu FILE.gguf [FILE.gguf ...] [--hf DIR]

Run it as a script (the stubs below change vLLM's platform for the whole process).
What the engine would pick from the device is stubbed; nothing is run:
- the platform (none here) puts tensors on the CPU and reports 132 SMs;
- sparse MLA layers take the TRITON_MLA_SPARSE backend class (constructed, not
  run) and no dense-MHA prefill backend (sparse MLA's fallback when none fits);
- unquantized MoE layers take the Triton backend, without selecting its kernel.
Then the loader itself (vllm_gguf_plugin.loader.GGUFModelLoader.load_model): the
adapter's load spec, the model, load_weights, the adapter's check that every
parameter was filled, the RMSNorm eps of a float16 model's scaled residual stream
(fp16_residual_scale.py); process_weights_after_loading, which prepares kernels, is
replaced by nothing.

Prints JSON on its last line, a list with one entry per file: {"params": {name: [dtype,
shape]}, "indexer_layers": [...], "errors": {name: relative error}, "norm_eps": {name:
eps of each RMSNorm}, "scaled_norms": {name: [error, error with the file's eps]},
"indexer_caches": {name: [head_size, dtype, page bytes]}}, the errors of the parameters
held unquantized against the HF checkpoint given by --hf, in vLLM's fused layout (None:
no such HF tensor or another shape); "scaled_norms" (float16 only): each RMSNorm whose
eps changed, run in float32 on a residual stream divided by routed_scaling_factor as
vLLM's float16 layers carry it, against the same norm on the undivided stream with the
file's eps (max abs error over max abs value), and the same with the file's eps on the
divided stream.
"""

import argparse
import json
import sys
from pathlib import Path

import torch


def stub_device_selection() -> None:
    from vllm.platforms import current_platform

    platform = type(current_platform)
    platform.device_type = "cpu"
    platform.num_compute_units = classmethod(lambda cls, device_id=0: 132)

    import vllm.model_executor.layers.attention.mla_attention as mla_attention
    import vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method as moe
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.v1.attention.backends.mla.triton_mla_sparse import TritonMLASparseBackend

    def no_prefill_backend(vllm_config):
        raise ValueError("no MLA prefill backend on this platform")

    mla_attention.get_attn_backend = lambda *args, **kwargs: TritonMLASparseBackend
    mla_attention.get_mla_prefill_backend = no_prefill_backend
    moe.select_unquantized_moe_backend = lambda moe_config: (UnquantizedMoeBackend.TRITON, None)


def init_single_process() -> None:
    """vLLM's process groups for one CPU process (gloo)."""
    import socket

    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1, 1)


def build(gguf_file: str, dtype: str = "bfloat16"):
    """The vLLM model of `gguf_file` (nothing but the file), filled by the loader."""
    from vllm.config import DeviceConfig, LoadConfig, VllmConfig, set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    import vllm_gguf_plugin.loader as gguf_loader

    model_config = EngineArgs(model=gguf_file, max_model_len=2048, skip_tokenizer_init=True,
                              dtype=dtype).create_model_config()
    config = VllmConfig(model_config=model_config, load_config=LoadConfig(load_format="gguf"),
                        device_config=DeviceConfig(device="cpu"))
    prepare_kernels = gguf_loader.process_weights_after_loading
    gguf_loader.process_weights_after_loading = lambda *args, **kwargs: None
    try:
        with set_current_vllm_config(config):
            return gguf_loader.GGUFModelLoader(config.load_config).load_model(config, model_config)
    finally:
        gguf_loader.process_weights_after_loading = prepare_kernels


def hf_value(hf: dict[str, torch.Tensor], name: str, n_experts: int) -> torch.Tensor | None:
    """The HF checkpoint's value of vLLM parameter `name` (vLLM fuses some)."""
    base = name.removesuffix(".weight")
    fused = {"self_attn.fused_qkv_a_proj": ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
             "gate_up_proj": ("gate_proj", "up_proj"),
             "self_attn.indexer.wk_weights_proj": ("self_attn.indexer.wk",
                                                    "self_attn.indexer.weights_proj")}
    for suffix, parts in fused.items():
        if base.endswith(suffix):
            head = base.removesuffix(suffix)
            return torch.cat([hf[f"{head}{p}.weight"] for p in parts])
    if ".mlp.experts.routed_experts." in name:
        head = name.split(".experts.")[0] + ".experts"
        parts = ("gate_proj", "up_proj") if name.endswith("w13_weight") else ("down_proj",)
        return torch.stack([torch.cat([hf[f"{head}.{e}.{p}.weight"] for p in parts])
                            for e in range(n_experts)])
    return hf.get(name)


def describe(param: torch.nn.Parameter) -> list:
    """[dtype, shape]; a GGUF parameter of merged shards stays uninitialized until
    process_weights_after_loading: ["gguf shards", their count]."""
    if isinstance(param, torch.nn.parameter.UninitializedParameter):
        return ["gguf shards", len(getattr(param, "data_container", []))]
    return [str(param.dtype), list(param.shape)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("gguf", nargs="+")
    p.add_argument("--hf", default=None, help="HF checkpoint to compare the parameters with")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    args = p.parse_args()
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    stub_device_selection()
    init_single_process()
    hf = None
    if args.hf is not None:
        from safetensors.torch import load_file

        hf = {k: v.float() for k, v in load_file(Path(args.hf) / "model.safetensors").items()}
    print(json.dumps([summary(build(f, args.dtype), hf) for f in args.gguf]))


def summary(model, hf: dict[str, torch.Tensor] | None) -> dict:
    params = dict(model.named_parameters())
    errors = {}
    if hf is not None:
        n_experts = model.config.n_routed_experts
        for name, param in params.items():
            if (isinstance(param, torch.nn.parameter.UninitializedParameter)
                    or param.dtype not in (torch.float32, torch.float16, torch.bfloat16)):
                continue  # GGUF blocks (qweight) and their types
            ref = hf_value(hf, name, n_experts)
            if ref is None or ref.shape != param.shape:
                errors[name] = None
            else:
                errors[name] = ((param.float() - ref).norm() / ref.norm().clamp(min=1e-30)).item()
    return {
        "params": {n: describe(t) for n, t in params.items()},
        "indexer_layers": sorted({int(n.split(".")[2]) for n in params if ".indexer." in n}),
        "errors": errors,
        "norm_eps": {n: m.variance_epsilon for n, m in rms_norms(model)},
        "scaled_norms": scaled_norms(model),
        "indexer_caches": indexer_caches(model),
    }


def indexer_caches(model) -> dict:
    """{layer name: [head_size, dtype, page bytes]} of each indexer key cache's KV cache
    spec, as the engine allocates it."""
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache

    specs = {m.prefix: m.get_kv_cache_spec(None) for m in model.modules()
             if isinstance(m, DeepseekV32IndexerCache)}
    return {n: [s.head_size, str(s.dtype), s.page_size_bytes] for n, s in specs.items()}


def rms_norms(model):
    from vllm.model_executor.layers.layernorm import RMSNorm

    return [(n, m) for n, m in model.named_modules() if isinstance(m, RMSNorm)]


@torch.no_grad()
def scaled_norms(model) -> dict:
    """{name: [error, error with the file's eps]} for each RMSNorm whose eps is not the
    file's: on a stream of mean square near eps, where eps matters."""
    eps, scale = model.config.rms_norm_eps, model.config.routed_scaling_factor
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, norm in rms_norms(model):
        if norm.variance_epsilon == eps:
            continue
        matched = norm.variance_epsilon
        x, r = (torch.randn(4, norm.hidden_size, generator=gen) * eps**0.5 for _ in range(2))

        def run(div):  # the fused add + norm may work in place: fresh inputs each time
            return norm.forward_native(x / div, r / div)[0].float()

        norm.variance_epsilon = eps
        ref, unmatched = run(1.0), run(scale)
        norm.variance_epsilon = matched
        got = run(scale)
        peak = ref.abs().max()
        out[name] = [float((got - ref).abs().max() / peak),
                     float((unmatched - ref).abs().max() / peak)]
    return out


if __name__ == "__main__":
    sys.exit(main())
