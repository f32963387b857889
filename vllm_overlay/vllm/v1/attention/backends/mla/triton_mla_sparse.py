# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Triton sparse MLA attention backend (DeepSeek-V3.2 / GLM-5 "DSA").

Portable counterpart of FLASHMLA_SPARSE / FLASHINFER_MLA_SPARSE for every CUDA GPU
that runs Triton (SM80, SM86, SM89, SM90, SM100, SM120, SM121).

As for the other sparse MLA backends, MLAAttention runs the query tokens it
routes to the MQA path (decodes, speculative decodes and, unless a batch's
prefills all fit within the top-k, prefills) through `forward_mqa`; short
prefills may take the shared dense-MHA path of `SparseMLACommonImpl`. In
`forward_mqa` every token attends to the indexer's top-k request-local
positions, converted to global KV-cache slots (the indexer pads each row with
-1 after its valid entries), by `ops/triton_sparse_mla.sparse_mla_attention`.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

import vllm.envs as envs
from vllm.config import VllmConfig
from vllm.config.cache import CacheDType
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import MLACommonPrefillMetadata
from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SparseMLACommonImpl,
    SparseMLACommonMetadataBuilder,
)
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionLayer,
    AttentionMetadata,
    AttentionType,
    MultipleOf,
)
from vllm.v1.attention.backends.mla.sparse_utils import (
    triton_convert_req_index_to_global_index,
)
from vllm.v1.attention.ops.triton_sparse_mla import sparse_mla_attention
from vllm.v1.kv_cache_interface import AttentionSpec

if TYPE_CHECKING:
    from vllm.model_executor.models.deepseek_v2 import Indexer

logger = init_logger(__name__)

# triton_convert_req_index_to_global_index works on 128-wide column tiles.
_TOPK_ALIGNMENT = 128


class TritonMLASparseBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = [
        "auto",
        "float16",
        "bfloat16",
        "fp8",
        "fp8_e4m3",
    ]

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        # The sparse indexer's K cache shares the block size and needs 64 on
        # CUDA (DeepseekV32IndexerBackend); the kernel itself addresses slots.
        return [64]

    @staticmethod
    def get_name() -> str:
        return "TRITON_MLA_SPARSE"

    @staticmethod
    def get_impl_cls() -> type["TritonMLASparseImpl"]:
        return TritonMLASparseImpl

    @staticmethod
    def get_builder_cls() -> type["TritonMLASparseMetadataBuilder"]:
        return TritonMLASparseMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        # kv_lora_rank 512 + qk_rope_head_dim 64 (DeepSeek-V3.2, GLM-5).
        return [576]

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return True

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        # Under VLLM_BATCH_INVARIANT the kernels run one KV split per token,
        # their tiles depend only on the head count, and the metadata builder
        # keeps every request on them (no dense-MHA prefill), so a token's
        # result does not depend on what it is batched with.
        return True

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: CacheDType | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability: DeviceCapability,
    ) -> str | None:
        if (
            kv_cache_dtype is not None
            and kv_cache_dtype.startswith("fp8")
            and not device_capability >= DeviceCapability(8, 9)
        ):
            return "fp8 KV cache needs compute capability 8.9 or newer"
        from vllm.config import get_current_vllm_config

        model_config = get_current_vllm_config().model_config
        if model_config is not None:
            topk = getattr(model_config.hf_text_config, "index_topk", None)
            if topk is not None and topk % _TOPK_ALIGNMENT != 0:
                return f"index_topk ({topk}) must be a multiple of {_TOPK_ALIGNMENT}"
        return None

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,  # assumed to be 1 for MLA
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        return (num_blocks, block_size, head_size)


