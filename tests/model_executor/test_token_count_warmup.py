# SPDX-License-Identifier: Apache-2.0
"""vllm/model_executor/warmup/token_count_warmup.py: the model runs once at each token
count that a layer's quantization method lists, past the CUDA graphs' sizes (every count
where no graph pads the step), and a GGUF layer lists the counts of its kernels' choices."""

import sys
from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType as T

from vllm.config import CUDAGraphMode
from vllm.model_executor.warmup import kernel_warmup, token_count_warmup as tcw


class Listed:
    """A quantization method that lists the counts it was given, filtered by a rule."""

    def __init__(self, rule):
        self.rule, self.asked = rule, []

    def warmup_token_counts(self, layer, first, last):
        self.asked.append((first, last))
        return [n for n in range(first, last + 1) if self.rule(n)]


def worker(methods, *, sizes=(1, 2, 4, 8, 512), mode=CUDAGraphMode.FULL_AND_PIECEWISE,
           eager=False, max_tokens=2048):
    model = torch.nn.Module()
    for i, method in enumerate(methods):
        layer = torch.nn.Module()
        layer.quant_method = method
        model.add_module(f"layer{i}", layer)
    model.add_module("plain", torch.nn.Linear(2, 2))
    runs = []
    runner = SimpleNamespace(is_pooling_model=False,
                             _dummy_run=lambda n, **kw: runs.append((n, kw)))
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(cudagraph_capture_sizes=list(sizes),
                                           cudagraph_mode=mode),
        model_config=SimpleNamespace(enforce_eager=eager))
    w = SimpleNamespace(model_runner=runner, vllm_config=config, get_model=lambda: model,
                        scheduler_config=SimpleNamespace(max_num_batched_tokens=max_tokens))
    return w, runs


def test_runs_once_at_every_listed_count_past_the_graphs():
    a, b = Listed(lambda n: n % 700 == 0), Listed(lambda n: n in (600, 700, 2048))
    w, runs = worker([a, b])
    tcw.token_count_warmup(w)
    assert a.asked == b.asked == [(513, 2048)]
    assert [n for n, _ in runs] == [600, 700, 1400, 2048]
    # eager runs, no graph; no load balancer statistics from a warm-up
    assert all(kw["cudagraph_runtime_mode"] == CUDAGraphMode.NONE and kw["skip_eplb"]
               for _, kw in runs)


@pytest.mark.parametrize("kwargs", [{"eager": True}, {"mode": CUDAGraphMode.NONE},
                                    {"mode": CUDAGraphMode.FULL_DECODE_ONLY}, {"sizes": ()}])
def test_every_count_where_no_graph_pads_mixed_batches(kwargs):
    # a mixed batch runs at its exact count unless piecewise graphs pad it
    a = Listed(lambda n: n in (3, 513))
    w, runs = worker([a], **kwargs)
    tcw.token_count_warmup(w)
    assert a.asked == [(1, 2048)] and [n for n, _ in runs] == [3, 513]


def test_nothing_listed_runs_nothing():
    w, runs = worker([object()])
    tcw.token_count_warmup(w)
    assert runs == []
    w, runs = worker([Listed(lambda n: True)], sizes=(1, 4096), max_tokens=4096)
    tcw.token_count_warmup(w)  # every count is a graph's: [4097, 4096] is empty
    assert runs == []


KERNEL_WARMUPS = ("warm_v1_block_table_kernels", "qwen_triton_warmup", "deepseek_v4_mhc_warmup",
                  "sparse_mla_triton_warmup_if_needed",
                  "flashinfer_sparse_mla_decode_autotune_warmup",
                  "deepseek_v4_sparse_mla_attention_warmup", "token_count_warmup",
                  "mla_prefill_warmup", "cutedsl_warmup")


