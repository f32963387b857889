# SPDX-License-Identifier: Apache-2.0
"""GGUF products under vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1).

The plugin picks its kernels by token count: int8-activation GEMV (MMVQ) for a few
rows, then tiled int8 kernels (MMQ) or dequantize + GEMM. A token's result then
depends on how many tokens share its step (a prompt alone or batched, a decode step or
a speculative verification step), which is what batch invariance rules out. Here every
token count runs one kernel with one fixed tile: the plugin's Triton GEMM and Triton
fused-MoE kernels (16-bit activations; each output row is computed from its own row
of x with the same tiles in the same order, whatever the other rows are).
"""

import torch

from ..triton.fused_moe.interface import ggml_moe_a8_triton
from ..triton.fused_moe.utils import get_triton_moe_block_m
from ..triton.gemm.interface import ggml_mul_mat_a8_triton
from .moe_expert_groups import moe_by_expert_group


def mul_mat(x: torch.Tensor, qweight: torch.Tensor, qweight_type: int) -> torch.Tensor:
    """x @ dequant(qweight).T with one kernel for every number of rows of x."""
    return ggml_mul_mat_a8_triton(qweight, x, qweight_type, qweight.shape[0])


def _experts(x, w, topk_ids, qweight_type, top_k, tokens) -> torch.Tensor:
    from vllm.model_executor.layers.fused_moe.fused_moe import moe_align_block_size

    sorted_ids, expert_ids, padded = moe_align_block_size(
        topk_ids, get_triton_moe_block_m(qweight_type), w.shape[0])
    return moe_by_expert_group(ggml_moe_a8_triton, x, w, sorted_ids, expert_ids, padded,
                               topk_ids, qweight_type, w.shape[1], top_k, tokens)


def fused_moe(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, qweight_type: int,
              qweight_type2: int, act) -> torch.Tensor:
    """The routed experts with one kernel for every number of tokens: gate_up, the
    activation `act`, down, weighted and summed over each token's experts."""
    from .. import ops

    num_tokens, top_k = topk_ids.shape
    out = _experts(x, w1, topk_ids, qweight_type, top_k, num_tokens)
    out = act(out)
    out = _experts(out, w2, topk_ids, qweight_type2, 1, num_tokens * top_k)
    out = out.reshape(num_tokens, top_k, w2.shape[1]).mul_(
        topk_weights.view(num_tokens, top_k, 1))
    hidden = torch.empty_like(x)
    ops.moe_sum(out, hidden)
    return hidden
