# SPDX-License-Identifier: Apache-2.0
"""GGUF routed experts whose weights pass 2^31 bytes
(vllm_gguf_plugin.quantization.moe_expert_groups).

The plugin's tiled MoE kernels offset an expert's weights by expert x stride in 32-bit
integers; on the H200 its MMQ MoE kernel and its Triton MoE kernels gave outputs 10^4-10^5
times the float32 reference at GLM-5's shapes from Q4_K (H200, 2026-12-03, in the history of docs/results.md).

CPU: the expert groups at GLM-5's gate_up shape by file type, and the plugin's Triton
Q4_K MoE kernel under the Triton interpreter (which wraps 32-bit products as the GPU
does) on a weight of 2.77 GB, of which only the experts used are written, against
float32 products of gguf-py's dequantization. GPU: every MoE path of the kernel
benchmark at GLM-5's own expert shapes (Q4_K: 3.6 GB of gate_up) against float32.
"""

from unittest.mock import patch

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

GLM5_GATE_UP = (256, 2 * 2048, 6144)  # experts, rows (gate and up), hidden


def _row_bytes(qtype: T, cols: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return cols // block * size


# groups of GLM-5's gate_up: one where 256 experts fit in 2^31 - 1 bytes (IQ2_S at 2.06
# GB, Q2_K at 2.11 GB), else ceil(256 / experts that fit)
@pytest.mark.parametrize("qtype,groups", [(T.IQ2_S, 1), (T.Q2_K, 1), (T.Q3_K, 2),
                                          (T.Q4_K, 2), (T.Q6_K, 3), (T.Q8_0, 4)])
def test_glm5_gate_up_expert_groups(qtype, groups):
    from vllm_gguf_plugin.quantization.moe_expert_groups import expert_groups

    experts, rows, cols = GLM5_GATE_UP
    w = torch.empty(experts, rows, _row_bytes(qtype, cols), dtype=torch.uint8, device="meta")
    got = expert_groups(w)
    assert len(got) == groups
    assert got[0][0] == 0 and got[-1][1] == experts
    assert all(a[1] == b[0] for a, b in zip(got, got[1:]))
    assert all((end - first) * w.stride(0) <= 2**31 - 1 for first, end in got)


def test_one_expert_past_2gib_is_an_error():
    from vllm_gguf_plugin.quantization.moe_expert_groups import expert_groups

    w = torch.empty(2, 2**16, 2**15 + 1, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match="32-bit offsets"):
        expert_groups(w)


def _align(topk_ids: torch.Tensor, block_m: int, experts: int):
    """sorted token ids, expert per block and padded count, as moe_align_block_size
    returns them: each expert's slots (token * top_k + k) in order, padded to whole
    blocks with the invalid slot tokens * top_k."""
    flat = topk_ids.flatten().tolist()
    invalid = len(flat)
    sorted_ids, block_experts = [], []
    for e in range(experts):
        slots = [s for s, x in enumerate(flat) if x == e]
        if not slots:
            continue
        slots += [invalid] * (-len(slots) % block_m)
        sorted_ids += slots
        block_experts += [e] * (len(slots) // block_m)
    return (torch.tensor(sorted_ids, dtype=torch.int32),
            torch.tensor(block_experts, dtype=torch.int32),
            torch.tensor([len(sorted_ids)], dtype=torch.int32))


@pytest.fixture
def triton_moe_on_cpu(monkeypatch):
    """The plugin's Triton MoE wrappers refuse CPU tensors in their argument check; the
    kernels themselves run under the interpreter. The check sees CUDA tensors, nothing
    else does."""
    from vllm_gguf_plugin.triton.fused_moe import utils

    check = utils._validate_args

    def validate(*args, **kwargs):
        with patch.object(torch.Tensor, "is_cuda", property(lambda self: True)):
            return check(*args, **kwargs)

    monkeypatch.setattr(utils, "_validate_args", validate)


def test_triton_moe_past_2gib_matches_float32(triton_moe_on_cpu):
    import gguf

    from benchmarks.kernels.benchmark_gguf_ops import random_blocks
    from vllm_gguf_plugin.quantization.moe_expert_groups import (expert_groups,
                                                                 moe_by_expert_group)
    from vllm_gguf_plugin.triton.fused_moe.interface import ggml_moe_a8_triton
    from vllm_gguf_plugin.triton.fused_moe.utils import get_triton_moe_block_m

    # Q8_0 (the most bytes per weight: the least interpreted work for a given stride):
    # 8.9 MB an expert, 2.28 GB in all
    qtype = T.Q8_0
    experts, rows, cols = 256, 1024, 8192
    w = torch.empty(experts, rows, _row_bytes(qtype, cols), dtype=torch.uint8)
    assert (experts - 1) * w.stride(0) > 2**31 and len(expert_groups(w)) == 2
    used = (0, 255)  # 255 lies past 2^31 bytes: a 32-bit offset wraps there
    gen = torch.Generator().manual_seed(0)
    for e in used:
        w[e] = random_blocks(qtype.name, rows, cols, gen)
    topk_ids = torch.tensor([[0, 255], [255, 0], [0, 255]], dtype=torch.int32)
    tokens, top_k = topk_ids.shape
    x = (torch.randn(tokens, cols, generator=gen) * cols ** -0.5).to(torch.float16)

    sorted_ids, block_experts, padded = _align(topk_ids, get_triton_moe_block_m(qtype),
                                               experts)
    out = moe_by_expert_group(ggml_moe_a8_triton, x, w, sorted_ids, block_experts, padded,
                              topk_ids, int(qtype), rows, top_k, tokens)

    dequant = {e: torch.from_numpy(gguf.quants.dequantize(w[e].numpy(), qtype)
                                   .astype(np.float32)) for e in used}
    ref = torch.stack([x[s // top_k].float() @ dequant[e].T
                       for s, e in enumerate(topk_ids.flatten().tolist())])
    assert out.shape == (tokens * top_k, rows)
    torch.testing.assert_close(out.float(), ref, rtol=0.02, atol=0.02 * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
def test_benchmark_moe_paths_at_glm5_shapes(qtype):
    """Every MoE path, the plugin's choice at 128 tokens (MMQ) included, on GLM-5's 256
    experts of 2048 (gate_up past 2^31 bytes) against float32; routing is uniform, so
    experts past the 32-bit offsets are hit."""
    from benchmarks.kernels import benchmark_gguf_ops as bench

    rows = bench.moe_case(qtype, [8, 128], gen=torch.Generator().manual_seed(0),
                          triton_block_m=(4,))
    for row in rows:
        for path, res in row["paths"].items():
            assert "error" not in res, (row["M"], path, res)
            if path not in bench.REQUANTIZED:  # other codes than the file's
                assert res["rel"] <= bench.WRONG, (row["M"], path, res["rel"])
