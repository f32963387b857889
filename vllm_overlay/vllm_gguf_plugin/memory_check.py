# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Whether a GGUF model fits the GPU memory vLLM is given, checked before its
weights load.

vLLM finds out that the KV cache cannot hold one sequence of `max_model_len`
tokens only after loading the weights, compiling and profiling: for a 400 GB
GGUF that is minutes of reading before the error. The loader knows earlier what
the check needs: the bytes of the file this rank copies (a lower bound of its
weights' GPU memory: every tensor is kept in at least its file's bytes) and,
once the model is built, the KV cache each layer declares. This module compares
the two with the memory vLLM requests (`gpu_memory_utilization` of the GPU, or
`kv_cache_memory_bytes` for the cache), using vLLM's own sizing of one
sequence's KV cache, and names the setting to change when they cannot fit.
Activations, CUDA graphs and workspaces come on top: passing the check does not
promise that vLLM's own check after profiling passes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.utils.mem_utils import format_gib

logger = init_logger(__name__)


@dataclass(frozen=True)
class MemoryNeed:
    """One rank's memory before it loads: what vLLM may use of the GPU, and what
    the model needs of it at the least."""

    gpu_bytes: int  # the GPU's total memory
    utilization: float  # --gpu-memory-utilization
    kv_cache_memory_bytes: int | None  # --kv-cache-memory-bytes, if set
    weight_bytes: int  # this rank's weights (the file's bytes it copies)
    max_model_len: int | None  # None: --max-model-len -1, vLLM fits it
    kv_bytes: int  # the KV cache of one sequence of max_model_len tokens
    fitting_len: int  # the longest sequence whose KV cache fits beside the weights

    @property
    def requested_bytes(self) -> int:
        return int(self.gpu_bytes * self.utilization)

    def problem(self) -> str | None:
        """What cannot fit, and the settings to change; None if nothing."""
        gpu = (f"--gpu-memory-utilization {self.utilization} gives "
               f"{format_gib(self.requested_bytes)} GiB of the GPU's "
               f"{format_gib(self.gpu_bytes)} GiB")
        weights = f"this rank's share of the GGUF's weights is {format_gib(self.weight_bytes)} GiB"
        if self.kv_cache_memory_bytes is None and self.weight_bytes >= self.requested_bytes:
            return (f"{weights}, but {gpu}: raise --gpu-memory-utilization, or split the "
                    "weights over more GPUs with --tensor-parallel-size")
        if self.kv_cache_memory_bytes is not None and (
                self.weight_bytes + self.kv_cache_memory_bytes > self.gpu_bytes):
            return (f"{weights} and --kv-cache-memory-bytes asks "
                    f"{format_gib(self.kv_cache_memory_bytes)} GiB, more than the GPU's "
                    f"{format_gib(self.gpu_bytes)} GiB: lower --kv-cache-memory-bytes, or "
                    "split the weights over more GPUs with --tensor-parallel-size")
        if self.max_model_len is None:
            return None
        cache = (f"a sequence of max_model_len {self.max_model_len} tokens needs "
                 f"{format_gib(self.kv_bytes)} GiB of KV cache")
        fits = (f"at most {self.fitting_len} tokens fit; --max-model-len -1 lets vLLM pick "
                "the largest" if self.fitting_len > 0 else "no token's cache fits")
        if self.kv_cache_memory_bytes is not None:
            if self.kv_bytes <= self.kv_cache_memory_bytes:
                return None
            return (f"{cache}, but --kv-cache-memory-bytes gives "
                    f"{format_gib(self.kv_cache_memory_bytes)} GiB: raise it, or lower "
                    f"--max-model-len ({fits})")
        if self.weight_bytes + self.kv_bytes <= self.requested_bytes:
            return None
        return (f"{weights} and {cache}, but {gpu}: lower --max-model-len ({fits}), raise "
                "--gpu-memory-utilization, or split the weights over more GPUs with "
                "--tensor-parallel-size")


def device_memory_bytes(device: torch.device) -> int | None:
    """The total memory of `device`; None for a device vLLM sizes otherwise."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[1]


def kv_cache_need(vllm_config: VllmConfig) -> tuple[int, Callable[[int], int]]:
    """(bytes of one sequence of max_model_len tokens, the longest sequence that fits
    in a given number of bytes) for the attention layers the model registered, as
    vLLM's check after profiling sizes them (`check_enough_kv_cache_memory`)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.core.kv_cache_utils import estimate_max_model_len, max_memory_usage_bytes

    specs = {}
    for name, layer in get_layers_from_vllm_config(vllm_config, AttentionLayerBase).items():
        if (spec := layer.get_kv_cache_spec(vllm_config)) is not None:
            specs[name] = spec
    if not specs:
        return 0, lambda available: vllm_config.model_config.max_model_len
    return (max_memory_usage_bytes(vllm_config, specs.values()),
            lambda available: estimate_max_model_len(vllm_config, specs, available))


def check_memory_before_loading(vllm_config: VllmConfig, weight_bytes: int,
                                device: torch.device) -> MemoryNeed | None:
    """Raise a ValueError naming the setting to change when this rank's weights
    (`weight_bytes`, at the least) and one sequence of max_model_len tokens cannot
    fit the memory vLLM requests on `device`; call it once the model is built (its
    attention layers registered) and before its weights load."""
    gpu_bytes = device_memory_bytes(device)
    if gpu_bytes is None:
        return None
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    kv_bytes, fitting = kv_cache_need(vllm_config)
    auto_fit = getattr(model, "original_max_model_len", None) == -1
    need = MemoryNeed(
        gpu_bytes=gpu_bytes, utilization=cache.gpu_memory_utilization,
        kv_cache_memory_bytes=cache.kv_cache_memory_bytes, weight_bytes=weight_bytes,
        max_model_len=None if auto_fit else model.max_model_len, kv_bytes=kv_bytes,
        fitting_len=0)
    available = (cache.kv_cache_memory_bytes if cache.kv_cache_memory_bytes is not None
                 else need.requested_bytes - weight_bytes)
    need = replace(need, fitting_len=fitting(available) if available > 0 else 0)
    if (problem := need.problem()) is not None:
        # the file the user named (vLLM's `model` is its folder for a GGUF file)
        raise ValueError(f"{model.model_weights or model.model}: the model cannot fit this "
                         f"GPU's memory, checked before loading its weights: {problem}.")
    logger.info("Before loading: this rank's GGUF weights take %s GiB at the least; a "
                "%s-token sequence's KV cache %s GiB; vLLM may use %s GiB of this GPU.",
                format_gib(weight_bytes), model.max_model_len, format_gib(kv_bytes),
                format_gib(need.requested_bytes))
    return need
