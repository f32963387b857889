# SPDX-License-Identifier: Apache-2.0
"""The Gluon 64-head tile experiment (benchmarks/kernels/gluon_sparse_mla.py): on the
CPU, that it compiles for sm_90 within Hopper's shared memory with the next tile's
copy issued before the wait for the current one; on a GPU, its results against
float64 and `triton_sparse_mla.sparse_mla_attention` (on Hopper, since the
warp-specialized tile landed, that tile)."""

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
MODULE = ROOT / "benchmarks" / "kernels" / "gluon_sparse_mla.py"


def load_module():
    spec = importlib.util.spec_from_file_location("gluon_sparse_mla", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_for_sm90(block_n: int, partial: bool) -> dict:
    """Run in a plain process (no GPU needed): shared bytes and the main loop's PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = load_module()._sparse_mla_wgmma_kernel
    sig = {"Q": "*bf16", "KV": "*bf16", "Slots": "*i32", "Counts": "*i32",
           "O": "*fp32" if partial else "*bf16", "Lse": "*fp32", "sm_scale": "fp32"}
    ints = ["stride_qt", "stride_qh", "stride_kv", "stride_st", "stride_ot", "stride_oh",
            "stride_os", "stride_lt", "stride_lh", "num_heads", "split_len"]
    sig.update({name: "i32" for name in ints})
    consts = {"BLOCK_N": block_n, "D_V": 512, "D_R": 64, "PARTIAL": partial, "num_warps": 8}
    sig.update({name: "constexpr" for name in consts})
    aligned = [k for k, v in sig.items() if v.startswith("*")] + ints[:7] + ["split_len"]
    src = GluonASTSource(
        fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
        attrs={(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in aligned})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    ptx = kernel.asm["ptx"]
    loop = ptx[ptx.index("cp.async.commit_group"):]  # after the first tile's copy
    return {"shared": kernel.metadata.shared,
            "loop_ops": [" ".join(op.split()) for op in re.findall(
                r"cp\.async\.cg|cp\.async\.wait_group\s+\d|wgmma\.mma_async", loop)]}


@pytest.mark.parametrize("partial", [False, True])
def test_compiles_for_sm90_with_the_copy_ahead(run_without_gpu, partial):
    got = run_without_gpu(__file__, int(partial), timeout=600)
    assert got["shared"] <= 227 * 1024
    ops = got["loop_ops"]
    # in the loop: the next tile's copies, then the wait that leaves them in flight,
    # then the dots on the current tile
    first_wait = ops.index("cp.async.wait_group 1")
    assert "cp.async.cg" in ops[:first_wait]
    assert ops.index("wgmma.mma_async") > first_wait


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability()[0] != 9, reason="sm_90 only")
@pytest.mark.parametrize("T,H,dtype", [(1, 64, torch.bfloat16), (8, 64, torch.bfloat16),
                                       (64, 64, torch.bfloat16), (300, 64, torch.bfloat16),
                                       (5, 128, torch.bfloat16), (8, 64, torch.float16),
                                       (3, 40, torch.bfloat16)])
def test_matches_float64_and_the_triton_kernel(T, H, dtype):
    from vllm.v1.attention.ops import triton_sparse_mla as tsm

    gl_ops = load_module()
    dev, pool, topk, d = "cuda", 65536, 2048, 576
    g = torch.Generator(device=dev).manual_seed(T * 1000 + H)
    cache = (torch.randn(pool // 64, 64, d, device=dev, generator=g) * 0.5).to(dtype)
    q = (torch.randn(T, H, d, device=dev, generator=g) * 0.5).to(dtype)
    slots = torch.stack([torch.randperm(pool, device=dev, generator=g)[:topk]
                         for _ in range(T)]).int()
    counts = torch.randint(1, topk + 1, (T,), device=dev, dtype=torch.int32, generator=g)
    counts[0] = topk
    scale, one = 1 / math.sqrt(256), torch.ones(1, device=dev)
    cfg = gl_ops.device_launch_config(torch.device(dev), T, H, topk, 512, 132, False)
    assert cfg["GLUON"]
    outs = [gl_ops.sparse_mla_attention(q, cache, slots, counts, 512, scale, one, 132,
                                        config=c).double()
            for c in (cfg, dict(cfg, splits=1))]
    ref_kernel = tsm.sparse_mla_attention(q, cache, slots, counts, 512, scale, one, 132).double()
    kv = cache.view(-1, d).double()
    for i in range(min(T, 16)):
        rows = kv[slots[i, :int(counts[i])].long()]
        ref = torch.softmax((q[i].double() @ rows.T) * scale, -1) @ rows[:, :512]
        err_triton = (ref_kernel[i] - ref).abs().max().item()
        for out in outs:
            assert (out[i] - ref).abs().max().item() <= max(2 * err_triton, 1e-2)
    for out in outs:
        torch.testing.assert_close(out, ref_kernel, rtol=2e-2, atol=2e-2)


if __name__ == "__main__":
    print(json.dumps(compile_for_sm90(64, bool(int(sys.argv[1])))))
