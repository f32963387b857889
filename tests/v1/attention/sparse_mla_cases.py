# SPDX-License-Identifier: Apache-2.0
"""Inputs, a float64 reference, launch counting and SASS reading for the sparse MLA
kernel tests."""

import collections
import dataclasses
import os
import re
import subprocess

import torch

from vllm.v1.attention.ops import sparse_mla_launch as sml
from vllm.v1.attention.ops import triton_sparse_mla as tsm

KV_LORA, ROPE = 512, 64
HEAD = KV_LORA + ROPE


def compile_gluon_kernel(fn, pointers: dict, consts: dict, arch: int, options: dict):
    """Compile a Gluon sparse MLA kernel (the arguments of `_sparse_mla_ws_kernel` and
    `_sparse_mla_fp8_kernel`) for sm_`arch` without a GPU, as the JIT would at GLM-5
    shapes (16-byte aligned pointers, strides and split length). Returns the kernel,
    ptxas's -v report and the SASS. Run it in a plain process: the test session's
    Triton interpreter cannot compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource

    ints = ["stride_qt", "stride_qh", "stride_kv", "stride_st", "stride_ot", "stride_oh",
            "stride_os", "stride_lt", "stride_lh", "num_heads", "split_len"]
    sig = dict(pointers, sm_scale="fp32", **{name: "i32" for name in ints},
               **{name: "constexpr" for name in consts})
    aligned = list(pointers) + ints[:7] + ["split_len"]
    src = GluonASTSource(
        fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
        attrs={(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in aligned})
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    # the ptxas Triton compiled for (its PTX version follows it): for sm_100+ that may be
    # a system CUDA 13 one (TRITON_PTXAS_BLACKWELL_PATH, which importing flashinfer sets)
    ptxas = get_ptxas(arch).path
    cuobjdump = os.path.join(os.path.dirname(ptxas), "cuobjdump")
    if not os.path.exists(cuobjdump):
        cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                                 "cuobjdump")
    ptx_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"{fn.__name__}-{os.getpid()}.ptx")
    with open(ptx_path, "w") as f:
        f.write(kernel.asm["ptx"])
    try:
        proc = subprocess.run(
            [ptxas, "-v", f"--gpu-name=sm_{arch}a", ptx_path, "-o", ptx_path + ".cubin"],
            capture_output=True, text=True, check=False)
        assert proc.returncode == 0, f"{ptxas}: {proc.stderr[-2000:]}"
        sass = subprocess.run([cuobjdump, "-sass", ptx_path + ".cubin"], capture_output=True,
                              text=True, check=True).stdout
    finally:
        for path in (ptx_path, ptx_path + ".cubin"):
            if os.path.exists(path):
                os.remove(path)
    return kernel, proc.stderr, sass


def main_loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes (with their modifiers; "@" first for a predicated one) of the SASS's longest
    loop: the instructions from a backward branch's target to the branch."""
    ins = [(int(addr, 16), "@" + op if pred else op, rest) for addr, pred, op, rest in re.findall(
        r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[0-9T]+ )?([A-Z][A-Z0-9_.]*)([^;]*);", sass)]
    loops = [(int(m.group(1), 16), addr) for addr, op, rest in ins
             if op.lstrip("@").startswith("BRA") and (m := re.search(r"0x([0-9a-f]+)", rest))
             and int(m.group(1), 16) < addr]
    assert loops, "no loop in the SASS"
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    return collections.Counter(op for addr, op, _ in ins if start <= addr <= end)


def sparse_case(num_tokens, num_heads, dtype, seed, pool=65536, topk=2048, kv_dtype=None,
                q_scale=0.5):
    """Queries [T, H, 576], a cache of `pool` slots, each token's top-k slots and its
    count of valid ones (on the GPU)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    cache = (torch.randn(pool // 64, 64, HEAD, device="cuda", generator=g) * 0.5).to(
        kv_dtype or dtype)
    q = (torch.randn(num_tokens, num_heads, HEAD, device="cuda", generator=g) * q_scale).to(dtype)
    slots = torch.stack([torch.randperm(pool, device="cuda", generator=g)[:topk]
                         for _ in range(num_tokens)]).int()
    counts = torch.randint(1, topk + 1, (num_tokens,), device="cuda", dtype=torch.int32,
                           generator=g)
    # a full top-k, no valid slot, fewer slots than a tile, part of a last tile
    for t, n in enumerate((topk, 0, 37, 64 * 5 + 3)[:num_tokens]):
        counts[t] = n
    return q, cache, slots, counts


def reference(q, cache, slots, counts, scale, tokens, k_scale=1.0):
    """Each token's attention output in float64, from the cache's values times k_scale."""
    kv = cache.view(-1, HEAD).double() * k_scale
    out = {}
    for t in tokens:
        n = int(counts[t])
        if n == 0:
            out[t] = torch.zeros(q.shape[1], KV_LORA, dtype=torch.float64, device=q.device)
            continue
        rows = kv[slots[t, :n].long()]
        out[t] = torch.softmax((q[t].double() @ rows.T) * scale, -1) @ rows[:, :KV_LORA]
    return out


def count_launches(monkeypatch, module, name: str) -> list:
    """The split counts (a launcher's last argument) of each call to module.name."""
    calls = []
    launch = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args[-1])
        return launch(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def captured_launch(monkeypatch, module, kernel: str, launch) -> tuple:
    """The grid and keyword arguments of the one launch of module.<kernel> that
    `launch()` makes (the kernel replaced: nothing compiles or runs)."""
    launched = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((grid, kwargs))

    monkeypatch.setattr(module, kernel, Kernel())
    launch()
    (grid, kwargs), = launched
    return grid, kwargs


def check_against_float64_and_the_triton_tile(q, cache, slots, counts, scale, k_scale, outs):
    """Each output (float64 copies of a kernel's) within twice the error of the Triton
    tile the launch table gives without the Gluon tiles (at least 1e-2) from float64 on
    a few tokens, zeros for a token without valid slots, and close to that tile."""
    num_tokens, num_heads, _ = q.shape
    device = dataclasses.replace(sml.sparse_mla_device(q.device), gluon=False)
    triton_launch = sml.sparse_mla_launch(device, num_tokens, num_heads, HEAD, KV_LORA,
                                          slots.shape[1], q.dtype, cache.dtype)
    triton_tile = tsm.sparse_mla_attention(q, cache, slots, counts, KV_LORA, scale, k_scale,
                                           launch=triton_launch).double()
    tokens = sorted(set(range(min(num_tokens, 4))) | {num_tokens // 2, num_tokens - 1})
    ref = reference(q, cache, slots, counts, scale, tokens, k_scale=float(k_scale))
    for t in tokens:
        err_triton = (triton_tile[t] - ref[t]).abs().max().item()
        for out in outs:
            assert (out[t] - ref[t]).abs().max().item() <= max(2 * err_triton, 1e-2), t
            if int(counts[t]) == 0:
                assert (out[t] == 0).all()
    for out in outs:
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, triton_tile, rtol=2e-2, atol=2e-2)
