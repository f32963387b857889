# SPDX-License-Identifier: Apache-2.0
"""Inputs, a float64 reference and launch counting for the sparse MLA kernel tests
(imported as a top-level module: pytest puts this folder on sys.path, as does
running a test file as a script)."""

import torch

from vllm.v1.attention.ops import triton_sparse_mla as tsm

KV_LORA, ROPE = 512, 64
HEAD = KV_LORA + ROPE


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


def check_against_float64_and_the_triton_tile(q, cache, slots, counts, scale, k_scale, outs):
    """Each output (float64 copies of a kernel's) within twice the error of the Triton
    tile the launch table gives without the Gluon tiles (at least 1e-2) from float64 on
    a few tokens, zeros for a token without valid slots, and close to that tile."""
    num_tokens, num_heads, _ = q.shape
    kv_fp8 = cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    triton_cfg = tsm.device_launch_config(q.device, num_tokens, num_heads, slots.shape[1],
                                          KV_LORA, 132, kv_fp8, warp_specialized=False)
    triton_tile = tsm.sparse_mla_attention(q, cache, slots, counts, KV_LORA, scale, k_scale,
                                           132, config=triton_cfg).double()
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
