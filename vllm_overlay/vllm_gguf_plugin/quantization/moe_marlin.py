# SPDX-License-Identifier: Apache-2.0
"""Q4_K routed experts on vLLM's Marlin MoE kernel, with the file's values.

A Q4_K weight is w = d * sc * q - dmin * m: a 4-bit code q, 6-bit sc and m per 32
values, d and dmin per 256. Marlin's uint4b8 with a scale per 32 values reads
s * (q - 8); with s = d * sc the rest is one value per 32 weights, b = 8 * s - dmin * m:

    x @ w.T = marlin(x; q, s) + G(x) @ b.T,  G(x): the sums of x over each group of 32.

The second product has 1/32 of the first's inputs (11% more bytes than Q4_K) and runs
on vLLM's Triton fused-MoE kernel with the same routing; it is added before the
activation (gate_up) and before the top-k sum (down), through fused_marlin_moe's
activation and sum hooks. s and b are rounded to the activations' dtype, as dequantized
weights are. Marlin reads an expert once for all of its tokens on tensor cores, and
keeps the activations in 16 bits where the GGUF kernels round them to int8: at GLM-5's
shapes it ran faster than every GGUF kernel at every token count measured, with a tenth
of their error (docs/results.md#gguf-moe-q4_k-experts-on-vllms-marlin-moe).

On by default; VLLM_GGUF_MOE_MARLIN=0 keeps every layer on the GGUF kernels. A layer
converts where gguf_kernels.moe_marlin says: its gate_up product Q4_K, on SM80 or later,
outside batch-invariant mode; its down product converts too where it is Q4_K, else it
stays on the GGUF kernels (Q4_K_M gives about half of a file's layers Q6_K down
projections) and runs after Marlin's gate_up. A converted product runs Marlin at every
token count and keeps no GGUF bytes (its experts take 5 bits a value where Q4_K takes
4.5: the b-part).
"""

import dataclasses

import torch
import triton.language as tl
import vllm.envs as envs
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from vllm.model_executor.layers.fused_moe.activation import (
    MoEActivation,
    apply_moe_activation,
)
from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
from vllm.model_executor.layers.fused_moe.fused_moe import (
    _prepare_expert_assignment,
    invoke_fused_moe_triton_kernel,
)
from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size
from vllm.model_executor.layers.quantization.utils.marlin_utils import (
    marlin_make_workspace_new,
)
from vllm.scalar_type import scalar_types

from . import gguf_kernels
from .utils import logger

GROUP = 32  # values a Marlin scale covers: Q4_K's sub-block
Q4_K = int(GGMLQuantizationType.Q4_K)
Q4_K_BLOCK, Q4_K_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_K]  # 256 values, 144 B
# vLLM's Triton fused-MoE kernel on the bias product: 16 token rows (tl.dot's least)
BIAS_CONFIG = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64,
               "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 2}


@dataclasses.dataclass(frozen=True)
class MarlinExperts:
    """One routed product's experts [E, n, k] in Marlin's layout."""

    qweight: torch.Tensor  # Marlin-packed uint4b8 codes
    scales: torch.Tensor  # s, a value per GROUP inputs, Marlin's permutation
    bias: torch.Tensor  # b [E, n, k / GROUP], the activations' dtype


