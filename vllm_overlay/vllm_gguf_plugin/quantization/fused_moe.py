# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project

from functools import partial

import torch
import vllm.envs as envs  # overlay: batch-invariant products
from vllm.model_executor.layers.fused_moe import (
    RoutedExperts,
)
from vllm.model_executor.layers.fused_moe.activation import (
    MoEActivation,
    apply_moe_activation,
)
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import (
    FusedMoEMethodBase,
)
from vllm.model_executor.utils import set_weight_attrs
from vllm.utils.torch_utils import direct_register_custom_op

from .. import ops
from . import batch_invariant  # overlay: batch-invariant products
from . import gguf_kernels  # overlay: the kernel of each product
from .gguf_kernels import GGUFKernel  # overlay: as above
from .moe_expert_groups import moe_by_expert_group  # overlay: experts past 2 GiB
from . import moe_prefill  # overlay: long prefills dequantize the experts
from . import moe_triton_tiles  # overlay: Triton MoE tiles where measured faster
from . import moe_marlin  # overlay: Q4_K experts on vLLM's Marlin MoE
from .params import (
    GGUFUninitializedWeightParameter,
    GGUFUninitializedWeightTypeParameter,
    _gguf_moe_weight_loader,
    _gguf_moe_weight_type_loader,
)
from .utils import logger  # overlay: gguf_kernels reads the type lists


def _fused_moe_gguf(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    qweight_type: int,
    qweight_type2: int,
    activation: str,
) -> torch.Tensor:
    activation_enum = MoEActivation.from_str(activation)

    def act(inp: torch.Tensor):
        d = inp.shape[-1] // 2
        output_shape = inp.shape[:-1] + (d,)
        out = torch.empty(output_shape, dtype=inp.dtype, device=inp.device)
        apply_moe_activation(activation_enum, out, inp)
        return out

    from vllm.model_executor.layers.fused_moe.fused_moe import moe_align_block_size

    # overlay: gguf_kernels decides the kernel of each product (batch invariance: one
    # for every token count; a long prefill: the experts dequantized, vLLM's fused MoE)
    launch = gguf_kernels.moe_launch(qweight_type, qweight_type2, x.shape[0],
                                     batch_invariant=envs.VLLM_BATCH_INVARIANT)
    gate_up, down = launch.gate_up, launch.down
    if gate_up.kernel is GGUFKernel.BATCH_INVARIANT:
        return batch_invariant.fused_moe(
            x, w1, w2, topk_weights, topk_ids, qweight_type, qweight_type2, act
        )
    if gate_up.kernel is GGUFKernel.DEQUANT:
        return moe_prefill.dequant_fused_moe(
            x, w1, w2, topk_weights, topk_ids, qweight_type, qweight_type2,
            activation_enum,
        )
    out_hidden_states = torch.empty_like(x)
    # overlay: MMQ or the Triton tiles, as the launch says
    if gate_up.kernel in (GGUFKernel.MMQ, GGUFKernel.TRITON_MOE):
        num_tokens, _ = x.shape
        E, N, _ = w1.shape
        top_k = topk_ids.shape[1]
        if GGUFKernel.MMQ in (gate_up.kernel, down.kernel):  # overlay: a product runs MMQ
            block_size = ops.ggml_moe_get_block_size(qweight_type)
            sorted_token_ids, expert_ids, num_tokens_post_padded = moe_align_block_size(
                topk_ids, block_size, E
            )
        # overlay: in expert groups whose offsets fit the kernel's 32 bits
        if gate_up.kernel is GGUFKernel.TRITON_MOE:  # overlay: or the Triton kernel
            out = moe_triton_tiles.triton_moe_product(
                x, w1, qweight_type, gate_up.block_m, topk_ids, N, top_k, num_tokens
            )
        else:
            out = moe_by_expert_group(
                ops.ggml_moe_a8,
                x,
                w1,
                sorted_token_ids,
                expert_ids,
                num_tokens_post_padded,
                topk_ids,  # overlay: the expert of each output row
                qweight_type,
                N,
                top_k,
                num_tokens,
            )
        out = act(out)
        if down.kernel is GGUFKernel.TRITON_MOE:  # overlay: as above
            out = moe_triton_tiles.triton_moe_product(
                out, w2, qweight_type2, down.block_m, topk_ids, w2.shape[1], 1,
                num_tokens * top_k,
            )
        else:
            out = moe_by_expert_group(  # overlay: as above
                ops.ggml_moe_a8,
                out,
                w2,
                sorted_token_ids,
                expert_ids,
                num_tokens_post_padded,
                topk_ids,  # overlay: the expert of each output row
                qweight_type2,
                w2.shape[1],
                1,
                num_tokens * top_k,
            )
        out = out.reshape(num_tokens, top_k, w2.shape[1]).mul_(
            topk_weights.view(num_tokens, top_k, 1)
        )
        ops.moe_sum(out, out_hidden_states)
    elif gate_up.kernel is GGUFKernel.MMVQ:  # overlay: as above
        num_tokens, _ = x.shape
        E, N, _ = w1.shape
        top_k = topk_ids.shape[1]

        out = ops.ggml_moe_a8_vec(x, w1, topk_ids, top_k, qweight_type, N, num_tokens)
        out = act(out)

        out = ops.ggml_moe_a8_vec(
            out, w2, topk_ids, 1, qweight_type2, w2.shape[1], num_tokens * top_k
        )
        out = out.reshape(num_tokens, top_k, w2.shape[1]).mul_(
            topk_weights.view(num_tokens, top_k, 1)
        )
        ops.moe_sum(out, out_hidden_states)
    else:
        from . import fused_mul_mat_gguf as fused_mul_mat_gguf_op

        logger.warning_once(
            "There is no support for fast MoE kernel "
            "for current quantization method. "
            "Falling back to slow implementation. "
        )
        for tok, (w, idx) in enumerate(zip(topk_weights, topk_ids)):
            inp = x[tok].reshape((1,) + x.shape[1:])
            current_hidden_state = None
            for ww, ii in zip(w, idx):
                out = fused_mul_mat_gguf_op(inp, w1[ii], qweight_type)
                out = act(out)
                current_state = fused_mul_mat_gguf_op(out, w2[ii], qweight_type2).mul_(
                    ww
                )
                if current_hidden_state is None:
                    current_hidden_state = current_state
                else:
                    current_hidden_state.add_(current_state)
            out_hidden_states[tok] = current_hidden_state
    return out_hidden_states


