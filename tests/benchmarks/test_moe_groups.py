# SPDX-License-Identifier: Apache-2.0
"""The candidate grouped MoE kernels for few tokens (benchmarks/kernels/moe_groups.py)
against gguf-py's dequantization: every (token, slot) pair's row is its expert's product
with its token, for groups of the layout vLLM's moe_align_block_size writes (padded
groups, unused blocks), under the Triton interpreter and on a GPU; and they compile for
every GPU that runs GGUF MoE decode."""

import gguf
import pytest
import torch

from benchmarks.kernels import benchmark_gguf_ops as bench
from benchmarks.kernels import moe_groups

QTYPES = sorted(moe_groups.BLOCK_BYTES)
# (type, Q4_K's sub-blocks scaled after their dots)
KERNELS = [("Q4_K", False), ("Q4_K", True), ("Q6_K", False)]


def align(topk_ids: torch.Tensor, block_m: int, experts: int):
    """moe_align_block_size's layout, written out: each expert's pairs (in pair order)
    padded to whole groups of block_m with the pair count, then two unused blocks (one
    of expert -1, one of an expert that is not there: not written), and the number of
    entries the used groups take."""
    flat = topk_ids.flatten().tolist()
    sorted_ids, expert_ids = [], []
    for e in range(experts):
        pairs = [p for p, x in enumerate(flat) if x == e]
        while pairs:
            block, pairs = pairs[:block_m], pairs[block_m:]
            sorted_ids += block + [len(flat)] * (block_m - len(block))
            expert_ids.append(e)
    used = len(sorted_ids)
    sorted_ids += [len(flat)] * (2 * block_m)
    expert_ids += [-1, 1 << 20]
    return (torch.tensor(sorted_ids, dtype=torch.int32),
            torch.tensor(expert_ids, dtype=torch.int32), torch.tensor([used], dtype=torch.int32))


