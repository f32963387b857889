# SPDX-License-Identifier: Apache-2.0
"""GPU time per call from CUDA-graph replays (shared by the kernel benchmarks)."""

import torch
from triton.testing import do_bench


def graph_us(calls) -> float:
    """Median GPU time of one call: all calls (e.g. one per input set) captured in a
    CUDA graph, as the engine runs decode, so that Python launch overhead is out."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls[0]()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    ms = do_bench(graph.replay, warmup=10, rep=100, return_mode="median")
    del graph
    return ms * 1e3 / len(calls)
