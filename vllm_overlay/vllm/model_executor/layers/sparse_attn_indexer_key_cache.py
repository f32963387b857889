# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The key cache of the sparse attention indexer (DeepSeek-V3.2 / GLM-5): what
`sparse_attn_indexer` and its layer do with the cache, by the cache's dtype.

- `Fp8KeyCache` (bytes: fp8 keys with an fp32 scale each, or MXFP4 keys with ue8m0
  scales): upstream's kernels, `indexer_k_quant_and_cache` and
  `cp_gather_indexer_k_quant_cache`, and fp8 (or MXFP4) queries.
- `Keys16KeyCache` (`VLLM_SPARSE_INDEXER_CACHE=16bit`): the keys in the model's
  16-bit dtype, unquantized and without scales, and queries in that dtype, on the
  Triton kernels of `triton_indexer_logits`.

Each one writes a step's keys into the cache, sizes the prefill workspace its keys are
gathered into, gathers a chunk's keys (and scales), gives the logits kernels the keys'
scales and pads the queries of a decode batch of unequal lengths. `indexer_key_cache`
chooses one by dtype, the one place that does: the layer asks with its cache's dtype,
the op with its queries' (the 16-bit cache's are of its dtype, the byte cache's fp8 or
MXFP4 bytes), which the profiling run has too, before the cache is allocated.
"""

import torch

from vllm import _custom_ops as ops
from vllm.platforms import current_platform
from vllm.utils.deep_gemm import has_deep_gemm
from vllm.v1.attention.ops import triton_indexer_logits as indexer_logits
from vllm.v1.attention.ops.common import pack_seq_triton

Shapes = tuple[tuple[tuple[int, int], torch.dtype], tuple[tuple[int, int], torch.dtype]]


class Fp8KeyCache:
    """Upstream's key cache: fp8 keys and their scales (or MXFP4), as bytes."""

    @staticmethod
    def check_supported(use_fp4_cache: bool) -> None:
        """DeepGEMM is needed only where it computes the logits (the Triton kernels
        compute them elsewhere: `triton_indexer_logits`)."""
        if not current_platform.is_cuda():
            return
        backend = indexer_logits.indexer_logits_backend()
        if backend == "deepgemm" and not has_deep_gemm():
            raise RuntimeError(
                "Sparse Attention Indexer CUDA op requires DeepGEMM support in "
                "the current vLLM environment."
            )
        if backend == "triton":
            indexer_logits.check_triton_indexer_supported()
            if use_fp4_cache:
                raise NotImplementedError(
                    "The MXFP4 indexer cache needs DeepGEMM's logits kernels"
                )

    @staticmethod
    def write_keys(
        k: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        quant_block_size: int,
        scale_fmt: str,
    ) -> None:
        ops.indexer_k_quant_and_cache(
            k, kv_cache, slot_mapping, quant_block_size, scale_fmt
        )

    @staticmethod
    def workspace_shapes(
        total_seq_lens: int,
        head_dim: int,
        fp8_dtype: torch.dtype,
        use_fp4_cache: bool,
    ) -> Shapes:
        # (imported here: that module imports this one)
        from vllm.model_executor.layers.sparse_attn_indexer import (
            _gather_workspace_shapes,
        )

        return _gather_workspace_shapes(
            total_seq_lens, head_dim, fp8_dtype, use_fp4_cache
        )

    @staticmethod
    def gather_keys(
        kv_cache: torch.Tensor,
        k_values: torch.Tensor,
        k_scales: torch.Tensor,
        block_table: torch.Tensor,
        cu_seq_lens: torch.Tensor,
    ) -> None:
        ops.cp_gather_indexer_k_quant_cache(
            kv_cache, k_values, k_scales, block_table, cu_seq_lens
        )

    @staticmethod
    def logits_key_scales(k_scales: torch.Tensor) -> torch.Tensor:
        """The gathered scales (4 bytes a key) as the logits kernels take them."""
        return k_scales.view(torch.float32).squeeze(-1)

    @staticmethod
    def pad_decode_q(q: torch.Tensor, decode_lens: torch.Tensor) -> torch.Tensor:
        """fp8 queries [T, H, D] as [B, max(decode_lens), H, D]: padded with -inf
        (pack_seq_triton's default; the context lengths mask those rows), or with 0
        bytes where the Triton kernels take e4m3 as bytes (SM80/86)."""
        if indexer_logits.e4m3_as_bytes():
            return pack_seq_triton(
                q.view(torch.uint8), decode_lens, pad_value=0
            ).view(q.dtype)
        return pack_seq_triton(q, decode_lens)


