# SPDX-License-Identifier: Apache-2.0
"""The plugin's Triton MoE kernel (16-bit activations) with tiles of more token rows,
for the routed products where GLM-5's expert shapes measured it faster than MMQ.

The plugin runs its one-pair kernel (CUDA, a token-expert pair at a time) up to 64 tokens
and from 65 its MMQ MoE kernel (CUDA, int8 activations) for K-quants and legacy quants;
its Triton MoE kernel only for types without MMQ, and with tiles of 4 token rows. With
tiles of 32 or 64 rows it is faster than MMQ for some types and token counts: where, and
where MMQ starts at fewer tokens, is gguf_kernels' table (TABLE.triton_moe_tiles,
TABLE.mmq_min_tokens_by_type); each product (gate_up, down) whose launch names
TRITON_MOE runs here with the launch's block_m.
"""

import torch
from gguf import GGMLQuantizationType
from vllm.model_executor.layers.fused_moe.fused_moe import moe_align_block_size

from ..triton.fused_moe.k_quant.q4_k import q4_k_moe_kernel
from ..triton.fused_moe.k_quant.q6_k import q6_k_moe_kernel
from ..triton.fused_moe.utils import run_triton_fused_moe_kernel
from .moe_expert_groups import moe_by_expert_group

# quant type -> the plugin's Triton MoE kernel of that type (gguf_kernels' tiles name the
# types and counts that run it)
TRITON_MOE_KERNELS = {
    int(GGMLQuantizationType.Q4_K): q4_k_moe_kernel,
    int(GGMLQuantizationType.Q6_K): q6_k_moe_kernel,
}


def triton_moe_product(x: torch.Tensor, w: torch.Tensor, qweight_type: int,
                       block_m: int, topk_ids: torch.Tensor, rows: int, top_k: int,
                       tokens: int) -> torch.Tensor:
    """One routed product (`top_k` experts a row of `x`, `tokens` rows; down: top_k 1
    and a row per token and expert) on the Triton kernel with tiles of `block_m` token
    rows, in expert groups whose bytes fit its 32-bit offsets. Output row r belongs to
    topk_ids.flatten()[r]."""
    kernel = TRITON_MOE_KERNELS[qweight_type]
    sorted_ids, expert_ids, padded = moe_align_block_size(topk_ids, block_m, w.shape[0])

    def run(x, w, sorted_ids, expert_ids, padded):
        return run_triton_fused_moe_kernel(kernel, w, x, sorted_ids, expert_ids, padded, rows,
                                           top_k, tokens, qweight_type, block_m=block_m)

    return moe_by_expert_group(run, x, w, sorted_ids, expert_ids, padded, topk_ids)
