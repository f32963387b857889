# SPDX-License-Identifier: Apache-2.0
"""The 8- and 16-head fp8 tile of sparse MLA (`gluon_sparse_mla_fp8`).

CPU: which shapes the launch table gives it, that a split longer than its slot
buffer is refused, and that it compiles for sm_90 and sm_120 within 99 KiB of shared
memory with no padded dots and no spills. GPU (`gpu` marker, SM90): through
`triton_sparse_mla.sparse_mla_attention`, against float64 and the Triton fp8 tile,
with split-K, fewer heads than the tile, queries beyond fp16's range, a top-k longer
than one split, a fallback for an e5m2 cache, and under CUDA-graph capture.
"""

import dataclasses
import json
import math
import re
import sys

import pytest
import torch

from tests.v1.attention.sparse_mla_cases import (
    HEAD,
    KV_LORA,
    ROPE,
    captured_launch,
    check_against_float64_and_the_triton_tile,
    compile_gluon_kernel,
    count_launches,
    main_loop_opcodes,
    reference,
    sparse_case,
)
from vllm.v1.attention.ops import sparse_mla_launch as sml
from vllm.v1.attention.ops import triton_sparse_mla as tsm

HOPPER_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


ROWS = sml.SparseMLATile.GLUON_FP8_ROWS
FP8 = torch.float8_e4m3fn


def launch(tokens, heads, kv_dtype=FP8, cap=90, smem=sml.HOPPER_SHARED_MEM, topk=2048,
           gluon=True):
    device = sml.SparseMLADevice(cap, smem, 132, gluon)
    return sml.sparse_mla_launch(device, tokens, heads, HEAD, KV_LORA, topk, torch.bfloat16,
                                 kv_dtype)


def test_launch_table_takes_it_for_few_heads_of_an_fp8_cache():
    # 1-32 heads at every token count
    for heads in (1, 5, 8, 12, 16, 17, 32):
        assert all(launch(t, heads).tile is ROWS for t in (1, 2, 8, 16, 31, 64, 255, 4096))
    c = launch(4096, 8)
    assert (c.block_h, c.block_n, c.num_warps) == (8, 64, 4)
    # 9-16 heads in one program (the rows read once for all of them), 17-32 in two
    assert [launch(4096, h).block_h for h in (1, 8, 9, 12, 16, 17, 32)] == [
        8, 8, 16, 16, 16, 16, 16]
    # not for more heads, a 16-bit cache, an e5m2 one, another GPU, or without the
    # Gluon tiles
    assert launch(4096, 33).tile is not ROWS and launch(4096, 64).tile is not ROWS
    assert launch(4096, 8, torch.bfloat16).tile is not ROWS
    assert launch(4096, 8, torch.float8_e5m2) == launch(4096, 8, torch.float8_e5m2,
                                                        gluon=False)
    for cap, smem in ((100, sml.HOPPER_SHARED_MEM), (120, 99 * 1024), (89, 99 * 1024),
                      (80, 163 * 1024), (90, 99 * 1024)):
        assert launch(4096, 8, cap=cap, smem=smem).tile is not ROWS
    t = launch(4096, 8, gluon=False)
    assert t.tile is sml.SparseMLATile.TRITON_V_RELOAD and t.block_h == 16
    # GLM-5's head (512 + 64) and 16-bit queries of either kind only
    device = sml.SparseMLADevice(90, sml.HOPPER_SHARED_MEM, 132)
    for head_dim, kv_lora_rank, q_dtype, rows in ((HEAD, KV_LORA, torch.float16, True),
                                                  (HEAD - 32, KV_LORA - 32, torch.bfloat16,
                                                   False)):
        got = sml.sparse_mla_launch(device, 4096, 8, head_dim, kv_lora_rank, 2048, q_dtype,
                                    FP8)
        assert (got.tile is ROWS) is rows
    # split-K to one wave of two programs an SM, at least two 64-row tiles a split
    tokens = (1, 2, 8, 16, 32, 64, 128, 256, 4096)
    for heads in (8, 16):
        assert [launch(t, heads).splits for t in tokens] == [16, 16, 16, 16, 8, 4, 2, 1, 1]
    assert [launch(t, 32).splits for t in tokens] == [16, 16, 16, 8, 4, 2, 1, 1, 1]
    # a split holds at most the tile's slot buffer: a longer top-k takes more splits
    from vllm.v1.attention.ops import gluon_sparse_mla_fp8 as g

    for topk in (2049, 4096, 5000):
        c = launch(4096, 8, topk=topk)
        split_len = tsm.split_k_outputs(torch.empty(1, 1, KV_LORA), topk, c.splits, 64)[0]
        assert c.splits >= 2 and split_len <= g.MAX_SLOTS


