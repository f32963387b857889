# SPDX-License-Identifier: Apache-2.0
"""Routed GGUF expert products of more than 64 tokens on the plugin's Triton MoE kernel.

From 65 tokens the plugin runs its MMQ MoE kernel (CUDA, int8 activations) for K-quants
and legacy quants; its Triton MoE kernel (16-bit activations), which it runs only for
types without MMQ, and with tiles of 4 token rows, is faster than MMQ at GLM-5's expert
shapes for some types and token counts when its tiles hold more rows (docs/results.md,
"GGUF MoE at GLM-5's shapes"). TRITON_MOE_TILES says where: each product (gate_up, down)
of such a type takes the Triton kernel with that tile, the other products stay on MMQ.
"""

import dataclasses

import torch
from gguf import GGMLQuantizationType
from vllm.model_executor.layers.fused_moe.fused_moe import moe_align_block_size

from ..triton.fused_moe.k_quant.q4_k import q4_k_moe_kernel
from ..triton.fused_moe.k_quant.q6_k import q6_k_moe_kernel
from ..triton.fused_moe.utils import run_triton_fused_moe_kernel
from .moe_expert_groups import moe_by_expert_group


@dataclasses.dataclass(frozen=True)
class TritonMoETile:
    """The Triton tile of a product of `first` to `last` tokens."""

    first: int
    last: int
    block_m: int  # token rows a tile


# quant type -> (the plugin's Triton MoE kernel, its tiles by rising counts); other
# counts take MMQ or the dequantized experts (moe_prefill)
TRITON_MOE_TILES: dict[int, tuple[object, tuple[TritonMoETile, ...]]] = {
    GGMLQuantizationType.Q4_K: (q4_k_moe_kernel, (TritonMoETile(384, 767, 32),
                                                  TritonMoETile(768, 6143, 64))),
    GGMLQuantizationType.Q6_K: (q6_k_moe_kernel, (TritonMoETile(768, 3071, 64),)),
}


def triton_tile(qweight_type: int, num_tokens: int) -> TritonMoETile | None:
    """The Triton tile of a product of this type over `num_tokens` tokens, if any."""
    _, tiles = TRITON_MOE_TILES.get(qweight_type, (None, ()))
    return next((t for t in tiles if t.first <= num_tokens <= t.last), None)


def triton_moe_product(x: torch.Tensor, w: torch.Tensor, qweight_type: int,
                       tile: TritonMoETile, topk_ids: torch.Tensor, rows: int, top_k: int,
                       tokens: int) -> torch.Tensor:
    """One routed product (`top_k` experts a row of `x`, `tokens` rows; down: top_k 1
    and a row per token and expert) on the Triton kernel with `tile`, in expert groups
    whose bytes fit its 32-bit offsets. Output row r belongs to topk_ids.flatten()[r]."""
    kernel, _ = TRITON_MOE_TILES[qweight_type]
    sorted_ids, expert_ids, padded = moe_align_block_size(topk_ids, tile.block_m, w.shape[0])

    def run(x, w, sorted_ids, expert_ids, padded):
        return run_triton_fused_moe_kernel(kernel, w, x, sorted_ids, expert_ids, padded, rows,
                                           top_k, tokens, qweight_type, block_m=tile.block_m)

    return moe_by_expert_group(run, x, w, sorted_ids, expert_ids, padded, topk_ids)