def check_groups(qtype, dtype, device="cpu", scale_after=False):
    gen = torch.Generator().manual_seed(3)
    experts, rows, cols, tokens, top_k = 3, 40, 512, 20, 2  # 40 rows: a partial row block
    w = bench.random_blocks(qtype, experts * rows, cols, gen).view(experts, rows, -1)
    dense = torch.from_numpy(gguf.quants.dequantize(
        w.reshape(experts * rows, -1).numpy(), gguf.GGMLQuantizationType[qtype])
    ).view(experts, rows, cols)
    x = (torch.randn(tokens, cols, generator=gen) * 0.1).to(dtype)
    # expert 0 chosen by more tokens than a group holds: two groups of it
    topk_ids = torch.stack([torch.tensor([0, 1 + t % 2]) for t in range(tokens)]).int()
    sorted_ids, expert_ids, used = align(topk_ids, 16, experts)
    assert expert_ids.tolist()[:4] == [0, 0, 1, 2] and used.item() == 4 * 16
    y = moe_groups.moe_groups(*(t.to(device) for t in (x, w)), qtype,
                              *(t.to(device) for t in (sorted_ids, expert_ids, used)),
                              top_k, rows, block_n=16, scale_after=scale_after).cpu()
    assert y.shape == (tokens * top_k, rows) and y.dtype == dtype
    ref = torch.stack([dense[e] @ x[p // top_k].float()
                       for p, e in enumerate(topk_ids.flatten().tolist())])
    scale = ref.abs().max()
    assert scale > 0
    assert ((y.float() - ref).abs().max() / scale).item() < (2e-2 if dtype == torch.bfloat16
                                                              else 2e-3)


@pytest.mark.parametrize("qtype,scale_after", KERNELS)
def test_groups_match_dequantized_experts(qtype, scale_after):
    # (float16 only here: the interpreter's dot reads bfloat16 operands as other numbers)
    check_groups(qtype, torch.float16, scale_after=scale_after)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype,scale_after", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_groups_match_dequantized_experts_on_gpu(qtype, scale_after, dtype):
    check_groups(qtype, dtype, "cuda", scale_after)


def test_wrong_shapes_are_refused():
    w = torch.zeros(2, 8, 144, dtype=torch.uint8)
    ids, experts = torch.zeros(16, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    used = torch.tensor([16], dtype=torch.int32)
    with pytest.raises(ValueError, match="columns"):
        moe_groups.moe_groups(torch.zeros(1, 512), w, "Q4_K", ids, experts, used, 1, 8)
    with pytest.raises(ValueError, match="columns"):  # 144 bytes are no Q6_K block
        moe_groups.moe_groups(torch.zeros(1, 256), w, "Q6_K", ids, experts, used, 1, 8)
    with pytest.raises(ValueError, match=r"\[experts, 16, bytes\]"):
        moe_groups.moe_groups(torch.zeros(1, 256), w, "Q4_K", ids, experts, used, 1, 16)
    with pytest.raises(ValueError, match="block_m entries"):
        moe_groups.moe_groups(torch.zeros(1, 256), w, "Q4_K", ids[:8], experts, used, 1, 8)
    with pytest.raises(ValueError, match="take"):
        moe_groups.moe_groups(torch.zeros(1, 256), w, "Q5_K", ids, experts, used, 1, 8)
    with pytest.raises(ValueError, match="Q4_K's"):
        moe_groups.moe_groups(torch.zeros(1, 256), torch.zeros(2, 8, 210, dtype=torch.uint8),
                              "Q6_K", ids, experts, used, 1, 8, scale_after=True)


def compile_groups(arch: int, qtype: str, dtype: str, scale_after: bool) -> dict:
    """The kernel compiled for `arch` with `dtype` activations (run in a plain process):
    shared memory and whether its dots are tensor-core dots."""
    from tests.v1.attention import test_triton_mla_sparse_targets as targets

    targets.real_triton()
    sig = {"x_ptr": f"*{dtype}", "w_ptr": "*u8", "y_ptr": f"*{dtype}", "sorted_ids_ptr": "*i32",
           "expert_ids_ptr": "*i32", "num_post_padded_ptr": "*i32"}
    sig.update({name: "i32" for name in ("num_valid", "top_k", "n", "num_k_blocks",
                                          "stride_xm", "stride_we", "stride_wn", "stride_ym")})
    # what the JIT sees at GLM-5's shapes (rows of 24 or 8 blocks: 16-byte multiples)
    aligned = ["x_ptr", "w_ptr", "y_ptr", "sorted_ids_ptr", "stride_xm", "stride_we",
               "stride_wn", "stride_ym"]
    kernel = targets.compile_kernel(moe_groups._moe_groups_kernel, arch, sig,
                                    {"Q6_K": qtype == "Q6_K", "SCALE_AFTER": scale_after,
                                     "BLOCK_M": 16, "BLOCK_N": 32},
                                    aligned, {"num_warps": 4, "num_stages": 2})
    ttgir = kernel.asm["ttgir"]
    return {"shared": kernel.metadata.shared,
            "mma": ttgir.count("ttg.nvidia_mma") + ttgir.count("ttng.warp_group_dot")}


@pytest.mark.parametrize("arch", [80, 86, 89, 90, 120])
def test_groups_compile_for_every_target(run_without_gpu, arch):
    # the GPUs that run GGUF MoE decode; bfloat16 below SM 10.0, float16 from it (and
    # on any GPU with --dtype float16)
    for qtype, scale_after in KERNELS:
        for dtype in ("bf16", "fp16"):
            compiled = run_without_gpu("tests.benchmarks.test_moe_groups", arch, qtype, dtype,
                                       int(scale_after))
            assert compiled["mma"] > 0  # tensor-core dots, not scalar fallbacks
            assert compiled["shared"] <= 99 * 1024


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(compile_groups(int(sys.argv[1]), sys.argv[2], sys.argv[3],
                                    bool(int(sys.argv[4])))))