# overlay: the down product of a layer whose gate_up runs on Marlin (moe_marlin.py), a
# row per (token, expert) pair, on the GGUF kernel _fused_moe_gguf picks for its type
def _gguf_moe_down(
    x: torch.Tensor, w: torch.Tensor, qweight_type: int, topk_ids: torch.Tensor
) -> torch.Tensor:
    from vllm.model_executor.layers.fused_moe.fused_moe import moe_align_block_size

    tokens, rows, n = topk_ids.shape[0], x.shape[0], w.shape[1]
    launch = gguf_kernels.marlin_gguf_down(qweight_type, tokens)
    if launch.kernel is GGUFKernel.TRITON_MOE:
        return moe_triton_tiles.triton_moe_product(
            x, w, qweight_type, launch.block_m, topk_ids, n, 1, rows
        )
    if launch.kernel is GGUFKernel.DEQUANT:
        return moe_prefill.dequant_moe_product(x, w, qweight_type, topk_ids)
    if launch.kernel is GGUFKernel.MMQ:
        sorted_token_ids, expert_ids, num_tokens_post_padded = moe_align_block_size(
            topk_ids, ops.ggml_moe_get_block_size(qweight_type), w.shape[0]
        )
        return moe_by_expert_group(
            ops.ggml_moe_a8, x, w, sorted_token_ids, expert_ids,
            num_tokens_post_padded, topk_ids, qweight_type, n, 1, rows,
        )
    return ops.ggml_moe_a8_vec(x, w, topk_ids, 1, qweight_type, n, rows)


# overlay: a converted layer's MoE (moe_marlin.convert_layer's experts), its down
# product on _gguf_moe_down where that stayed GGUF
def marlin_fused_moe(
    x: torch.Tensor,
    marlin: tuple,
    w2: torch.Tensor,
    qweight_type2: int,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: MoEActivation,
) -> torch.Tensor:
    w13_marlin, w2_marlin = marlin
    down = None
    if w2_marlin is None:
        down = partial(_gguf_moe_down, w=w2, qweight_type=qweight_type2, topk_ids=topk_ids)
    return moe_marlin.fused_moe(
        x, w13_marlin, w2_marlin, topk_weights, topk_ids, activation, down
    )


def _fused_moe_gguf_fake(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    qweight_type: int,
    qweight_type2: int,
    activation: str,
) -> torch.Tensor:
    del w1, w2, topk_weights, topk_ids, qweight_type, qweight_type2, activation
    return torch.empty_like(x)


try:
    direct_register_custom_op(
        op_name="_fused_moe_gguf",
        op_func=_fused_moe_gguf,
        fake_impl=_fused_moe_gguf_fake,
    )
    fused_moe_gguf = torch.ops.vllm._fused_moe_gguf
except AttributeError as error:
    raise error