@dataclass
class TritonMLASparseMetadata(AttentionMetadata):
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int

    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    # Request index of every query token, zero-filled past the real tokens.
    req_id_per_token: torch.Tensor

    block_size: int = 64
    topk_tokens: int = 2048

    # The split MLAAttention routes on: the first num_decode_tokens tokens take
    # forward_mqa, the rest the dense-MHA prefill (when `prefill` is built and
    # prefill_max_seq_len fits within topk_tokens).
    num_decodes: int = 0
    num_prefills: int = 0
    num_decode_tokens: int = 0
    seq_lens: torch.Tensor | None = None
    prefill_max_seq_len: int = 0
    prefill: MLACommonPrefillMetadata | None = None
    cp_kv_cache_interleave_size: int = 1


class TritonMLASparseMetadataBuilder(
    SparseMLACommonMetadataBuilder[TritonMLASparseMetadata]
):
    # Every step is a device-side kernel whose launch shape depends only on the
    # number of tokens, so batches of uniform query length can be captured.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    metadata_cls = TritonMLASparseMetadata

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if envs.VLLM_BATCH_INVARIANT:
            # MLAAttention sends a batch's prefills to dense MHA only when all
            # of them fit within the top-k, so a request's path would depend
            # on its batch: every request takes the MQA kernels instead.
            threshold = vllm_config.scheduler_config.max_num_batched_tokens
        else:
            # Longest query that takes the MQA path, as FLASH_ATTN_MLA_SPARSE
            # and FLASHMLA_SPARSE (outside SM100) choose it.
            num_q_heads = self.model_config.get_num_attention_heads(
                vllm_config.parallel_config
            )
            threshold = {16: 128, 32: 128, 64: 256, 128: 256}.get(num_q_heads, 256)
        self._init_reorder_batch_threshold(threshold, supports_spec_as_decode=True)


class TritonMLASparseImpl(SparseMLACommonImpl[TritonMLASparseMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        # MLA Specific Arguments
        topk_indices_buffer: torch.Tensor | None = None,
        indexer: "Indexer | None" = None,
        **mla_args,
    ) -> None:
        if any([alibi_slopes, sliding_window, logits_soft_cap]):
            raise NotImplementedError(
                "TritonMLASparseImpl does not support one of the following: "
                "alibi_slopes, sliding_window, logits_soft_cap"
            )
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                "Encoder self-attention and encoder/decoder cross-attention "
                "are not implemented for TritonMLASparseImpl"
            )
        if kv_cache_dtype == "fp8_ds_mla":
            raise NotImplementedError(
                "TritonMLASparseImpl reads the standard MLA cache layout; use "
                "kv_cache_dtype 'fp8' instead of 'fp8_ds_mla'"
            )
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            indexer=indexer,
            topk_indices_buffer=topk_indices_buffer,
            **mla_args,
        )
        # The indexer's buffer, or the shared one passed to the layers that
        # reuse another layer's top-k (IndexCache skip layers: indexer=None).
        if self.topk_indices_buffer is None:
            raise ValueError("TritonMLASparseImpl needs the indexer's top-k buffer")
        # Queries stay in the model dtype; an fp8 cache is dequantized on load.
        self.supports_quant_query_input = False

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: TritonMLASparseMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        # q may be only the leading MQA tokens of the batch (prefills routed
        # to dense MHA follow them), so slice the per-token inputs to match.
        num_tokens = q.shape[0]
        assert self.topk_indices_buffer is not None
        topk_indices = self.topk_indices_buffer[:num_tokens]
        slots, valid_counts = triton_convert_req_index_to_global_index(
            attn_metadata.req_id_per_token[:num_tokens],
            attn_metadata.block_table,
            topk_indices,
            BLOCK_SIZE=attn_metadata.block_size,
            NUM_TOPK_TOKENS=topk_indices.shape[1],
            return_valid_counts=True,
        )
        o = sparse_mla_attention(
            q,
            kv_c_and_k_pe_cache,
            slots,
            valid_counts,
            self.kv_lora_rank,
            self.scale,
            layer._k_scale,
        )
        return o, None