def run_kernel_warmup(monkeypatch, replaced: dict, cutedsl: bool = False):
    """vLLM's kernel_warmup on a stand-in worker, each warm-up it calls stubbed: those in
    `replaced` by the given callables, the rest by no-ops. Returns the worker."""
    for name in KERNEL_WARMUPS:
        monkeypatch.setattr(kernel_warmup, name, replaced.get(name, lambda *a, **k: None))
    # its model module needs vLLM's compiled ops
    monkeypatch.setitem(sys.modules, "vllm.model_executor.warmup.minimax_m3_msa_warmup",
                        SimpleNamespace(minimax_m3_msa_warmup=lambda *a: None))
    monkeypatch.setattr(kernel_warmup.current_platform, "has_device_capability",
                        lambda *a: False, raising=False)
    w = SimpleNamespace(
        use_v2_model_runner=True, get_model=lambda: torch.nn.Module(),
        model_runner=SimpleNamespace(is_pooling_model=False, attn_groups=[]),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8),
        vllm_config=SimpleNamespace(
            model_config=None,
            compilation_config=SimpleNamespace(cudagraph_capture_sizes=[]),
            kernel_config=SimpleNamespace(enable_flashinfer_autotune=False,
                                          enable_cutedsl_warmup=cutedsl)))
    kernel_warmup.kernel_warmup(w)
    return w


def test_kernel_warmup_calls_it(monkeypatch):
    called = []
    w = run_kernel_warmup(monkeypatch, {"token_count_warmup": called.append})
    assert called == [w]


def gguf_moe_layer(gate_up, down, marlin=None):
    from vllm_gguf_plugin.quantization.fused_moe import GGUFMoEMethod

    experts, inter, hidden = 256, 2048, 6144
    method = object.__new__(GGUFMoEMethod)
    method.moe = SimpleNamespace(experts_per_token=8, in_dtype=torch.float16)
    layer = SimpleNamespace(
        w13_qweight_type=SimpleNamespace(weight_type=int(gate_up)),
        w2_qweight_type=SimpleNamespace(weight_type=int(down)),
        w13_qweight=torch.empty(experts, 2 * inter, hidden // 256 * 144, dtype=torch.uint8,
                                device="meta"),
        w2_qweight=torch.empty(experts, hidden, inter // 256 * 210, dtype=torch.uint8,
                               device="meta"),
        gguf_marlin_experts=marlin)
    return method, layer


def test_gguf_layers_list_their_kernels_counts(monkeypatch):
    """A GLM-5 Q4_K_M MoE layer (Q4_K gate_up, Q6_K down) and a Q4_K linear layer list
    the counts gguf_kernels gives for their products, with Marlin's gate_up and without."""
    from vllm.platforms import current_platform

    from vllm_gguf_plugin.quantization import gguf_kernels as gk
    from vllm_gguf_plugin.quantization.linear import GGUFLinearMethod

    monkeypatch.setattr("vllm.envs.VLLM_BATCH_INVARIANT", False, raising=False)
    monkeypatch.setattr(current_platform, "get_device_name", lambda device_id=0: "H100",
                        raising=False)
    method, layer = gguf_moe_layer(T.Q4_K, T.Q6_K)
    assert method.warmup_token_counts(layer, 513, 8192) == (
        513, 514, 516, 520, 528, 768, 769, 770, 772, 776, 3072, 3073, 3074, 3076, 3080)
    method, layer = gguf_moe_layer(T.Q4_K, T.Q6_K, marlin=("gate_up", None))
    # Marlin's gate_up compiles nothing per count; its GGUF down product: MMQ, the
    # Triton tile, dequantized
    assert method.warmup_token_counts(layer, 513, 8192) == gk.moe_warmup_counts(
        int(T.Q4_K), int(T.Q6_K), 513, 8192, batch_invariant=False, marlin=(True, False),
        w1_shape=tuple(layer.w13_qweight.shape), w2_shape=tuple(layer.w2_qweight.shape),
        top_k=8, dtype=torch.float16)
    linear = SimpleNamespace(qweight=SimpleNamespace(shape=(6144, 4096), shard_id=[]),
                             qweight_type=SimpleNamespace(weight_type=int(T.Q4_K)))
    # dequantized + a 16-bit GEMM past 16 tokens: no count-dependent kernel but Triton's
    # specializations of the count
    assert object.__new__(GGUFLinearMethod).warmup_token_counts(linear, 513, 8192) == (
        513, 514, 516, 520, 528)
