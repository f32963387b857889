# SPDX-License-Identifier: Apache-2.0
"""The indexer's prefill chunk metadata kernel is one binary for every prefill slice.

Triton specializes a kernel on each pointer's 16-byte alignment and on each integer
equal to 1 or divisible by 16, and compiles a binary per combination at its first
launch. `build_prefill_chunk_metadata` passes a slice of the sequence lengths (its
alignment follows the first request's index) and the bounds of a query slice, which
take every class while serving: four variants compiled under a soak's load on an
H100, each holding every request in flight. Triton's own binder, run without a GPU in
a plain process, gives one specialization for all of them, where the same function
without the overlay's `do_not_specialize` gives one per class.
"""

import json

import pytest


def specializations() -> dict:
    """Distinct specializations over the argument classes of the kernel's call, for the
    kernel as vLLM has it and for its function plainly jitted (run in a plain process)."""
    from tests.v1.attention.test_triton_mla_sparse_targets import (
        real_triton,
        specialization_counts,
    )

    real_triton()
    import torch

    from vllm.v1.attention.backends.mla import indexer

    buf = torch.zeros(64, dtype=torch.int32)  # 64-byte aligned storage
    aligned, offset = buf[:16], buf[1:17]
    assert aligned.data_ptr() % 16 == 0 and offset.data_ptr() % 16 != 0
    calls = [
        # the slice of uncompressed_seq_lens, query_slice_start, query_slice_stop:
        # integers of each class (16 divides, equal to 1, neither)
        ((aligned, seq_lens, aligned, aligned, aligned, aligned, aligned, start, stop, 0, 1, 1),
         {"BLOCK_SIZE": 1024, "COMPRESS_RATIO": 1})
        for seq_lens in (aligned, offset)
        for start in (0, 1, 5)
        for stop in (1, 16, 21)
        if stop >= start
    ]
    return specialization_counts(indexer._build_prefill_chunk_metadata_kernel, calls)


@pytest.fixture(scope="module")
def found(run_without_gpu):
    return run_without_gpu(__name__)


def test_one_binary_for_every_prefill_slice(found):
    assert found["vllm"] == 1, found


def test_the_calls_span_the_classes_triton_specializes(found):
    # the check itself: without do_not_specialize, each class is its own binary
    # (2 alignments x the valid (start, stop) classes)
    assert found["plain"] == 16, found


if __name__ == "__main__":
    print(json.dumps(specializations()))
