# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project

import gguf
import torch
import vllm.envs as envs  # overlay: batch-invariant products
from gguf import GGMLQuantizationType as WeightType
from vllm.model_executor.layers.linear import (
    LinearMethodBase,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.utils import set_weight_attrs
from vllm.utils.torch_utils import direct_register_custom_op

from .. import ops
from . import batch_invariant  # overlay: batch-invariant products
from . import dequant_triton  # overlay: Q4_K and Q6_K dequantized on Triton
from . import gguf_kernels  # overlay: the kernel of each product
from .gguf_kernels import GGUFKernel  # overlay: as above
from .params import (
    GGUFUninitializedWeightParameter,
    GGUFUninitializedWeightTypeParameter,
    GGUFWeightParameter,
    _gguf_ordered_shard_ids,
    _materialize_gguf_weight_parameter,
    _materialize_gguf_weight_type_parameter,
    _resolve_gguf_weight_loader,
    _resolve_gguf_weight_type_loader,
)
from .utils import (  # overlay: the other type lists are gguf_kernels'
    DEQUANT_TYPES,
    UNQUANTIZED_TYPES,
)


# overlay: the dense and the routed products' dequantization: Q4_K and Q6_K on Triton (the
# plugin's kernel moved a quarter of the H200's bandwidth, docs/results.md), the rest the plugin's
def dequantize(qweight: torch.Tensor, qweight_type: int, rows: int, cols: int,
               dtype: torch.dtype) -> torch.Tensor:
    if qweight_type in dequant_triton.TYPES:
        return dequant_triton.dequantize(qweight, qweight_type, rows, cols, dtype)
    return ops.ggml_dequantize(qweight, qweight_type, rows, cols, dtype)


def _fused_mul_mat_gguf(
    x: torch.Tensor, qweight: torch.Tensor, qweight_type: int
) -> torch.Tensor:
    # overlay: the MMVQ bounds moved to gguf_kernels (mmvq_max_tokens)
    if x.shape[0] == 0:
        return torch.empty(x.shape[0], qweight.shape[0], dtype=x.dtype, device=x.device)
    # overlay: gguf_kernels decides the kernel (batch invariance: one for every count)
    kernel = gguf_kernels.dense_launch(qweight_type, x.shape[0], qweight.shape[0],
                                       batch_invariant=envs.VLLM_BATCH_INVARIANT).kernel
    if kernel is GGUFKernel.PLAIN:  # overlay: as above
        return x @ qweight.T
    if kernel is GGUFKernel.BATCH_INVARIANT:  # overlay: as above
        return batch_invariant.mul_mat(x, qweight, qweight_type)
    if kernel is GGUFKernel.MMVQ:  # overlay: as above
        y = ops.ggml_mul_mat_vec_a8(qweight, x, qweight_type, qweight.shape[0])
    elif kernel is GGUFKernel.MMQ:  # overlay: as above
        y = ops.ggml_mul_mat_a8(qweight, x, qweight_type, qweight.shape[0])
    elif kernel is GGUFKernel.DEQUANT:  # overlay: as above
        block_size, type_size = gguf.GGML_QUANT_SIZES[qweight_type]
        shape = (qweight.shape[0], qweight.shape[1] // type_size * block_size)
        weight = dequantize(qweight, qweight_type, *shape, x.dtype)  # overlay: see above
        y = x @ weight.T
    else:
        qweight_type = WeightType(qweight_type)
        raise NotImplementedError(f"Unsupported GGUF quantization type: {qweight_type}")
    return y


def _fused_mul_mat_gguf_fake(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qweight_type: int,
) -> torch.Tensor:
    return torch.empty(x.shape[0], qweight.shape[0], dtype=x.dtype, device=x.device)


try:
    direct_register_custom_op(
        op_name="_fused_mul_mat_gguf",
        op_func=_fused_mul_mat_gguf,
        fake_impl=_fused_mul_mat_gguf_fake,
    )
    fused_mul_mat_gguf = torch.ops.vllm._fused_mul_mat_gguf
except AttributeError as error:
    raise error


@register_weight_loader_v2_supported_method
class GGUFLinearMethod(LinearMethodBase):
    """Linear method for GGUF."""

    def __init__(self, quant_config):
        self.quant_config = quant_config

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        del input_size, output_size
        self.params_dtype = params_dtype
        output_size_per_partition = sum(output_partition_sizes)
        fallback_weight_loader = extra_weight_attrs.pop("weight_loader", None)
        weight_loader = _resolve_gguf_weight_loader(layer, fallback_weight_loader)
        assert weight_loader is not None

        tensor_shape = (output_size_per_partition, input_size_per_partition)
        qweight = GGUFUninitializedWeightParameter(requires_grad=False)
        set_weight_attrs(
            qweight,
            {
                "weight_loader": weight_loader,
                "input_dim": 1,
                "output_dim": 0,
                "tensor_shape": tensor_shape,
                "data_container": [],
                "shard_id": [],
                "shard_id_map": {},
            },
        )
        set_weight_attrs(qweight, extra_weight_attrs)
        layer.register_parameter("qweight", qweight)

        weight_loader_type = _resolve_gguf_weight_type_loader(
            layer, fallback_weight_loader
        )
        assert weight_loader_type is not None
        qweight_type = GGUFUninitializedWeightTypeParameter(requires_grad=False)
        set_weight_attrs(
            qweight_type,
            {
                "weight_loader": weight_loader_type,
                "weight_type": 0,
                "shard_weight_type": {},
                "num_elements": len(output_partition_sizes),
                "ignore_warning": True,
            },
        )
        set_weight_attrs(qweight_type, extra_weight_attrs)
        layer.register_parameter("qweight_type", qweight_type)

    def process_weights_after_loading(self, layer: torch.nn.Module):
        self._materialize_gguf_parameters(layer)
        qweight_type = layer.qweight_type.weight_type
        if not (qweight_type in UNQUANTIZED_TYPES or qweight_type in DEQUANT_TYPES):
            qweight_type = WeightType(qweight_type)
            raise ValueError(
                f"Unsupported GGUF quantization type {qweight_type} in layer {layer}."
            )
        self._create_padded_weight_param(layer)

    def _materialize_gguf_parameters(self, layer: torch.nn.Module) -> None:
        self._materialize_qweight(layer)
        self._materialize_qweight_type(layer)

    def _materialize_qweight(self, layer: torch.nn.Module) -> None:
        _materialize_gguf_weight_parameter(layer, "qweight")

    def _materialize_qweight_type(self, layer: torch.nn.Module) -> None:
        _materialize_gguf_weight_type_parameter(layer, "qweight_type")

    def _create_padded_weight_param(self, layer: torch.nn.Module):
        """Create padded weight parameter for GGUF MergedLinear layer."""
        qweight = layer.qweight
        shard_id_map = qweight.shard_id_map
        shard_id = qweight.shard_id
        if len(data_container := qweight.data_container) > 1:
            dtype = {data.dtype for data in data_container}
            assert len(dtype) == 1, ValueError(
                f"Data container has mixed dtypes: {dtype}"
            )
            dtype = next(iter(dtype))
            padded_side = max(x.size(1) for x in data_container)
            concat_side = sum(x.size(0) for x in data_container)
            padded_data = torch.zeros(
                (concat_side, padded_side), dtype=dtype, device=qweight.device
            )
            shard_offset_map = dict[str, tuple[int, int, int]]()
            ordered_shard_ids = _gguf_ordered_shard_ids(shard_id)
            current_offset = 0
            for idx in ordered_shard_ids:
                id_in_container = shard_id_map[idx]
                start = current_offset
                end = start + data_container[id_in_container].size(0)
                size = data_container[id_in_container].size(1)
                padded_data[start:end, :size] = data_container[id_in_container]
                shard_offset_map[idx] = (start, end, size)
                current_offset = end
            padded_param = GGUFWeightParameter(
                data=padded_data,
                weight_loader=qweight.weight_loader,
                input_dim=qweight.input_dim,
                output_dim=qweight.output_dim,
                tensor_shape=qweight.tensor_shape,
            )
            padded_param.data_container = []
            padded_param.shard_id = ordered_shard_ids
            padded_param.shard_id_map = dict(qweight.shard_id_map)
            if hasattr(qweight, "ignore_warning"):
                padded_param.ignore_warning = qweight.ignore_warning
            set_weight_attrs(padded_param, {"shard_offset_map": shard_offset_map})
            qweight.data_container.clear()
            qweight.shard_id.clear()
            qweight.shard_id_map.clear()
            if qweight.data.numel() > 0:
                qweight.data = torch.empty(
                    0, dtype=qweight.dtype, device=qweight.device
                )
            layer.register_parameter("qweight", padded_param)

    # overlay: the products `apply` runs, for it and the warm-up: each as (the weight's
    # type, the shard's (start, end, offset) in the padded weight, or None: the whole)
    def _products(self, layer: torch.nn.Module) -> list[tuple[int, tuple | None]]:
        qweight, fallback_wtype = layer.qweight, layer.qweight_type.weight_type
        shard_id = qweight.shard_id
        if not shard_id:
            return [(fallback_wtype, None)]
        shard_id = ["q", "k", "v"] if "q" in shard_id else shard_id
        shard_weight_types = [
            layer.qweight_type.shard_weight_type.get(idx, fallback_wtype)
            for idx in shard_id
        ]
        if len(set(shard_weight_types)) == 1:
            return [(shard_weight_types[0], None)]
        return [(qweight_type, qweight.shard_offset_map[idx])
                for idx, qweight_type in zip(shard_id, shard_weight_types)]

    # overlay: the token counts that compile every variant of the layer's kernels, for
    # vLLM's warm-up (token_count_warmup.py)
    def warmup_token_counts(self, layer: torch.nn.Module, first: int,
                            last: int) -> tuple[int, ...]:
        counts = set()
        for qweight_type, shard in self._products(layer):
            rows = layer.qweight.shape[0] if shard is None else shard[1] - shard[0]
            counts.update(gguf_kernels.dense_warmup_counts(
                qweight_type, rows, first, last, batch_invariant=envs.VLLM_BATCH_INVARIANT))
        return tuple(sorted(counts))

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        from . import fused_mul_mat_gguf as fused_mul_mat_gguf_op

        qweight = layer.qweight
        # overlay: the products from _products (one statement of them, with the warm-up)
        result = [
            fused_mul_mat_gguf_op(
                x,
                qweight if shard is None
                else qweight[shard[0]:shard[1], :shard[2]].contiguous(),
                qweight_type,
            )
            for qweight_type, shard in self._products(layer)
        ]
        out = result[0] if len(result) == 1 else torch.cat(result, axis=1)
        if bias is not None:
            out.add_(bias)
        return out
