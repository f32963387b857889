# SPDX-License-Identifier: Apache-2.0
"""The warp-specialized Hopper tile of sparse MLA (`gluon_sparse_mla`).

CPU: which tiles the launch table gives it, that its launch constants survive JSON
(vLLM's Triton JIT monitor), and that it compiles for sm_90 into a
producer and two consumers within Hopper's shared memory, with pipelined wgmma
dots (ptxas serializes every wgmma of a kernel when it cannot prove them
independent, at about 1.6x the time on the H200). GPU (`gpu` marker, SM90):
through `triton_sparse_mla.sparse_mla_attention`, against float64 and the Triton
tile, at split-K and edge shapes, and under CUDA-graph capture.
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
    reference,
    sparse_case,
)
from vllm.v1.attention.ops import sparse_mla_launch as sml
from vllm.v1.attention.ops import triton_sparse_mla as tsm

HOPPER_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_launch_constants_are_plain_values(monkeypatch, kv_dtype):
    # after warm-up vLLM's Triton JIT monitor (vllm/triton_utils/jit_monitor.py) makes
    # Triton serialize the kernel's constexprs as JSON: a layout object among them
    # fails the first compile at a new shape (as it did for the fp8 rows tile)
    from vllm.v1.attention.ops import gluon_sparse_mla as gsm

    q = torch.empty(3, 40, HEAD, dtype=torch.bfloat16)
    grid, kwargs = captured_launch(monkeypatch, gsm, "_sparse_mla_ws_kernel", lambda: (
        gsm.sparse_mla_attention_ws(q, torch.empty(8, HEAD, dtype=kv_dtype),
                                    torch.empty(3, 2048), None, None, None, None, (0, 0, 0),
                                    (0, 0), 0.1, 1024, 2)))
    assert grid == (1, 3, 2) and kwargs["PARTIAL"] is True
    assert json.loads(json.dumps(kwargs)) == kwargs


def compile_for_sm90(partial: bool, kv_fp8: bool = False) -> dict:
    """Run in a plain process (no GPU needed): what ptxas makes of the tile."""
    from vllm.v1.attention.ops import gluon_sparse_mla as gsm

    pointers = {"Q": "*bf16", "KV": "*fp8e4nv" if kv_fp8 else "*bf16", "Slots": "*i32",
                "Counts": "*i32", "KScale": "*fp32", "O": "*fp32" if partial else "*bf16",
                "Lse": "*fp32"}
    consts = {"BLOCK_N": gsm.TILE_ROWS, "STAGES": gsm.NUM_STAGES, "D_V": KV_LORA,
              "D_R": ROPE, "PARTIAL": partial, "num_warps": 4}
    kernel, ptxas, sass = compile_gluon_kernel(gsm._sparse_mla_ws_kernel, pointers, consts, 90,
                                               {"num_warps": 4, "maxnreg": 168})
    ptx = kernel.asm["ptx"]
    return {"shared": kernel.metadata.shared,
            "setmaxnreg": re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx),
            "copy_arrives": len(re.findall(r"cp\.async\.mbarrier\.arrive\.noinc", ptx)),
            "cta_barriers": len(re.findall(r"bar\.sync\s+\d+;", ptx)),
            "score_wgmma": len(re.findall(r"wgmma\.mma_async\S*m64n32k16", ptx)),
            "pv_wgmma": len(re.findall(r"wgmma\.mma_async\S*m64n256k16", ptx)),
            "ptxas_warnings": sorted(set(re.findall(r"\((C\d+)\) Potential Performance Loss",
                                                   ptxas))),
            "scalar_bf16_cvts": len(re.findall(r"cvt\.rn\.bf16\.f16|cvt\.bf16\.f16", ptx)),
            "hgmma": sass.count("HGMMA."),
            "wgmma_waits": sass.count("WARPGROUP.DEPBAR")}


@pytest.mark.parametrize("kv_fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("partial", [False, True])
def test_compiles_for_sm90_as_producer_and_two_consumers(run_without_gpu, partial, kv_fp8):
    got = run_without_gpu(__name__, int(partial), int(kv_fp8), timeout=900)
    assert got["shared"] <= sml.HOPPER_SHARED_MEM
    # the consumers' and the producer's register budgets (the fp8 producer converts
    # rows); the query copies arrive on their barrier, and the 16-bit producer's row
    # copies on the stages'; no barrier over the whole CTA (named barriers of 128
    # threads)
    assert ({"224", "56"} if kv_fp8 else {"232", "40"}) <= set(got["setmaxnreg"])
    assert got["copy_arrives"] == (1 if kv_fp8 else 2)
    assert got["cta_barriers"] == 0
    # per consumer: 32 + 4 score dots of 64 heads x 32 rows (its half of the tile's
    # rows; latent and rope parts) and 4 PV dots of 64 x 256 (both halves' P)
    assert got["score_wgmma"] == 2 * 36 and got["pv_wgmma"] == 2 * 4
    # pipelined dots: no serialization warning, and a few waits for 80 dots
    # (one per dot when ptxas serializes them)
    assert got["ptxas_warnings"] == []
    assert got["hgmma"] == 80 and got["wgmma_waits"] <= 8
    # the fp8 producer converts to bf16 packed (`_e4m3_to`), not one element at a time
    assert got["scalar_bf16_cvts"] == 0


WS = sml.SparseMLATile.GLUON_WARP_SPECIALIZED
FP8 = torch.float8_e4m3fn


def launch(heads, kv_dtype=torch.bfloat16, smem=sml.HOPPER_SHARED_MEM, cap=90, tokens=8,
           gluon=True, q_dtype=torch.bfloat16):
    device = sml.SparseMLADevice(cap, smem, 132, gluon)
    return sml.sparse_mla_launch(device, tokens, heads, HEAD, KV_LORA, 2048, q_dtype, kv_dtype)


def test_launch_table_takes_hopper_warp_specialized_tiles():
    def ws(*args, **kwargs):
        return launch(*args, **kwargs).tile is WS

    assert ws(64) and ws(128) and ws(40) and ws(64, tokens=4096)
    assert ws(64, FP8) and ws(128, FP8, tokens=300)
    # fewer heads (masked in the 64-head tile): 17-32 of a 16-bit cache from 8 tokens
    # on, 33-63 of an fp8 one at any count
    assert ws(32) and ws(20, tokens=4096) and not ws(32, tokens=4) and not ws(32, tokens=1)
    assert not ws(16) and not ws(8) and not ws(16, tokens=4096)
    for tokens in (1, 8, 4096):
        for heads in (33, 40, 63):
            c = launch(heads, FP8, tokens=tokens)
            assert c.tile is WS and c.block_h == 64
        for heads in (8, 16, 32):
            # (up to 32 heads: the fp8 rows tile, test_gluon_sparse_mla_fp8)
            assert launch(heads, FP8, tokens=tokens).tile is sml.SparseMLATile.GLUON_FP8_ROWS
            # without the Gluon tiles, the Triton tile (what runs where they cannot)
            t = launch(heads, FP8, tokens=tokens, gluon=False)
            assert t.tile is sml.SparseMLATile.TRITON_V_RELOAD
            assert t.block_h == (16 if heads <= 16 else 32)
        assert not ws(heads, FP8, cap=120, smem=99 * 1024)
    assert launch(32, gluon=False).block_h == 16  # two programs at 8 tokens
    assert not ws(64, gluon=False) and not ws(64, FP8, gluon=False)
    assert not ws(64, cap=100) and not ws(64, cap=120, smem=99 * 1024)
    assert not ws(64, cap=89, smem=99 * 1024) and not ws(64, cap=80, smem=163 * 1024)
    assert not ws(64, smem=99 * 1024)  # an SM90 part without 227 KiB
    # split-K: at least two 64-row tiles per split from two tokens on (one token
    # takes 32 splits of one tile), where the Triton tile takes 32 at 4 tokens
    assert launch(64, tokens=1).splits == 32 and launch(64, tokens=4).splits == 16
    assert launch(64, FP8, tokens=4).splits == 16
    assert launch(64, tokens=4, cap=100).splits == 32
    assert launch(64, tokens=16).splits == 8 and launch(64, tokens=64).splits == 2
    # fewer heads: one program per (token, split) as at 64 heads
    assert launch(40, FP8, tokens=1).splits == 32
    assert launch(40, FP8, tokens=8).splits == launch(32).splits == 16


def test_launch_needs_the_glm5_shapes_and_dtypes():
    # where the tile does not take the tensors, the table's Triton tile for them
    triton = launch(64, gluon=False)
    assert launch(64, FP8).tile is WS and launch(64, q_dtype=torch.float16,
                                                 kv_dtype=torch.float16).tile is WS
    assert launch(64, torch.float8_e5m2) == launch(64, torch.float8_e5m2, gluon=False)
    assert launch(64, q_dtype=torch.float16) == triton  # a bf16 cache
    device = sml.SparseMLADevice(90, sml.HOPPER_SHARED_MEM, 132)
    for head_dim, kv_lora_rank in ((544, 480), (576 + 64, 512)):
        got = sml.sparse_mla_launch(device, 8, 64, head_dim, kv_lora_rank, 2048,
                                    torch.bfloat16, torch.bfloat16)
        assert got.tile is sml.SparseMLATile.TRITON, (head_dim, kv_lora_rank)
    # the Triton interpreter's device (CPU tensors) runs no Gluon tile
    assert sml.sparse_mla_device(torch.device("cpu")) == sml.INTERPRETER_DEVICE
    assert not sml.INTERPRETER_DEVICE.gluon


@pytest.mark.skipif(torch.cuda.is_available() and not HOPPER_GPU, reason="SM90 or CPU")
def test_falls_back_to_the_triton_tiles_own_entry(monkeypatch):
    # Where the table chose the warp-specialized tile but that kernel does not take
    # the tensors (an e5m2 cache on the GPU, the interpreter's CPU tensors), the Triton
    # tile runs with the table's entry for it (40 heads of an fp8 cache: the 64-head
    # tile's, as in `test_launch_table_takes_hopper_warp_specialized_tiles`); against
    # float64.
    calls = []
    table = tsm.sparse_mla_launch

    def recorded(*args, **kwargs):
        calls.append(table(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(tsm, "sparse_mla_launch", recorded)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(5)
    q = (torch.randn(2, 40, HEAD, generator=g) * 0.5).half().to(dev)
    cache = (torch.randn(4, 16, HEAD, generator=g) * 0.5).to(
        torch.float8_e5m2 if dev == "cuda" else torch.float8_e4m3fn).to(dev)
    slots = torch.stack([torch.randperm(64, generator=g)[:32] for _ in range(2)]).int().to(dev)
    counts = torch.tensor([32, 20], dtype=torch.int32, device=dev)
    scale, k_scale = 1 / math.sqrt(192 + ROPE), torch.full((1,), 0.5, device=dev)
    out = tsm.sparse_mla_attention(q, cache, slots, counts, KV_LORA, scale, k_scale)
    hopper = sml.SparseMLADevice(90, sml.HOPPER_SHARED_MEM, 132, gluon=False)
    assert calls == [sml.sparse_mla_launch(hopper, 2, 40, HEAD, KV_LORA, 32, q.dtype,
                                           cache.dtype)]
    assert calls[0].tile is sml.SparseMLATile.TRITON and calls[0].block_h == 64
    ref = reference(q, cache, slots, counts, scale, range(2), k_scale=0.5)
    for t in range(2):
        torch.testing.assert_close(out[t].double(), ref[t], rtol=1e-2, atol=1e-2)


@pytest.fixture
def launches(monkeypatch):
    """Counts the warp-specialized tile's launches."""
    from vllm.v1.attention.ops import gluon_sparse_mla as gsm

    return count_launches(monkeypatch, gsm, "sparse_mla_attention_ws")


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER_GPU, reason="SM90 only")
@pytest.mark.parametrize("num_tokens,num_heads,dtype", [
    (1, 64, torch.bfloat16), (8, 64, torch.bfloat16), (64, 64, torch.bfloat16),
    (300, 64, torch.bfloat16), (5, 128, torch.bfloat16), (8, 64, torch.float16),
    (3, 40, torch.bfloat16), (4, 96, torch.float16), (8, 32, torch.bfloat16),
    (16, 20, torch.float16)])