class GGUFMoEMethod(FusedMoEMethodBase):
    """MoE method for GGUF."""

    def __init__(
        self,
        quant_config,
        moe: FusedMoEConfig,
    ):
        super().__init__(moe)
        self.quant_config = quant_config

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        del params_dtype
        base_weight_loader = extra_weight_attrs.pop("weight_loader")
        tensor_shape = (num_experts, 2 * intermediate_size_per_partition, hidden_size)
        w13_qweight = GGUFUninitializedWeightParameter(requires_grad=False)
        set_weight_attrs(
            w13_qweight,
            {
                "weight_loader": partial(
                    _gguf_moe_weight_loader, layer, base_weight_loader
                ),
                "input_dim": 1,
                "output_dim": 0,
                "tensor_shape": tensor_shape,
                "data_container": [],
            },
        )
        set_weight_attrs(w13_qweight, extra_weight_attrs)
        layer.register_parameter("w13_qweight", w13_qweight)

        w13_qweight_type = GGUFUninitializedWeightTypeParameter(requires_grad=False)
        set_weight_attrs(
            w13_qweight_type,
            {
                "weight_loader": _gguf_moe_weight_type_loader,
                "weight_type": 0,
                "shard_weight_type": {},
                "num_elements": 1,
                "ignore_warning": True,
            },
        )
        set_weight_attrs(w13_qweight_type, extra_weight_attrs)
        layer.register_parameter("w13_qweight_type", w13_qweight_type)

        tensor_shape = (num_experts, intermediate_size_per_partition, hidden_size)
        w2_qweight = GGUFUninitializedWeightParameter(requires_grad=False)
        set_weight_attrs(
            w2_qweight,
            {
                "weight_loader": partial(
                    _gguf_moe_weight_loader, layer, base_weight_loader
                ),
                "input_dim": 1,
                "output_dim": 0,
                "tensor_shape": tensor_shape,
                "data_container": [],
            },
        )
        set_weight_attrs(w2_qweight, extra_weight_attrs)
        layer.register_parameter("w2_qweight", w2_qweight)

        w2_qweight_type = GGUFUninitializedWeightTypeParameter(requires_grad=False)
        set_weight_attrs(
            w2_qweight_type,
            {
                "weight_loader": _gguf_moe_weight_type_loader,
                "weight_type": 0,
                "shard_weight_type": {},
                "num_elements": 1,
                "ignore_warning": True,
            },
        )
        set_weight_attrs(w2_qweight_type, extra_weight_attrs)
        layer.register_parameter("w2_qweight_type", w2_qweight_type)

    # overlay: Q4_K experts converted for vLLM's Marlin MoE (moe_marlin.py)
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer.gguf_marlin_experts = moe_marlin.convert_layer(layer, self.moe.in_dtype)

    # overlay: the token counts that compile every variant of the layer's kernels, for
    # vLLM's warm-up (token_count_warmup.py): the kernels follow the count past the graphs
    def warmup_token_counts(self, layer: torch.nn.Module, first: int,
                            last: int) -> tuple[int, ...]:
        marlin = getattr(layer, "gguf_marlin_experts", None)
        return gguf_kernels.moe_warmup_counts(
            layer.w13_qweight_type.weight_type, layer.w2_qweight_type.weight_type,
            first, last, batch_invariant=envs.VLLM_BATCH_INVARIANT,
            marlin=(marlin is not None, marlin is not None and marlin[1] is not None),
            w1_shape=tuple(layer.w13_qweight.shape), w2_shape=tuple(layer.w2_qweight.shape),
            top_k=self.moe.experts_per_token, dtype=self.moe.in_dtype)

    def get_fused_moe_quant_config(
        self, layer: torch.nn.Module
    ) -> FusedMoEQuantConfig | None:
        del layer
        return None

    def apply(
        self,
        layer: RoutedExperts,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts,
        shared_experts_input: torch.Tensor | None,
    ) -> torch.Tensor:
        del shared_experts, shared_experts_input
        if layer.apply_router_weight_on_input:
            raise NotImplementedError(
                "Apply router weight on input is not supported for"
                "fused GGUF MoE method."
            )

        from . import fused_moe_gguf as fused_moe_gguf_op

        marlin = getattr(layer, "gguf_marlin_experts", None)  # overlay: as above
        if marlin is not None:  # overlay: as above
            return marlin_fused_moe(
                x,
                marlin,
                layer.w2_qweight,
                layer.w2_qweight_type.weight_type,
                topk_weights,
                topk_ids,
                layer.activation,
            )
        return fused_moe_gguf_op(
            x,
            layer.w13_qweight,
            layer.w2_qweight,
            topk_weights,
            topk_ids,
            layer.w13_qweight_type.weight_type,
            layer.w2_qweight_type.weight_type,
            layer.activation.value,
        )
