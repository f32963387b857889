# SPDX-License-Identifier: Apache-2.0
"""RMSNorm eps for DeepSeek-style decoder stacks that run in float16.

In float16, vLLM's DeepseekV2DecoderLayer divides the attention output (and, in layer
0, the residual) by `routed_scaling_factor`, and its MLP and MoE outputs come out divided
the same way, so that the residual stream cannot overflow float16. From layer 0's
attention on, every RMSNorm of that stream then sees its input divided by the factor s:

    (x / s) / sqrt(mean((x / s)^2) + eps) = x / sqrt(mean(x^2) + s^2 * eps)

which is the norm of the unscaled stream with eps times s^2 (6.25 for GLM-5's 2.5): a
different function wherever mean(x^2) is not far above eps. Dividing those norms' eps by
s^2 makes the scaled stream's norms exactly the model's. The models apply this after
loading their weights, whatever the loader (safetensors, GGUF, ...):
DeepseekV2Model.load_weights to its stack, DeepSeekMTP.load_weights to an MTP draft,
whose block (deepseek_v2.py) divides its residual, the eh_proj output, as layer 0 does:
there the block's post-attention norm and the shared head's norm see the scaled stream.
"""

import torch
import torch.nn as nn


def match_fp16_residual_scale(model: nn.Module, dtype: torch.dtype) -> None:
    """Divide the eps of the RMSNorms that see the scaled residual stream by
    routed_scaling_factor^2 in every DeepseekV2Model and MTP layer of `model` run in
    float16; nothing changes for other dtypes. Each norm is divided once, however often
    load_weights runs (a weight reload, an update in parts)."""
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.models.deepseek_mtp import DeepSeekMultiTokenPredictorLayer
    from vllm.model_executor.models.deepseek_v2 import (
        DeepseekAttention,
        DeepseekV2DecoderLayer,
        DeepseekV2Model,
    )

    if dtype != torch.float16:
        return
    for stack in model.modules():
        if not isinstance(stack, DeepseekV2Model):
            continue
        scale = None
        for layer in stack.layers:
            # layers of other pipeline ranks are placeholders
            if not isinstance(layer, DeepseekV2DecoderLayer):
                continue
            if isinstance(layer.self_attn, DeepseekAttention):
                continue  # vLLM does not scale these layers
            scale = layer.routed_scaling_factor
            if scale == 1.0:
                continue
            norms = [layer.post_attention_layernorm]
            if layer.layer_idx != 0:  # layer 0's input norm sees the embeddings as they are
                norms.append(layer.input_layernorm)
            for norm in norms:
                _divide_eps(norm, scale**2)
        if scale not in (None, 1.0) and isinstance(stack.norm, RMSNorm):
            _divide_eps(stack.norm, scale**2)
    for mtp in model.modules():
        if not isinstance(mtp, DeepSeekMultiTokenPredictorLayer):
            continue
        block = mtp.mtp_block
        if isinstance(block.self_attn, DeepseekAttention) or block.routed_scaling_factor == 1.0:
            continue
        # its input norm sees eh_proj's output as it is
        for norm in (block.post_attention_layernorm, mtp.shared_head.norm):
            _divide_eps(norm, block.routed_scaling_factor**2)


def _divide_eps(norm: nn.Module, divisor: float) -> None:
    if getattr(norm, "eps_of_scaled_stream", False):
        return
    norm.variance_epsilon /= divisor
    norm.eps_of_scaled_stream = True