def q4_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K blocks [..., nb * 144] uint8 as (q, d * sc, dmin * m): the codes [..., nb * 256]
    (uint8, 0..15) and two float32 values per group of 32 [..., nb * 8], so that each
    weight is (d * sc) * q - dmin * m (exactly, in float32)."""
    *lead, nbytes = blocks.shape
    b = blocks.reshape(-1, Q4_K_BYTES)
    d = b[:, 0:2].contiguous().view(torch.float16).float()
    dmin = b[:, 2:4].contiguous().view(torch.float16).float()
    packed = b[:, 4:16].to(torch.int32)
    low, mid, high = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    # ggml's get_scale_min_k4: groups 0-3 in the low 6 bits, 4-7 in a nibble + 2 bits
    sc = torch.cat([low & 63, (high & 15) | ((low >> 6) << 4)], dim=1)
    m = torch.cat([mid & 63, (high >> 4) | ((mid >> 6) << 4)], dim=1)
    # 32 bytes per 64 values: the low nibbles are group 2c, the high ones group 2c + 1
    qs = b[:, 16:].reshape(-1, 4, 1, 32)
    q = torch.cat([qs & 15, qs >> 4], dim=2).reshape(-1, Q4_K_BLOCK)
    groups = nbytes // Q4_K_BYTES * (Q4_K_BLOCK // GROUP)
    return (q.reshape(*lead, nbytes // Q4_K_BYTES * Q4_K_BLOCK), (d * sc).reshape(*lead, groups),
            (dmin * m).reshape(*lead, groups))


def marlin_parts(blocks: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K blocks as Marlin's uint4b8 codes (q, 0..15), s and b in `dtype`: each weight
    is s * (q - 8) + b; b is taken from the rounded s, so only b's own rounding remains."""
    q, d_sc, dmin_m = q4_k_parts(blocks)
    s = d_sc.to(dtype)
    return q, s, (8 * s.float() - dmin_m).to(dtype)


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """[experts, k, n] 4-bit codes packed 8 rows to an int32, row 8i + j in bits 4j to
    4j + 3: GPTQ's packing along k, as Marlin's repack reads it."""
    e, k, n = q.shape
    rows = q.view(e, k // 8, 8, n).long()
    packed = sum(rows[:, :, j] << (4 * j) for j in range(8))
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def marlin_layout(q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's 4-bit codes q [1, k, n] and scales s [1, k / GROUP, n] (on the GPU) as
    vLLM's Marlin MoE kernel reads them: (qweight, scales), by its CUDA repack."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        marlin_moe_permute_scales,
    )

    k, n = q.shape[1], q.shape[2]
    no_act_order = torch.empty(1, 0, dtype=torch.int32, device=q.device)
    return (ops.gptq_marlin_moe_repack(pack_int4_rows(q), no_act_order, k, n, 4),
            marlin_moe_permute_scales(s, k, n, GROUP))


def marlin_experts(w: torch.Tensor, dtype: torch.dtype) -> MarlinExperts:
    """A GGUF Q4_K stack [E, n, k / 256 * 144] (on the GPU) in Marlin's layout, an
    expert at a time (the packing goes through 64-bit integers) into tensors of all."""
    e, n, nbytes = w.shape
    bias = torch.empty(e, n, nbytes // Q4_K_BYTES * Q4_K_BLOCK // GROUP, dtype=dtype,
                       device=w.device)
    for j in range(e):
        q, s, bias[j] = marlin_parts(w[j], dtype)
        qw, sc = marlin_layout(q.T.contiguous()[None], s.T.contiguous()[None])
        if j == 0:
            qweight = qw.new_empty(e, *qw.shape[1:])
            scales = sc.new_empty(e, *sc.shape[1:])
        qweight[j], scales[j] = qw[0], sc[0]
    return MarlinExperts(qweight, scales, bias)


def group_sums(x: torch.Tensor) -> torch.Tensor:
    """[rows, k] -> [rows, k / GROUP]: the sums of each group's inputs, in float32 then
    rounded to x's dtype."""
    return x.view(x.shape[0], -1, GROUP).float().sum(-1).to(x.dtype)


def routed_product(a: torch.Tensor, w: torch.Tensor, assignment, top_k: int,
                   topk_weights: torch.Tensor | None = None,
                   config: dict = BIAS_CONFIG) -> torch.Tensor:
    """[pairs, n]: for each (row, expert) pair p, a[p // top_k] @ w[expert].T on vLLM's
    Triton fused-MoE kernel (16-bit w [E, n, k]), times the pair's top-k weight where
    given; pairs are token * top_k + k, and a pair of an expert the assignment marks -1
    gets zeros."""
    sorted_ids, expert_ids, padded = assignment
    pairs, n = a.shape[0] * top_k, w.shape[1]
    out = torch.empty(pairs, n, dtype=a.dtype, device=a.device)
    invoke_fused_moe_triton_kernel(  # C's row stride is its dim 1's: pair p at p * n
        a, w, out.view(pairs, 1, n), None, None, topk_weights, sorted_ids,
        expert_ids, padded, topk_weights is not None, top_k, config,
        tl.bfloat16 if a.dtype == torch.bfloat16 else tl.float16,
        use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False,
        use_int4_w4a16=False, per_channel_quant=False)
    return out


def gate_up_product(x: torch.Tensor, w13: MarlinExperts, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, assignment) -> torch.Tensor:
    """[tokens * top_k, n]: each (token, expert) pair's gate_up product on vLLM's Marlin
    MoE GEMM, its b-part added; for a layer whose down product is not Marlin's."""
    from vllm import _custom_ops as ops

    (m, k), (experts, n, _) = x.shape, w13.bias.shape
    top_k = topk_ids.shape[1]
    # fused_marlin_moe's tile of token rows: the smallest that most experts' pairs fill
    block = next((b for b in (8, 16, 32, 48) if m * top_k / experts / b < 0.9), 64)
    sorted_ids, expert_ids, padded = moe_align_block_size(
        topk_ids, block, experts, None, ignore_invalid_experts=True)
    out = torch.empty(m * top_k, n, dtype=x.dtype, device=x.device)
    ops.moe_wna16_marlin_gemm(
        x, out, w13.qweight, None, w13.scales, None, None, None, None, None,
        marlin_make_workspace_new(x.device, 4), sorted_ids, expert_ids, padded,
        topk_weights, moe_block_size=block, top_k=top_k, mul_topk_weights=False,
        b_q_type=scalar_types.uint4b8, size_m=m, size_n=n, size_k=k, is_k_full=True,
        use_atomic_add=False, use_fp32_reduce=True, is_zp_float=False)
    return out.add_(routed_product(group_sums(x), w13.bias, assignment, top_k))


def fused_moe(x: torch.Tensor, w13: MarlinExperts, w2: MarlinExperts | None,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: MoEActivation, gguf_down=None) -> torch.Tensor:
    """The routed experts: vLLM's fused_marlin_moe on (q, s), each product's b-part
    added in its hooks; where w2 is None, Marlin's gate_up, the activation and
    `gguf_down` (the GGUF kernels' down product: [pairs, n] -> [pairs, hidden])."""
    experts, top_k = w13.bias.shape[0], topk_ids.shape[1]
    topk_weights = topk_weights.float()  # fused_marlin_moe takes float32 weights only
    # the b-parts' routing, as upstream's fused MoE routes: one (token, expert) pair a
    # block where the tokens touch few experts, else the pairs sorted by expert
    assignment = _prepare_expert_assignment(topk_ids, BIAS_CONFIG, topk_ids.shape[0], top_k,
                                            experts, None)
    if w2 is None:
        h = gate_up_product(x, w13, topk_weights, topk_ids, assignment)
        a = h.new_empty(h.shape[0], h.shape[1] // 2 if activation.is_gated else h.shape[1])
        apply_moe_activation(activation, a, h)
        y = gguf_down(a).view(x.shape[0], top_k, -1)
        return y.mul_(topk_weights.unsqueeze(-1)).sum(dim=1)
    gs1 = group_sums(x)
    down = []

    def act(activation, output, input, **kwargs):
        input += routed_product(gs1, w13.bias, assignment, top_k)
        apply_moe_activation(activation, output, input, **kwargs)
        down.append(routed_product(group_sums(output), w2.bias, assignment, 1,
                                   topk_weights))

    def moe_sum(moe_output, output, topk_ids, expert_map):
        del topk_ids, expert_map
        moe_output += down.pop().view_as(moe_output)
        return torch.sum(moe_output, dim=1, out=output)

    return fused_marlin_moe(
        x, w13.qweight, w2.qweight, None, None, w13.scales, w2.scales, topk_weights,
        topk_ids, quant_type_id=scalar_types.uint4b8.id, global_num_experts=experts,
        activation=activation, activation_func=act, moe_sum=moe_sum)


def convert_layer(layer: torch.nn.Module, dtype: torch.dtype
                  ) -> tuple[MarlinExperts, MarlinExperts | None] | None:
    """A GGUF MoE layer's products that convert, in Marlin's layout for activations of
    `dtype`, their GGUF stacks then released (gate_up, and down or None where it stays
    GGUF); None leaves the layer on the GGUF kernels."""
    gate_up, down = gguf_kernels.moe_marlin(layer.w13_qweight_type.weight_type,
                                            layer.w2_qweight_type.weight_type,
                                            capability=gguf_kernels.device_capability(),
                                            batch_invariant=envs.VLLM_BATCH_INVARIANT)
    if not gate_up:
        return None
    logger.info_once("GGUF MoE layers with Q4_K experts run vLLM's Marlin MoE "
                     "(%s=0 keeps the GGUF kernels)", gguf_kernels.MOE_MARLIN_ENV)
    experts = []
    for w in (layer.w13_qweight, layer.w2_qweight)[:2 if down else 1]:
        experts.append(marlin_experts(w.data, dtype))
        w.data = torch.empty(0, dtype=w.dtype, device=w.device)  # not read again
    return experts[0], (experts[1] if down else None)