class Keys16KeyCache:
    """The 16-bit key cache: the keys in the model's dtype (float16 or bfloat16), no
    scales; the queries unquantized in that dtype."""

    def __init__(self, dtype: torch.dtype):
        assert dtype in indexer_logits.KEYS16_DTYPES, dtype
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"Keys16KeyCache({self.dtype})"

    @staticmethod
    def check_supported(use_fp4_cache: bool) -> None:
        """The Triton kernels of the CUDA path read it (ROCm's and XPU's read fp8
        keys), whatever computes the logits over fp8 keys."""
        if current_platform.is_rocm() or current_platform.is_xpu():
            raise NotImplementedError(
                f"{indexer_logits.CACHE_ENV}=16bit needs a CUDA GPU (the Triton "
                "indexer kernels)"
            )
        if current_platform.is_cuda():
            indexer_logits.check_triton_indexer_supported(keys16=True)

    @staticmethod
    def write_keys(
        k: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        quant_block_size: int,
        scale_fmt: str,
    ) -> None:
        """The keys as they are (no quantization: block size and scale format unused)."""
        indexer_logits.write_k_cache_16bit(k, kv_cache, slot_mapping)

    def workspace_shapes(
        self,
        total_seq_lens: int,
        head_dim: int,
        fp8_dtype: torch.dtype,
        use_fp4_cache: bool,
    ) -> Shapes:
        """(T, head_dim) keys of the cache's dtype and no scales (T, 0)."""
        return (
            ((total_seq_lens, head_dim), self.dtype),
            ((total_seq_lens, 0), torch.uint8),
        )

    @staticmethod
    def gather_keys(
        kv_cache: torch.Tensor,
        k_values: torch.Tensor,
        k_scales: torch.Tensor,
        block_table: torch.Tensor,
        cu_seq_lens: torch.Tensor,
    ) -> None:
        """The keys only (k_scales: the empty (T, 0) workspace)."""
        indexer_logits.gather_k_cache_16bit(kv_cache, k_values, block_table, cu_seq_lens)

    @staticmethod
    def logits_key_scales(k_scales: torch.Tensor) -> None:
        """No scales: the logits kernels take the 16-bit keys as they are."""
        return None

    @staticmethod
    def pad_decode_q(q: torch.Tensor, decode_lens: torch.Tensor) -> torch.Tensor:
        """16-bit queries padded with 0: -inf would give NaN dots (0 * inf) in the
        padded rows the logits kernels compute."""
        return pack_seq_triton(q, decode_lens, pad_value=0)


IndexerKeyCache = Fp8KeyCache | Keys16KeyCache

FP8_KEY_CACHE = Fp8KeyCache()
KEYS16_KEY_CACHES = {
    dtype: Keys16KeyCache(dtype) for dtype in indexer_logits.KEYS16_DTYPES
}


def indexer_key_cache(dtype: torch.dtype) -> IndexerKeyCache:
    """The key cache whose keys (and queries) are of this dtype: the 16-bit cache for
    the model's float16 or bfloat16, upstream's fp8 (or MXFP4) cache for bytes (the
    cache's uint8, fp8 queries, MXFP4's uint8 queries)."""
    if dtype in KEYS16_KEY_CACHES:
        return KEYS16_KEY_CACHES[dtype]
    if dtype.itemsize == 1:
        return FP8_KEY_CACHE
    raise ValueError(
        f"{indexer_logits.CACHE_ENV}=16bit needs a float16 or bfloat16 model; "
        f"this one is {dtype}"
    )
