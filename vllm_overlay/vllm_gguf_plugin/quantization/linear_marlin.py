# SPDX-License-Identifier: Apache-2.0
"""Q4_K linear layers on vLLM's Marlin GEMM, with the file's values.

moe_marlin's split for one weight: x @ w.T = marlin(x; q, s) + G(x) @ b.T, Marlin's
uint4b8 codes q with s = d * sc per 32 inputs, b = 8 * s - dmin * m, and G(x) the sums
of x over each group of 32 (moe_marlin.py). The b-part is a 16-bit GEMM on 1/32 of the
inputs. At GLM-5's dense shapes Marlin ran 1.5-16x the GGUF kernels from 8 tokens, at a
tenth of their error, and 0.5-1.2x at one token, where the two small attention
projections lose (H200, 2026-12-04, in the history of docs/results.md).

Off unless VLLM_GGUF_DENSE_MARLIN=1: its effect on a whole decode step is not measured
yet. Then a linear layer converts where gguf_kernels.dense_marlin says (every shard of
its weight Q4_K, on SM80 or later, its output rows a multiple of Marlin's 64, outside
batch-invariant mode); it runs Marlin at every token count and keeps no GGUF bytes. The
output head converts as a linear layer; an input embedding (GGUFEmbeddingMethod's lookup)
never does.
"""

import torch
import vllm.envs as envs
from vllm.model_executor.layers.quantization.utils.marlin_utils import (
    apply_gptq_marlin_linear,
    marlin_make_empty_g_idx,
    marlin_make_workspace_new,
    marlin_permute_scales,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.scalar_type import scalar_types

from . import gguf_kernels
from .moe_marlin import (
    GROUP,
    Q4_K_BLOCK,
    Q4_K_BYTES,
    group_sums,
    marlin_parts,
    pack_int4_rows,
)
from .utils import logger

PACK_VALUES = 1 << 24  # weights unpacked at a time: the packing goes through int64


def weight_types(layer: torch.nn.Module) -> set[int]:
    """The GGUF types of a linear layer's weight: each shard's, or the weight's."""
    qweight_type = layer.qweight_type
    return set(qweight_type.shard_weight_type.values()) or {qweight_type.weight_type}


def marlin_weight(blocks: torch.Tensor, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K blocks [n, k / 256 * 144] (on the GPU) as vLLM's Marlin GEMM reads them:
    (qweight, scales, b), s and b in `dtype`, b [n, k / GROUP]; unpacked a slice of
    rows at a time."""
    from vllm import _custom_ops as ops

    n, nbytes = blocks.shape
    k = nbytes // Q4_K_BYTES * Q4_K_BLOCK
    packed = torch.empty(k // 8, n, dtype=torch.int32, device=blocks.device)
    scales = torch.empty(k // GROUP, n, dtype=dtype, device=blocks.device)
    b = torch.empty(n, k // GROUP, dtype=dtype, device=blocks.device)
    step = max(1, PACK_VALUES // k)
    for start in range(0, n, step):
        rows = slice(start, start + step)
        q, s, b[rows] = marlin_parts(blocks[rows], dtype)
        packed[:, rows] = pack_int4_rows(q.T.contiguous()[None])[0]
        scales[:, rows] = s.T
    no_perm = torch.empty(0, dtype=torch.int32, device=blocks.device)
    return (ops.gptq_marlin_repack(packed, no_perm, k, n, 4),
            marlin_permute_scales(scales, k, n, GROUP), b)


def convert_layer(layer: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Convert a GGUF linear layer for Marlin where it takes it, for activations of
    `dtype`: its parameters marlin_qweight, marlin_scales and marlin_b; its GGUF bytes
    released. False leaves the layer on the GGUF kernels."""
    if isinstance(layer, VocabParallelEmbedding) and not isinstance(layer, ParallelLMHead):
        return False  # an input embedding's lookup reads its GGUF rows
    if not gguf_kernels.dense_marlin(weight_types(layer), layer.qweight.shape[0],
                                     capability=gguf_kernels.device_capability(),
                                     batch_invariant=envs.VLLM_BATCH_INVARIANT):
        return False
    logger.info_once("GGUF linear layers with Q4_K weights run vLLM's Marlin GEMM (%s=1)",
                     gguf_kernels.DENSE_MARLIN_ENV)
    attach(layer, layer.qweight.data, dtype)
    layer.qweight.data = torch.empty(0, dtype=layer.qweight.dtype, device=layer.qweight.device)
    return True


def attach(layer: torch.nn.Module, blocks: torch.Tensor, dtype: torch.dtype) -> None:
    """Q4_K blocks [n, k / 256 * 144] (on the GPU) in Marlin's form as `layer`'s
    parameters marlin_qweight, marlin_scales and marlin_b, which apply() reads."""
    qweight, scales, b = marlin_weight(blocks, dtype)
    for name, value in (("marlin_qweight", qweight), ("marlin_scales", scales),
                        ("marlin_b", b)):
        layer.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))
    layer.marlin_workspace = marlin_make_workspace_new(qweight.device)
    layer.marlin_no_index = marlin_make_empty_g_idx(qweight.device)


def apply(layer: torch.nn.Module, x: torch.Tensor,
          bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) for a layer convert_layer converted; inputs of another dtype (the
    float32 identity that dequantizes a layer at load) run in the layer's and come back
    in theirs."""
    b = layer.marlin_b
    n, k = b.shape[0], b.shape[1] * GROUP
    a = x.reshape(-1, k).to(b.dtype).contiguous()
    no_index = layer.marlin_no_index
    y = apply_gptq_marlin_linear(a, layer.marlin_qweight, layer.marlin_scales, no_index,
                                 no_index, no_index, layer.marlin_workspace,
                                 scalar_types.uint4b8, n, k, is_k_full=True)
    y = torch.addmm(y, group_sums(a), b.T)
    if bias is not None:
        y += bias
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
