# SPDX-License-Identifier: Apache-2.0
"""Routed experts whose weights pass 2 GiB, in the plugin's tiled MoE kernels.

The CUDA `ggml_moe_a8` kernel and the Triton `ggml_moe_*_triton` kernels find an
expert's weights at expert index x expert stride (bytes), computed in 32-bit integers.
GLM-5's fused gate_up experts (256 x 4096 x 6144) hold more than 2^31 bytes from Q3_K up
(Q4_K: 3.6 GB), so from expert 152 on (Q4_K) the offset wraps and the kernel reads
another address: those tokens' outputs are wrong. Here such a weight runs in groups of
experts whose bytes fit in 31 bits: each call gets a view starting at its group's first
expert, and the other groups' blocks marked -1, which both kernels skip. The
one-token-at-a-time kernel (`ggml_moe_a8_vec`) indexes whole blocks and is not affected.
"""

import torch

from . import gguf_kernels


def expert_groups(w: torch.Tensor) -> list[tuple[int, int]]:
    """[first, end) expert ranges of `w` ([experts, rows, bytes]) whose bytes each fit
    a 32-bit offset; one range when the whole tensor does."""
    experts = w.shape[0]
    per_expert = w.stride(0) * w.element_size()
    if per_expert * experts <= gguf_kernels.TABLE.moe_offset_max:
        return [(0, experts)]
    size = gguf_kernels.TABLE.moe_offset_max // per_expert
    if size == 0:
        raise ValueError(f"one expert's GGUF weights take {per_expert} bytes, more than "
                         "the MoE kernels' 32-bit offsets reach")
    return [(first, min(first + size, experts)) for first in range(0, experts, size)]


def moe_by_expert_group(kernel, x: torch.Tensor, w: torch.Tensor,
                        sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
                        num_tokens_post_padded: torch.Tensor, topk_ids: torch.Tensor,
                        *args) -> torch.Tensor:
    """`kernel(x, w, sorted_token_ids, expert_ids, num_tokens_post_padded, *args)` (the
    plugin's ggml_moe_a8 or ggml_moe_a8_triton), one call per expert group of `w`.
    Output row r belongs to the expert topk_ids.flatten()[r], in both products."""
    groups = expert_groups(w)
    if len(groups) == 1:
        return kernel(x, w, sorted_token_ids, expert_ids, num_tokens_post_padded, *args)
    slot_expert = topk_ids.flatten().unsqueeze(1)
    out = None
    for first, end in groups:
        in_group = (expert_ids >= first) & (expert_ids < end)
        ids = torch.where(in_group, expert_ids - first, torch.full_like(expert_ids, -1))
        part = kernel(x, w[first:end], sorted_token_ids, ids, num_tokens_post_padded, *args)
        # rows of the other groups are left unwritten by this call (or zero)
        out = part if out is None else torch.where(
            (slot_expert >= first) & (slot_expert < end), part, out)
    return out
