# SPDX-License-Identifier: Apache-2.0
"""vLLM's GlmMoeDsaForCausalLM built and filled on CPU from a glm-dsa GGUF, the way
the GGUF plugin's loader does it in the engine, for tests without a GPU; or from the HF
checkpoint directory (safetensors) by vLLM's own loader, as the engine loads it.

    python -m tests.models.quantization.glm5_vllm_cpu FILE.gguf|DIR [FILE.gguf|DIR ...]
        [--hf DIR] [--dtype bfloat16|float16|float32] [--inputs IDS.pt --out LOGITS.pt]
        [--file-eps]

Run it as a script (the stubs below change vLLM's platform for the whole process).
What the engine would pick from the device is stubbed:
- the platform (none here) puts tensors on the CPU and reports 132 SMs;
- sparse MLA layers take the TRITON_MLA_SPARSE backend class (constructed, not
  run) and no dense-MHA prefill backend (sparse MLA's fallback when none fits);
- unquantized MoE layers take the Triton backend, without selecting its kernel.
Then the loader itself (vllm_gguf_plugin.loader.GGUFModelLoader.load_model: the
adapter's load spec, the model, load_weights, the adapter's check that every
parameter was filled; for a directory vLLM's DefaultModelLoader.load_model, load
format safetensors); the model's load_weights sets the RMSNorm eps of a float16
model's scaled residual stream (deepseek_fp16_residual_scale.py), whatever the loader;
process_weights_after_loading, which prepares kernels, is replaced by nothing. vLLM's
custom ops run their PyTorch (forward_native) paths.

With --inputs (a torch file of token ids [T], T <= index_topk: the sparse top-k then
selects every earlier token) the one file's model runs them on the CPU (vLLM's
modules: embedding, norms, projections, RoPE, the decoder layers' float16 scaling, the
shared experts, the head) with three device kernels replaced by plain PyTorch on the
loaded parameters (stub_kernels): MLA attention (causal softmax attention of the
absorbed query over the latents, kv_b_proj split per head as MLAAttention splits it),
the DSA indexer (not run), the routed experts (sigmoid scores, the correction bias for
the choice, top-k, renormalized, the runner's own routed_scaling_factor rule); the
float32 logits [T, vocab] go to --out. GGUF products of quantized types need the
device: bf16, f16 and f32 files only. --file-eps runs them with every RMSNorm back at the
file's eps (rms_norm_eps): a float16 model without its stream's eps matched.

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


def dense_mla(layer, q, kv_c_normed, k_pe, output_shape=None):
    """MLAAttention's output for a causal prefill of every token, in PyTorch."""
    num_heads, nope, v = layer.num_heads, layer.qk_nope_head_dim, layer.v_head_dim
    w = layer.kv_b_proj.weight.float().view(num_heads, nope + v, -1)
    w_uk, w_uv = w[:, :nope], w[:, nope:]  # [H, nope, kv_lora], [H, v, kv_lora]
    q = q.float()
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    # absorbed: q_nope W_UK against the latents, plus the RoPE parts
    scores = torch.einsum("thn,hnc,sc->hts", q_nope, w_uk, kv_c_normed.float())
    scores = scores + torch.einsum("thr,sr->hts", q_pe, k_pe.float().squeeze(1))
    scores = scores * layer.scale
    t = q.shape[0]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    out = torch.einsum("hts,sc,hvc->thv", probs, kv_c_normed.float(), w_uv)
    return out.reshape(t, num_heads * v).to(kv_c_normed.dtype)


def moe_forward(runner, shared_experts, hidden_states, router_logits, input_ids=None):
    """The MoE runner's output (routed plus shared experts), in PyTorch: the
    router's logits from its gate (vLLM's GateLinear), sigmoid scores, the
    correction bias for the choice only, top-k, renormalized weights (scaled by
    the router's routed_scaling_factor, 1 where the runner applies it), the loaded
    w13 (gate rows, then up) and w2 stacks; the shared experts are vLLM's module,
    and the runner's own rule applies its routed_scaling_factor (in float16 it
    divides the shared output instead, for the decoder layer's scaled stream)."""
    experts = runner.routed_experts
    assert experts.scoring_func == "sigmoid"
    x = hidden_states.float()
    if runner.gate is not None:  # the router runs inside (is_internal_router)
        router_logits = runner.gate(hidden_states)
        router_logits = router_logits[0] if isinstance(router_logits, tuple) else router_logits
    scores = router_logits.float().sigmoid()
    bias = experts.e_score_correction_bias
    choice = scores + (bias.float() if bias is not None else 0.0)
    top = choice.topk(experts.top_k, dim=-1).indices
    weights = scores.gather(1, top)
    if experts.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights * experts.routed_scaling_factor
    w13, w2 = experts.w13_weight.float(), experts.w2_weight.float()
    inter = w2.shape[-1]
    routed = torch.zeros_like(x)
    for k in range(top.shape[1]):
        g = torch.einsum("th,tih->ti", x, w13[top[:, k]])
        act = torch.nn.functional.silu(g[:, :inter]) * g[:, inter:]
        routed += weights[:, k:k + 1] * torch.einsum("ti,thi->th", act, w2[top[:, k]])
    routed = routed.to(hidden_states.dtype)
    shared = shared_experts(hidden_states) if shared_experts is not None else None
    shared, routed = runner._maybe_apply_routed_scale_to_output(shared, routed)
    return routed if shared is None else routed + shared