def test_matches_float64_and_the_triton_tile(launches, num_tokens, num_heads, dtype):
    q, cache, slots, counts = sparse_case(num_tokens, num_heads, dtype,
                                          seed=num_tokens * 1000 + num_heads)
    scale, one = 1 / math.sqrt(192 + ROPE), torch.ones(1, device="cuda")
    chosen = sml.sparse_mla_launch(sml.sparse_mla_device(q.device), num_tokens, num_heads,
                                   HEAD, KV_LORA, 2048, dtype, cache.dtype)
    assert chosen.tile is WS
    outs = [tsm.sparse_mla_attention(q, cache, slots, counts, KV_LORA, scale, one,
                                     launch=c).double()
            for c in (chosen, dataclasses.replace(chosen, splits=1))]
    assert launches == [chosen.splits, 1]
    # against the Triton tile the table gives where the warp-specialized one cannot run
    check_against_float64_and_the_triton_tile(q, cache, slots, counts, scale, one, outs)
    assert len(launches) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER_GPU, reason="SM90 only")
@pytest.mark.parametrize("num_tokens,num_heads,dtype", [
    (1, 64, torch.bfloat16), (8, 64, torch.bfloat16), (300, 64, torch.bfloat16),
    (5, 128, torch.bfloat16), (8, 64, torch.float16), (3, 40, torch.bfloat16),
    (1, 33, torch.bfloat16), (8, 48, torch.float16), (64, 63, torch.bfloat16)])
