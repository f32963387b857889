# SPDX-License-Identifier: Apache-2.0
"""Which of the plugin's GGUF MoE kernels a routed product runs, where GLM-5's expert
shapes measured another faster than the plugin's choice (docs/results.md, "GGUF MoE at
GLM-5's shapes").

The plugin runs its one-pair kernel (CUDA, a token-expert pair at a time) up to 64 tokens
and from 65 its MMQ MoE kernel (CUDA, int8 activations) for K-quants and legacy quants.
MMQ reads an expert once for all of its tokens: MMQ_MIN_TOKENS starts it at fewer tokens
for the types where that measured faster. The plugin's Triton MoE kernel (16-bit
activations), which it runs only for types without MMQ, and with tiles of 4 token rows,
is faster than MMQ for some types and token counts when its tiles hold more rows:
TRITON_MOE_TILES says where; each product (gate_up, down) of such a type takes the Triton
kernel with that tile, the other products stay on MMQ.
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


# quant type -> the fewest tokens whose routed products run MMQ, not the one-pair kernel;
# the other types keep the plugin's PLUGIN_MMQ_MIN_TOKENS
PLUGIN_MMQ_MIN_TOKENS = 65
MMQ_MIN_TOKENS: dict[int, int] = {
    GGMLQuantizationType.Q4_K: 32,
    GGMLQuantizationType.Q6_K: 16,
    GGMLQuantizationType.Q8_0: 32,
}


def mmq_min_tokens(qweight_type: int, qweight_type2: int) -> int:
    """The fewest tokens from which a layer's products of these types run MMQ."""
    types = (qweight_type, qweight_type2)
    return max(MMQ_MIN_TOKENS.get(t, PLUGIN_MMQ_MIN_TOKENS) for t in types)


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