def stub_kernels(model) -> None:
    """Replace the device kernels of every decoder layer (a target's or an MTP
    draft's) by the PyTorch above."""
    import functools
    import types

    from vllm.model_executor.layers.attention import MLAAttention
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2MoE

    for module in model.modules():
        if isinstance(module, MLAAttention):
            module.forward = types.MethodType(dense_mla, module)
        elif isinstance(module, DeepseekV2MoE):
            module.experts.forward = functools.partial(moe_forward, module.experts,
                                                       module.shared_experts)
        elif getattr(module, "indexer", None) is not None and hasattr(module, "skip_topk"):
            module.skip_topk = True  # every earlier token is in the top-k


def model_config(gguf_file: str, dtype: str, max_model_len: int = 2048):
    """The ModelConfig of `gguf_file` (nothing but the file), or of a checkpoint directory."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=gguf_file, max_model_len=max_model_len, skip_tokenizer_init=True,
                      dtype=dtype).create_model_config()


def cpu_config(model, load_format: str = "gguf", **extra):
    """The VllmConfig of ModelConfig `model` on the CPU, eager, with `extra` keywords."""
    from vllm.config import CompilationConfig, DeviceConfig, LoadConfig, VllmConfig
    from vllm.config.compilation import CompilationMode

    # custom ops off: vLLM's modules run their PyTorch (forward_native) paths
    return VllmConfig(model_config=model, load_config=LoadConfig(load_format=load_format),
                      device_config=DeviceConfig(device="cpu"),
                      compilation_config=CompilationConfig(mode=CompilationMode.NONE,
                                                           custom_ops=["none"]), **extra)


def loader_of(model_path):
    """(the module whose process_weights_after_loading the loader calls, the loader class,
    the load format) of `model_path`: a GGUF file, the plugin's GGUFModelLoader; a
    checkpoint directory, vLLM's DefaultModelLoader (safetensors)."""
    import vllm.model_executor.model_loader.base_loader as base_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    import vllm_gguf_plugin.loader as gguf_loader

    if Path(model_path).is_dir():
        return base_loader, DefaultModelLoader, "safetensors"
    return gguf_loader, gguf_loader.GGUFModelLoader, "gguf"


def build(model_path: str, dtype: str = "bfloat16", max_model_len: int = 2048, **extra):
    """(config, the vLLM model of `model_path` filled by its loader (loader_of): a GGUF
    file (nothing but the file), or a checkpoint directory); `extra`: VllmConfig's
    other keywords (cache_config, ...)."""
    from vllm.config import set_current_vllm_config

    loader_module, loader_cls, load_format = loader_of(model_path)
    config = cpu_config(model_config(model_path, dtype, max_model_len), load_format, **extra)
    prepare_kernels = loader_module.process_weights_after_loading
    loader_module.process_weights_after_loading = lambda *args, **kwargs: None
    try:
        with set_current_vllm_config(config):
            loader = loader_cls(config.load_config)
            model = loader.load_model(config, config.model_config)
    finally:
        loader_module.process_weights_after_loading = prepare_kernels
    return config, model


@torch.no_grad()
def logits(config, model, input_ids: torch.Tensor) -> torch.Tensor:
    """The model's logits (float32) for one prompt of at most index_topk tokens (the
    sparse top-k then selects every earlier token), with stub_kernels' PyTorch."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    assert len(input_ids) <= model.config.index_topk
    stub_kernels(model)
    with set_current_vllm_config(config), set_forward_context(None, config):
        hidden = model(input_ids=input_ids, positions=torch.arange(len(input_ids)))
        return model.compute_logits(hidden).float()


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
    p.add_argument("gguf", nargs="+", help="GGUF files or HF checkpoint directories")
    p.add_argument("--hf", default=None, help="HF checkpoint to compare the parameters with")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--inputs", default=None, help="token ids (a torch file [T]) to run")
    p.add_argument("--out", default=None, help="with --inputs: where the logits go")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--file-eps", action="store_true",
                   help="with --inputs: every RMSNorm at the file's eps (the fix undone)")
    args = p.parse_args()
    if args.inputs is not None and (len(args.gguf) != 1 or args.out is None):
        p.error("--inputs runs one file and needs --out")
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    stub_device_selection()
    init_single_process()
    hf = None
    if args.hf is not None:
        from safetensors.torch import load_file

        hf = {k: v.float() for k, v in load_file(Path(args.hf) / "model.safetensors").items()}
    built = [build(f, args.dtype, args.max_model_len) for f in args.gguf]
    report = [summary(model, hf) for _, model in built]
    if args.inputs is not None:
        if args.file_eps:
            for _, norm in rms_norms(built[0][1]):
                norm.variance_epsilon = built[0][1].config.rms_norm_eps
        torch.save(logits(*built[0], torch.load(args.inputs)), args.out)
    print(json.dumps(report))


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
        "rope_tables": rope_tables(model),
    }


def rope_tables(model) -> dict:
    """{module name: [positions the table holds, its largest error against cos/sin of
    position x theta^(-2i/d) at its last position]} of each unscaled rotary embedding."""
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    tables = {}  # every use, where get_rope shares one module between layers
    for name, m in model.named_modules(remove_duplicate=False):
        if type(m) is not RotaryEmbedding:
            continue
        cache = m.cos_sin_cache.double()
        last = cache.shape[0] - 1
        inv_freq = 1.0 / (m.base ** (torch.arange(0, m.rotary_dim, 2, dtype=torch.float64)
                                     / m.rotary_dim))
        angles = last * inv_freq
        expect = torch.cat([angles.cos(), angles.sin()])
        tables[name] = [cache.shape[0], (cache[last] - expect).abs().max().item()]
    return tables


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