def test_fp8_cache_matches_float64_and_the_triton_tile(launches, num_tokens, num_heads, dtype):
    # an fp8 e4m3 cache with a per-tensor scale: the producer converts the rows
    q, cache, slots, counts = sparse_case(num_tokens, num_heads, dtype, seed=num_tokens + 7,
                                          kv_dtype=torch.float8_e4m3fn)
    scale = 1 / math.sqrt(192 + ROPE)
    k_scale = torch.full((1,), 0.5, device="cuda")
    chosen = sml.sparse_mla_launch(sml.sparse_mla_device(q.device), num_tokens, num_heads,
                                   HEAD, KV_LORA, 2048, dtype, cache.dtype)
    assert chosen.tile is WS
    outs = [tsm.sparse_mla_attention(q, cache, slots, counts, KV_LORA, scale, k_scale,
                                     launch=c).double()
            for c in (chosen, dataclasses.replace(chosen, splits=1))]
    assert launches == [chosen.splits, 1]
    check_against_float64_and_the_triton_tile(q, cache, slots, counts, scale, k_scale, outs)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER_GPU, reason="SM90 only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_e4m3_conversion_is_exact_for_every_value(dtype):
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from vllm.v1.attention.ops import gluon_sparse_mla as gsm

    @gluon.jit
    def convert(X, Y, N: gl.constexpr):
        layout: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
        offs = gl.arange(0, N, layout)
        x = gl.load(X + offs)
        gl.store(Y + offs, gsm._e4m3_to(x, Y.dtype.element_ty))

    # every e4m3 code but the two NaNs, each at every position of a packed group of 4
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    x = torch.cat([codes.roll(i) for i in range(4)]).cuda()
    x = torch.cat([x, x[:1024 - x.numel()]]).view(torch.float8_e4m3fn)
    y = torch.empty(1024, dtype=dtype, device="cuda")
    convert[(1,)](x, y, 1024, num_warps=4)
    # bitwise, so the sign of zero counts too
    assert torch.equal(y.view(torch.int16), x.to(dtype).view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER_GPU, reason="SM90 only")
