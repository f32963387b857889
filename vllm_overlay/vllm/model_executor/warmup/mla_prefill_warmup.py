# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Warm up the attention kernels of the MLA prefill backends.

Dummy and profile runs carry no attention metadata, so an MLA model's prefill
attention (new tokens, causal; a chunk of cached context, not masked) first runs
at the first real prefill. Where a kernel's binary holds no machine code for the
GPU, its first launch waits for the driver to compile its PTX: vLLM's
FlashAttention 2, the prefill kernel on SM120, ships sm_80 code and compute_80
PTX only, so there every prefill kernel file compiles in the driver, 10-30 s
each, while every request in flight waits. Running each MLA prefill backend once
on a small batch moves that compilation before serving; the driver caches the
result for the next start.
"""

import copy
import time
from typing import TYPE_CHECKING

import torch

from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend
    from vllm.v1.worker.gpu_worker import Worker

logger = init_logger(__name__)

# One prefill of this many new tokens over this much cached context: enough for a
# causal block and an unmasked one; the kernels do not change with the lengths.
_WARMUP_QUERY_TOKENS = 16
_WARMUP_CONTEXT_TOKENS = 64


def distinct_prefill_backends(vllm_config: "VllmConfig") -> list["MLAPrefillBackend"]:
    """One MLA prefill backend per distinct kind and shape among the model's
    attention layers (every layer of a model usually shares one)."""
    from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend

    layers = vllm_config.compilation_config.static_forward_context.values()
    found: dict[tuple, MLAPrefillBackend] = {}
    for layer in layers:
        backend = getattr(layer, "prefill_backend", None)
        if not isinstance(backend, MLAPrefillBackend):
            continue
        key = (
            type(backend),
            backend.num_heads,
            backend.kv_lora_rank,
            backend.qk_nope_head_dim,
            backend.qk_rope_head_dim,
            backend.v_head_dim,
        )
        found.setdefault(key, backend)
    return list(found.values())


def warm_up_prefill_backend(
    backend: "MLAPrefillBackend",
    q_dtype: torch.dtype,
    output_dtype: torch.dtype,
    device: torch.device,
    query_tokens: int = _WARMUP_QUERY_TOKENS,
    context_tokens: int = _WARMUP_CONTEXT_TOKENS,
) -> None:
    """Run a copy of `backend` on one prefill of `query_tokens` new tokens after
    `context_tokens` of cached context, as MLA's prefill calls it: the new tokens
    with and without their log-sum-exp, then the context as one chunk."""
    from vllm.model_executor.layers.attention.mla_attention import (
        MLACommonPrefillMetadata,
    )

    # a shallow copy keeps the layer's settings (FlashAttention version, functions)
    # and takes the warm-up's metadata in its own attribute; clone() would construct
    # anew, outside the engine's config context
    backend = copy.copy(backend)
    n, m = query_tokens, context_tokens
    heads = backend.num_heads
    qk_dim = backend.qk_nope_head_dim + backend.qk_rope_head_dim
    v_dim = backend.v_head_dim
    i32 = {"dtype": torch.int32, "device": device}

    chunked_context = MLACommonPrefillMetadata.ChunkedContextMetadata(
        cu_seq_lens=torch.tensor([[0, m]], **i32),
        starts=torch.zeros((1, 1), **i32),
        seq_tot=[m],
        max_seq_lens=[m],
        seq_lens=torch.tensor([[m]], **i32),
        workspace=torch.empty(
            (m, backend.kv_lora_rank + backend.qk_rope_head_dim),
            dtype=output_dtype,
            device=device,
        ),
        token_to_seq=torch.zeros((1, m), **i32),
        chunk_total_token=[m],
        has_empty_context=[False],
        prefill_tokens_with_context=n,
    )
    backend.prepare_metadata(
        MLACommonPrefillMetadata(
            block_table=torch.zeros((1, 1), **i32),
            query_start_loc=torch.tensor([0, n], **i32),
            max_query_len=n,
            chunked_context=chunked_context,
            q_data_type=q_dtype,
            output_dtype=output_dtype,
            prefill_backend=backend,
        )
    )

    def heads_of(tokens: int, dim: int) -> torch.Tensor:
        return torch.randn(tokens, heads, dim, device=device).to(q_dtype)

    q = heads_of(n, qk_dim)
    k, v = heads_of(n, qk_dim), heads_of(n, v_dim)
    for return_softmax_lse in (False, True):
        backend.run_prefill_new_tokens(
            q=q, k=k, v=v, return_softmax_lse=return_softmax_lse
        )
    backend.run_prefill_context_chunk(
        chunk_idx=0, q=q, k=heads_of(m, qk_dim), v=heads_of(m, v_dim)
    )


def mla_prefill_warmup(worker: "Worker") -> None:
    runner = worker.model_runner
    if runner.is_pooling_model:
        return
    vllm_config = worker.vllm_config
    backends = distinct_prefill_backends(vllm_config)
    if not backends:
        return

    from vllm.model_executor.layers.attention.mla_attention import (
        MLACommonMetadataBuilder,
    )

    model_dtype = vllm_config.model_config.dtype
    q_dtype = MLACommonMetadataBuilder.determine_prefill_query_data_type(
        vllm_config, model_dtype
    )
    device = getattr(runner, "device", torch.device("cuda"))
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            for backend in backends:
                warm_up_prefill_backend(backend, q_dtype, model_dtype, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception:
        logger.warning("Skipping the MLA prefill warmup.", exc_info=True)
        return
    logger.info(
        "Warmed up the MLA prefill kernels (%s) in %.2f s.",
        ", ".join(sorted({backend.get_name() for backend in backends})),
        time.perf_counter() - start,
    )