def test_batch_invariant_mode_takes_it_at_every_token_count(monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    for heads in (8, 16, 32):
        launches = {launch(t, heads) for t in (1, 2, 31, 64, 4096)}
        assert len(launches) == 1
        assert launches.pop().tile is ROWS


def test_a_split_longer_than_its_slot_buffer_is_refused():
    from vllm.v1.attention.ops import gluon_sparse_mla_fp8 as g

    q = torch.empty(1, 8, HEAD, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="4096 slots per split, more than its 2048"):
        g.sparse_mla_attention_fp8(q, torch.empty(8, HEAD), torch.empty(1, 4096), None, None,
                                   None, None, (0, 0, 0), (0, 0), 0.1, 4096, 1)
    with pytest.raises(ValueError, match="32 heads a program, not one of"):
        g.sparse_mla_attention_fp8(q, torch.empty(8, HEAD), torch.empty(1, 2048), None, None,
                                   None, None, (0, 0, 0), (0, 0), 0.1, 2048, 1, block_h=32)


@pytest.mark.parametrize("block_h", [8, 16])
def test_launch_constants_are_plain_values(monkeypatch, block_h):
    # after warm-up vLLM's Triton JIT monitor (vllm/triton_utils/jit_monitor.py) installs
    # Triton's jit_post_compile_hook, for which Triton serializes the kernel's constexprs
    # as JSON: a layout object among them fails the first compile at a new shape
    from vllm.v1.attention.ops import gluon_sparse_mla_fp8 as g

    q = torch.empty(3, 12, HEAD, dtype=torch.bfloat16)
    grid, kwargs = captured_launch(monkeypatch, g, "_sparse_mla_fp8_kernel", lambda: (
        g.sparse_mla_attention_fp8(q, torch.empty(8, HEAD), torch.empty(3, 2048), None, None,
                                   None, None, (0, 0, 0), (0, 0), 0.1, 1024, 2,
                                   block_h=block_h)))
    assert grid == (math.ceil(12 / block_h), 3, 2) and kwargs["BLOCK_H"] == block_h
    assert json.loads(json.dumps(kwargs)) == kwargs


def compile_tile(arch: int, partial: bool, block_h: int) -> dict:
    """Run in a plain process (no GPU needed): what ptxas makes of the tile."""
    from vllm.v1.attention.ops import gluon_sparse_mla_fp8 as g

    pointers = {"Q": "*bf16", "KV": "*fp8e4nv", "Slots": "*i32", "Counts": "*i32",
                "KScale": "*fp32", "O": "*fp32" if partial else "*bf16", "Lse": "*fp32"}
    consts = {"BLOCK_H": block_h, "BLOCK_N": g.TILE_ROWS, "D_V": KV_LORA, "D_R": ROPE,
              "MAX_SLOTS": g.MAX_SLOTS, "PARTIAL": partial, "num_warps": g.NUM_WARPS}
    kernel, report, sass = compile_gluon_kernel(g._sparse_mla_fp8_kernel, pointers, consts,
                                                arch, {"num_warps": g.NUM_WARPS})
    return {"shared": kernel.metadata.shared,
            "spill_bytes": sum(map(int, re.findall(r"(\d+) bytes spill stores", report))),
            "hmma": len(re.findall(r"\bHMMA\.16816\.F32 ", sass)),
            "bf16_hmma": len(re.findall(r"\bHMMA\.16816\.F32\.BF16 ", sass)),
            "fp8_to_f16": sass.count("F2FP.F16.E4M3.UNPACK_B"),
            "loop": dict(main_loop_opcodes(sass))}


@pytest.mark.parametrize("arch", [90, 120])
@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("block_h", [8, 16])
def test_compiles_without_padded_dots(run_without_gpu, arch, partial, block_h):
    got = run_without_gpu(__name__, arch, int(partial), block_h, timeout=900)
    # within the 99 KiB of SM 8.6/8.9/12.x as well as Hopper's 227 (two programs an SM)
    assert got["shared"] <= 99 * 1024 and 2 * got["shared"] <= sml.HOPPER_SHARED_MEM
    assert got["spill_bytes"] == 0
    # a warp's dots for each 8 heads: 36 score dots (576 / 16) over its 16 rows, 32 PV
    # dots over its 128 output columns (8 blocks of 16) and the tile's 64 rows (4 x 16);
    # the loop body twice (two buffers); fp16, none in bf16
    head_blocks = block_h // 8
    assert got["hmma"] == 2 * head_blocks * (36 + 32) and got["bf16_hmma"] == 0
    # each fp8 value of the 64-row tile converted once per dot that reads it, whatever
    # the heads: 576 for the scores, 512 for PV, over 4 warps, two per instruction
    assert got["fp8_to_f16"] == 2 * 64 * (576 + 512) // 4 // 2 // 32
    # the dots' operands arrive in the registers the dots read: the queries by ldmatrix
    # (stored in the order of the relabelled fp8 columns), a loop's 144 (8 heads) or 288
    # registers of them with no register moves (the loop's few moves are addresses and the
    # running maximum; the query layout before took 208 at 16 heads), and the V operand's
    # row pairs with one byte permute per four values of the tile's 64 x 512
    loop = got["loop"]
    moves = sum(n for op, n in loop.items() if re.match(r"@?(IMAD\.)?MOV\b", op))
    assert moves <= 12, loop
    assert loop.get("PRMT", 0) == 2 * 64 * 512 // 4 // 32 // 4


def fp8_case(*args, **kwargs):
    return sparse_case(*args, kv_dtype=torch.float8_e4m3fn, **kwargs)


@pytest.fixture
def launches(monkeypatch):
    """Counts the tile's launches."""
    from vllm.v1.attention.ops import gluon_sparse_mla_fp8 as g

    return count_launches(monkeypatch, g, "sparse_mla_attention_fp8")


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER_GPU, reason="SM90 only")
@pytest.mark.parametrize("num_tokens,num_heads,dtype", [
    (1, 8, torch.bfloat16), (2, 5, torch.bfloat16), (4, 16, torch.float16),
    (8, 32, torch.bfloat16), (64, 8, torch.bfloat16), (40, 8, torch.float16),
    (300, 5, torch.bfloat16), (33, 1, torch.bfloat16), (128, 16, torch.bfloat16),
    (130, 12, torch.float16), (256, 32, torch.bfloat16), (260, 20, torch.float16)])