def test_reads_no_row_past_a_tokens_count(launches):
    # NaN in every slot after each token's valid ones and in the rest of the cache:
    # a masked row that were read would make the output NaN
    num_tokens, num_heads = 4, 64
    q, cache, slots, counts = sparse_case(num_tokens, num_heads, torch.bfloat16, seed=11,
                                          pool=16384)
    used = torch.zeros(cache.shape[0] * 64, dtype=torch.bool, device="cuda")
    for t in range(num_tokens):
        used[slots[t, :int(counts[t])].long()] = True
    cache.view(-1, HEAD)[~used] = float("nan")
    scale, one = 1 / math.sqrt(192 + ROPE), torch.ones(1, device="cuda")
    out = tsm.sparse_mla_attention(q, cache, slots, counts, KV_LORA, scale, one)
    assert launches
    assert torch.isfinite(out).all()
    ref = reference(q, cache, slots, counts, scale, range(num_tokens))
    for t in range(num_tokens):
        torch.testing.assert_close(out[t].double(), ref[t], rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER_GPU, reason="SM90 only")
@pytest.mark.parametrize("num_tokens", [2, 64])  # with and without split-K
def test_cuda_graph_capture_and_replay(launches, num_tokens):
    q, cache, slots, counts = sparse_case(num_tokens, 64, torch.bfloat16, seed=21)
    scale, one = 1 / math.sqrt(192 + ROPE), torch.ones(1, device="cuda")

    def run():
        return tsm.sparse_mla_attention(q, cache, slots, counts, KV_LORA, scale, one)

    eager = run()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = run()
    graph.replay()
    torch.testing.assert_close(graphed, eager, rtol=0, atol=0)
    q2, cache2, slots2, counts2 = sparse_case(num_tokens, 64, torch.bfloat16, seed=22)
    q.copy_(q2)
    cache.copy_(cache2)
    slots.copy_(slots2)
    counts.copy_(counts2)
    graph.replay()
    torch.testing.assert_close(graphed, run(), rtol=0, atol=0)
    assert launches


if __name__ == "__main__":
    print(json.dumps(compile_for_sm90(bool(int(sys.argv[1])), bool(int(sys.argv[2])))))
