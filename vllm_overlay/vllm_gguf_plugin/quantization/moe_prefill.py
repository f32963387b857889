# SPDX-License-Identifier: Apache-2.0
"""Routed GGUF experts of a long prefill: dequantize, then vLLM's 16-bit fused MoE.

The plugin runs its MMQ MoE kernel (K-quants and legacy quants, int8 activations) from
65 tokens on and its one-pair kernel at every count for I-quants; the time of both grows
with every token, while dequantizing the experts costs the same at any count
(docs/results.md#one-moe-layer). From 1024 tokens on (gguf_kernels'
table), the experts are dequantized a group at a time, at most DEQUANT_MOE_GROUP_VALUES
16-bit values of the gate_up stack per group so that the transient stays bounded, and
each group runs vLLM's fused_experts with an expert map of its own experts; the groups'
outputs add up to the whole. A down product after Marlin's gate_up (moe_marlin.py) runs
the same way alone (dequant_moe_product).
"""

import gguf
import torch
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.fused_moe import (
    fused_experts,
    try_get_optimal_moe_config,
)
from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size

from .linear import dequantize
from .moe_marlin import routed_product

DEQUANT_MOE_GROUP_VALUES = 1 << 28


def dequantize_experts(w: torch.Tensor, qweight_type: int, first: int, end: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """Experts [first, end) of a GGUF stack [experts, rows, bytes] as [n, rows, cols]."""
    block, size = gguf.GGML_QUANT_SIZES[qweight_type]
    n, rows, nbytes = end - first, w.shape[1], w.shape[2]
    cols = nbytes // size * block
    flat = dequantize(w[first:end].reshape(n * rows, nbytes), qweight_type, n * rows, cols,
                      dtype)
    return flat.view(n, rows, cols)


def expert_groups(experts: int, values_per_expert: int) -> list[tuple[int, int]]:
    """[first, end) of each group of experts dequantized at once: at most
    `DEQUANT_MOE_GROUP_VALUES` 16-bit values (at least one expert)."""
    size = max(1, DEQUANT_MOE_GROUP_VALUES // values_per_expert)
    return [(first, min(first + size, experts)) for first in range(0, experts, size)]


def dequant_fused_moe(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      qweight_type: int, qweight_type2: int,
                      activation: MoEActivation) -> torch.Tensor:
    """The routed experts on dequantized weights, `DEQUANT_MOE_GROUP_VALUES` at a time."""
    experts, rows = w1.shape[0], w1.shape[1]
    out = None
    for first, end in expert_groups(experts, rows * x.shape[1]):
        expert_map = None
        if end - first < experts:
            expert_map = torch.full((experts,), -1, dtype=torch.int32, device=x.device)
            expert_map[first:end] = torch.arange(end - first, dtype=torch.int32,
                                                 device=x.device)
        y = fused_experts(x, dequantize_experts(w1, qweight_type, first, end, x.dtype),
                          dequantize_experts(w2, qweight_type2, first, end, x.dtype),
                          topk_weights, topk_ids, activation=activation,
                          global_num_experts=experts, expert_map=expert_map)
        out = y if out is None else out.add_(y)
    return out


def dequant_moe_product(x: torch.Tensor, w: torch.Tensor, qweight_type: int,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """The down product of a layer whose gate_up runs on Marlin (moe_marlin.py): x a row
    per (token, expert) pair [tokens * top_k, k], on the experts dequantized a group at a
    time, each group's pairs on vLLM's Triton fused-MoE kernel, which gives the other
    pairs zeros, so the groups' outputs add up to the whole."""
    (tokens, top_k), (experts, n, _) = topk_ids.shape, w.shape
    config = dequant_moe_product_config(tuple(w.shape), x.shape[1], top_k, tokens)
    out = None
    for first, end in expert_groups(experts, n * x.shape[1]):
        expert_map = torch.full((experts,), -1, dtype=torch.int32, device=x.device)
        expert_map[first:end] = torch.arange(end - first, dtype=torch.int32, device=x.device)
        assignment = moe_align_block_size(topk_ids, config["BLOCK_SIZE_M"], experts,
                                          expert_map)
        y = routed_product(x, dequantize_experts(w, qweight_type, first, end, x.dtype),
                           assignment, 1, config=config)
        out = y if out is None else out.add_(y)
    return out


def dequant_moe_product_config(w_shape: tuple[int, ...], k: int, top_k: int,
                               tokens: int) -> dict[str, int]:
    """The tile of `dequant_moe_product` over `tokens` tokens: the one fused_experts takes
    for a layer of these shapes (gate_up [E, 2k, n])."""
    experts, n = w_shape[0], w_shape[1]
    return try_get_optimal_moe_config((experts, 2 * k, n), w_shape, top_k, None, tokens)


def dequantized_shape(w_shape: tuple[int, ...], qweight_type: int) -> tuple[int, int, int]:
    """A GGUF stack's [experts, rows, bytes] as its dequantized [experts, rows, cols]."""
    block, size = gguf.GGML_QUANT_SIZES[qweight_type]
    return w_shape[0], w_shape[1], w_shape[2] // size * block


def dequant_fused_moe_configs(w1_shape: tuple[int, ...], w2_shape: tuple[int, ...],
                              qweight_type: int, qweight_type2: int, top_k: int,
                              dtype: torch.dtype, tokens: int) -> tuple[tuple, ...]:
    """The tiles fused_experts takes in `dequant_fused_moe` over `tokens` tokens, one per
    size of its expert groups (its own choice, from the dequantized group's shapes)."""
    from vllm.model_executor.layers.fused_moe.config import _get_config_dtype_str

    (experts, rows, cols), (_, rows2, cols2) = (dequantized_shape(w1_shape, qweight_type),
                                                dequantized_shape(w2_shape, qweight_type2))
    sizes = {end - first for first, end in expert_groups(experts, rows * cols)}
    config_dtype = _get_config_dtype_str(dtype=dtype)
    return tuple(tuple(sorted(try_get_optimal_moe_config(
        (n, rows, cols), (n, rows2, cols2), top_k, config_dtype, tokens).items()))
        for n in sorted(sizes))
