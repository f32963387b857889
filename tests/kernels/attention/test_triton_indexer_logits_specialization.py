# SPDX-License-Identifier: Apache-2.0
"""The portable indexer's logits kernels compile once, not once per batch shape.

Triton compiles a binary per value of each constexpr and per class of each integer
argument it specializes (equal to 1, divisible by 16, neither), at the first launch:
under serving load every request in flight waits for it. A prefill chunk's token and
key counts take every value, and so did the decode kernel's split count, a constexpr
that follows the decode rows of a step (eager in a mixed batch). Triton's own binder,
run without a GPU in a plain process, gives one specialization for the prefill
kernel over every class of its counts, where the same function without the
overlay's `do_not_specialize` gives one per class; the decode wrapper's launches
differ only in their grid.
"""

import json

import pytest
import torch

from vllm.v1.attention.ops import triton_indexer_logits as il

FP8 = torch.float8_e4m3fn


def specializations() -> dict:
    """Distinct specializations of the prefill kernel over the classes of its counts,
    as vLLM has it and its function plainly jitted (run in a plain process)."""
    from tests.v1.attention.test_triton_mla_sparse_targets import specialization_counts

    ptr = torch.zeros(64, dtype=torch.int32)[:16]
    calls = [
        # a chunk's tokens m; its keys n, also the logits' row stride
        ((ptr, ptr, ptr, ptr, ptr, ptr, ptr, m, n, 8192, 128, 128, 64, n),
         {"H": 64, "D": 128, "BLOCK_M": 2, "BLOCK_N": 128, "UPCAST": False, "ASM": True,
          "KEYS16": False})
        for m in (1, 16, 21)
        for n in (1, 16, 21)
    ]
    return specialization_counts(il._mqa_logits_kernel, calls)


@pytest.fixture(scope="module")
def found(run_without_gpu):
    return run_without_gpu(__name__)


def test_one_prefill_binary_for_every_chunk(found):
    assert found["vllm"] == 1, found


def test_the_counts_span_the_classes_triton_specializes(found):
    # the check itself: plainly jitted, each (tokens, keys) class is its own binary
    assert found["plain"] == 9, found


def test_one_decode_binary_for_every_split_count(monkeypatch):
    """The decode wrapper at 1..40 rows (next_n 1 and 2): the split count, the grid's
    second dimension, takes several values; the constexprs and integer arguments none."""
    seen = []

    class Launch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append((grid, args, kwargs))

    monkeypatch.setattr(il, "_paged_mqa_logits_kernel", Launch())
    H, D, bs, blocks, max_len = 4, 16, 4, 8, 32
    cache = torch.zeros(blocks, bs, D + 4, dtype=torch.uint8)
    for next_n in (1, 2):
        seen.clear()
        for batch in range(1, 41):
            q = torch.zeros(batch, next_n, H, D, dtype=FP8)
            il.triton_paged_mqa_logits(
                q, cache, torch.ones(batch * next_n, H),
                torch.ones(batch, next_n, dtype=torch.int32),
                torch.zeros(batch, 2, dtype=torch.int32), max_len, upcast=False)
        splits = {grid[1] for grid, _, _ in seen}
        assert len(splits) >= 5, splits
        ints = {tuple(a for a in args if isinstance(a, int)) for _, args, _ in seen}
        constexprs = {tuple(sorted(kwargs.items())) for _, _, kwargs in seen}
        assert len(ints) == 1 and len(constexprs) == 1, (ints, constexprs)


if __name__ == "__main__":
    print(json.dumps(specializations()))
