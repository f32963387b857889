# SPDX-License-Identifier: Apache-2.0
"""Inputs, a float64 reference and launch counting for the sparse MLA kernel tests
(imported as a top-level module: pytest puts this folder on sys.path, as does
running a test file as a script)."""

import torch

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
