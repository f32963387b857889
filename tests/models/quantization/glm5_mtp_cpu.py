# SPDX-License-Identifier: Apache-2.0
"""vLLM's MTP draft of GLM-5 (DeepSeekMTP) built and filled on CPU from a glm-dsa
GGUF (or from the HF checkpoint directory, by vLLM's safetensors loader) the way the
engine does it for `--speculative-config '{"method": "mtp", ...}'`, and run on given
inputs.

    python -m tests.models.quantization.glm5_mtp_cpu FILE.gguf|DIR --out OUT.pt [--inputs IN.pt]
        [--tokens N] [--dtype float32|bfloat16|float16]

Run it as a script (glm5_vllm_cpu's stubs change vLLM's platform for the process).
The configs are made by vLLM's own code: EngineArgs for the target (nothing but the
file), SpeculativeConfig for the draft (method "mtp": the draft's ModelConfig, its
hf_config override to deepseek_mtp). The engine's loading is kept: the target model
first (GGUFModelLoader.load_model, or DefaultModelLoader's for a directory, as the GPU
model runner), then vLLM's MTP proposer (EagleProposer, as the GPU model runner makes
it for method "mtp") and its load_model(target): the draft through the same loader with
the draft's model config,
then what the proposer shares of the target's modules (embedding, head). Left out: process_weights_after_loading, which prepares device kernels (as
in glm5_vllm_cpu.py), and pinned host memory.

With --inputs (a torch file {"input_ids": [T], "positions": [T], "hidden_states":
[T, hidden]}), the draft's forward runs on the CPU (DeepSeekMTP.forward and
compute_logits, vLLM's own modules: embedding, enorm/hnorm, eh_proj, the decoder
layer's norms, projections, RoPE and shared experts, the shared head, the logits
processor) with three device kernels (MLA attention, the DSA indexer, the routed
experts) replaced by plain PyTorch on the loaded parameters, as glm5_vllm_cpu.py
runs the target (stub_kernels), valid while T <= index_topk (the sparse top-k then
selects every earlier token).
OUT.pt holds {"logits": [T, vocab], "hidden_states": [T, hidden] (pre-norm),
"normed_hidden_states": [T, hidden] (the shared head's norm of them, what the next step takes),
"params": {name: tensor}} (the draft's parameters as loaded, before the proposer
shares the target's; a GGUF parameter of merged shards, which stays uninitialized
until process_weights_after_loading, as "<name>:<shard id>" per shard, its weight
type likewise).

Prints JSON on its last line: the draft's config fields, its parameters'
[dtype, shape] as loaded, which quant method each module took, the eps of each of
its RMSNorms (as the loader left them: float16 changes some), and what the
proposer shares: whether the draft's embedding and each MTP layer's head are the
target's modules, and the GGUF tensor each of them was loaded from.
"""

import argparse
import json
import sys

import torch

from tests.models.quantization.glm5_vllm_cpu import (cpu_config, describe,
                                                     init_single_process, loader_of,
                                                     model_config, rms_norms,
                                                     stub_device_selection, stub_kernels)


def configs(gguf_file: str, num_speculative_tokens: int, dtype: str):
    from vllm.config import ParallelConfig, SpeculativeConfig

    target = model_config(gguf_file, dtype)
    spec = SpeculativeConfig(target_model_config=target,
                             target_parallel_config=ParallelConfig(), method="mtp",
                             num_speculative_tokens=num_speculative_tokens)
    return (cpu_config(target, loader_of(gguf_file)[2], speculative_config=spec),
            spec.draft_model_config)


def build(gguf_file: str, num_speculative_tokens: int, dtype: str):
    """(config, draft config, target, the proposer after load_model, the draft as
    the loader filled it: {"tensors": loaded_tensors, "params": describe'd})."""
    import vllm.v1.spec_decode.llm_base_proposer as proposer_module
    from vllm.config import set_current_vllm_config
    from vllm.v1.spec_decode.eagle import EagleProposer

    loader_module, loader_cls, _ = loader_of(gguf_file)
    loader_module.process_weights_after_loading = lambda *args, **kwargs: None
    proposer_module.PIN_MEMORY = False  # pinned host memory needs a GPU
    config, draft_config = configs(gguf_file, num_speculative_tokens, dtype)
    loaded = {}
    with set_current_vllm_config(config):
        target = loader_cls(config.load_config).load_model(config, config.model_config)
        proposer = EagleProposer(config, torch.device("cpu"))
        get_model = proposer._get_model

        def get_draft():  # the draft as loaded, before the proposer shares modules
            model = get_model()
            loaded["tensors"] = loaded_tensors(model)
            loaded["params"] = {n: describe(t) for n, t in model.named_parameters()}
            return model

        proposer._get_model = get_draft
        proposer.load_model(target)
    return config, draft_config, target, proposer, loaded


