# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Warm up the kernels that a quantization method compiles per token count.

CUDA graph capture runs the model at every captured size, and a batch of fewer
tokens is padded to one of them. A step of more tokens (a prefill chunk) runs at
its exact count, and a quantization method whose Triton kernels change with the
count (a tile chosen by thresholds, an integer argument that Triton specializes
on) compiles the new variant in the middle of serving: every request in flight
waits for the compilation, seconds per kernel.

A quantization method that knows its counts lists them:

    def warmup_token_counts(self, layer, first: int, last: int) -> Iterable[int]

the fewest counts in [first, last] at which a model run compiles every variant
that its products take at any count there. The model then runs once at each
count that any layer lists, before CUDA graph capture.
"""

import time
from typing import TYPE_CHECKING

import torch

from vllm.config import CUDAGraphMode
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.v1.worker.gpu_worker import Worker

logger = init_logger(__name__)


def first_uncaptured_count(worker: "Worker") -> int:
    """The fewest tokens of a step that runs at its exact count: past the largest
    captured size where mixed batches replay CUDA graphs, else one."""
    config = worker.vllm_config.compilation_config
    sizes = config.cudagraph_capture_sizes or []
    if (
        worker.vllm_config.model_config.enforce_eager
        or not sizes
        or config.cudagraph_mode.mixed_mode() == CUDAGraphMode.NONE
    ):
        return 1
    return max(sizes) + 1


def quantized_warmup_token_counts(
    model: torch.nn.Module, first: int, last: int
) -> list[int]:
    """Every count in [first, last] that a layer's quantization method lists."""
    counts: set[int] = set()
    if first > last:
        return []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        listed = getattr(method, "warmup_token_counts", None)
        if listed is not None:
            counts.update(n for n in listed(module, first, last) if first <= n <= last)
    return sorted(counts)


@torch.inference_mode()
def token_count_warmup(worker: "Worker") -> None:
    runner = worker.model_runner
    if runner.is_pooling_model:
        return
    first = first_uncaptured_count(worker)
    last = worker.scheduler_config.max_num_batched_tokens
    counts = quantized_warmup_token_counts(worker.get_model(), first, last)
    if not counts:
        return
    start = time.perf_counter()
    for num_tokens in counts:
        runner._dummy_run(
            num_tokens,
            cudagraph_runtime_mode=CUDAGraphMode.NONE,
            skip_eplb=True,
            remove_lora=False,
        )
    logger.info(
        "Warmed up the quantized kernels at %d token counts in [%d, %d] in %.1f s",
        len(counts),
        first,
        last,
        time.perf_counter() - start,
    )