def test_matches_float64_and_the_triton_tile(launches, num_tokens, num_heads, dtype):
    q, cache, slots, counts = fp8_case(num_tokens, num_heads, dtype,
                                       seed=num_tokens * 100 + num_heads)
    scale, k_scale = 1 / math.sqrt(192 + ROPE), torch.full((1,), 0.5, device="cuda")
    c = sml.sparse_mla_launch(sml.sparse_mla_device(q.device), num_tokens, num_heads, HEAD,
                              KV_LORA, 2048, dtype, cache.dtype)
    assert c.tile is ROWS
    outs = [tsm.sparse_mla_attention(q, cache, slots, counts, KV_LORA, scale, k_scale,
                                     launch=dataclasses.replace(c, splits=s)).double()
            for s in sorted({c.splits, 1, 4})]
    assert launches == sorted({c.splits, 1, 4})
    check_against_float64_and_the_triton_tile(q, cache, slots, counts, scale, k_scale, outs)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER_GPU, reason="SM90 only")
@pytest.mark.parametrize("num_tokens,num_heads", [(64, 8), (64, 16)])
def test_queries_beyond_fp16_keep_their_precision(launches, num_tokens, num_heads):
    # bf16 queries of magnitude ~1e5 (fp16 ends at 65504): the tile's per-head power
    # of two brings them into fp16 exactly; one head of zeros keeps a finite scale
    q, cache, slots, counts = fp8_case(num_tokens, num_heads, torch.bfloat16, seed=3,
                                       q_scale=3e4)
    q[:, 3] = 0
    scale, k_scale = 1 / (3e4 * math.sqrt(192 + ROPE)), torch.full((1,), 0.5, device="cuda")
    out = tsm.sparse_mla_attention(q, cache, slots, counts, KV_LORA, scale, k_scale).double()
    assert launches == [4]
    check_against_float64_and_the_triton_tile(q, cache, slots, counts, scale, k_scale, [out])


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER_GPU, reason="SM90 only")
def test_a_longer_top_k_takes_more_splits(launches):
    q, cache, slots, counts = fp8_case(40, 8, torch.bfloat16, seed=11, topk=4096)
    scale, k_scale = 1 / math.sqrt(192 + ROPE), torch.full((1,), 0.5, device="cuda")
    out = tsm.sparse_mla_attention(q, cache, slots, counts, KV_LORA, scale, k_scale).double()
    assert len(launches) == 1 and launches[0] >= 2
    check_against_float64_and_the_triton_tile(q, cache, slots, counts, scale, k_scale, [out])


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER_GPU, reason="SM90 only")
def test_an_e5m2_cache_falls_back_to_the_triton_tile(launches):
    q, cache, slots, counts = fp8_case(32, 8, torch.bfloat16, seed=5)
    cache = cache.float().to(torch.float8_e5m2)
    scale, k_scale = 1 / math.sqrt(192 + ROPE), torch.full((1,), 0.5, device="cuda")
    device = sml.sparse_mla_device(q.device)
    assert sml.sparse_mla_launch(device, 32, 8, HEAD, KV_LORA, 2048, q.dtype, FP8).tile is ROWS
    out = tsm.sparse_mla_attention(q, cache, slots, counts, KV_LORA, scale, k_scale).double()
    assert launches == []
    ref = reference(q, cache, slots, counts, scale, range(4), k_scale=0.5)
    for t in range(4):
        torch.testing.assert_close(out[t], ref[t], rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER_GPU, reason="SM90 only")
def test_replays_under_cuda_graph_capture(launches):
    q, cache, slots, counts = fp8_case(64, 8, torch.bfloat16, seed=13)
    scale, k_scale = 1 / math.sqrt(192 + ROPE), torch.full((1,), 0.5, device="cuda")

    def run():
        return tsm.sparse_mla_attention(q, cache, slots, counts, KV_LORA, scale, k_scale)

    eager = run().clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    # new slots and counts, copied into the captured tensors
    _, _, slots2, counts2 = fp8_case(64, 8, torch.bfloat16, seed=14)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    slots.copy_(slots2)
    counts.copy_(counts2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, run())
    assert not torch.equal(captured, eager)


if __name__ == "__main__":
    print(json.dumps(compile_tile(int(sys.argv[1]), bool(int(sys.argv[2])), int(sys.argv[3]))))