def sharing(target, draft) -> dict:
    """What the draft holds of the target's after the proposer's load_model, and the
    GGUF tensor each module was loaded from (the adapter's gguf_source)."""
    from vllm_gguf_plugin.spec_decode import gguf_source

    def source(module):
        return (gguf_source(module) or (None, None))[1]

    heads = {k: layer.shared_head.head for k, layer in draft.model.layers.items()}
    return {"embed_shared": draft.model.embed_tokens is target.model.embed_tokens,
            "embed_source": source(draft.model.embed_tokens),
            "target_embed_source": source(target.model.embed_tokens),
            "head_shared": {k: h is target.lm_head for k, h in heads.items()},
            "head_source": {k: source(h) for k, h in heads.items()},
            "target_head_source": source(target.lm_head)}


def loaded_tensors(model) -> dict[str, torch.Tensor]:
    """{name: the data load_weights put there} of every parameter; the shards of
    a merged GGUF parameter (and their weight types) as "<name>:<shard id>"."""
    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, torch.nn.parameter.UninitializedParameter):
            for shard, i in getattr(p, "shard_id_map", {}).items():
                out[f"{name}:{shard}"] = p.data_container[i].detach().clone()
            for shard, kind in getattr(p, "shard_weight_type", {}).items():
                out[f"{name}:{shard}"] = torch.tensor([kind], dtype=torch.uint8)
        else:
            out[name] = p.detach().clone()
    return out


def quant_methods(model) -> dict[str, str]:
    return {name: type(m.quant_method).__name__ for name, m in model.named_modules()
            if getattr(m, "quant_method", None) is not None}


def run(config, model, inputs: dict) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    stub_kernels(model)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    with set_current_vllm_config(config), set_forward_context(None, config), torch.no_grad():
        hidden, normed = model(input_ids=inputs["input_ids"], positions=inputs["positions"],
                               hidden_states=inputs["hidden_states"].to(dtype))
        logits = model.compute_logits(hidden)
    return {"logits": logits.float(), "hidden_states": hidden.float(),
            "normed_hidden_states": normed.float()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("gguf")
    p.add_argument("--out", required=True)
    p.add_argument("--inputs", default=None)
    p.add_argument("--tokens", type=int, default=1, help="num_speculative_tokens")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    stub_device_selection()
    init_single_process()
    config, draft_config, target, proposer, loaded = build(args.gguf, args.tokens, args.dtype)
    model = proposer.model
    result = {"params": loaded["tensors"]}
    if args.inputs is not None:
        result.update(run(config, model, torch.load(args.inputs)))
    torch.save(result, args.out)
    hf = draft_config.hf_config
    print(json.dumps({
        "draft": {"model_type": hf.model_type, "architectures": hf.architectures,
                  "n_predict": getattr(hf, "n_predict", None),
                  "num_hidden_layers": hf.num_hidden_layers,
                  "num_nextn_predict_layers": hf.num_nextn_predict_layers,
                  "index_share_for_mtp_iteration": getattr(
                      hf, "index_share_for_mtp_iteration", None),
                  "model": draft_config.model, "hf_config_path": draft_config.hf_config_path,
                  "model_weights": draft_config.model_weights,
                  "runner_type": draft_config.runner_type,
                  "quantization": draft_config.quantization},
        "target_model_type": config.model_config.hf_config.model_type,
        "model_class": type(model).__name__,
        "params": loaded["params"],
        "quant_methods": quant_methods(model),
        "norm_eps": {n: m.variance_epsilon for n, m in rms_norms(model)},
        "sharing": sharing(target, model),
    }))


if __name__ == "__main__":
    sys.exit(main())
