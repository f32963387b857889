# SPDX-License-Identifier: Apache-2.0
"""Portable sparse-indexer logits against a float64 reference of the formula
logits[t, s] = scale_k[s] * sum_h w[t, h] * relu(q[t, h] . k[s]) (from the
dequantized fp8 inputs), and on the GPU against DeepGEMM on the same inputs."""

import math

import pytest
import torch

from vllm.v1.attention.ops import triton_indexer_logits as il

FP8 = torch.float8_e4m3fn
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference_logits(q, k, k_scale, w):
    """q [M,H,D] fp8, k [N,D] fp8, k_scale [N], w [M,H] -> float64 [M,N]."""
    s = torch.einsum("mhd,nd->mhn", q.double().cpu(), k.double().cpu())
    return (s.relu() * w.double().cpu()[:, :, None]).sum(1) * k_scale.double().cpu()[None]


def random_fp8(*shape, g, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).clamp(-448, 448).to(FP8)


def recall(ours, ref, k):
    """Share of our top-k positions whose reference logit reaches the k-th best
    reference logit (ties count as hits)."""
    top = torch.topk(ours, k).indices
    kth = torch.topk(ref, k).values[-1]
    return (ref[top] >= kth - 1e-5 * kth.abs().clamp(min=1)).double().mean().item()


# --------------------------------------------------------------------------------------
# CPU (Triton interpreter) and GPU
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("upcast", [True, False], ids=["fp16-dot", "fp8-dot"])
def test_prefill_logits(upcast):
    if not upcast and DEVICE == "cpu":
        pytest.skip("fp8 tensor-core dots run on the GPU only")
    g = torch.Generator().manual_seed(0)
    M, H, D, N = 7, 4, 32, 150
    q, k = random_fp8(M, H, D, g=g), random_fp8(N, D, g=g)
    k_scale = torch.rand(N, generator=g) + 0.5
    w = torch.randn(M, H, generator=g)
    ks = torch.randint(0, 60, (M,), generator=g, dtype=torch.int32)
    ke = torch.minimum(ks + torch.randint(1, 120, (M,), generator=g, dtype=torch.int32),
                       torch.tensor(N, dtype=torch.int32))
    ke[3] = ks[3]  # an empty row
    to = dict(device=DEVICE)
    out = il.triton_mqa_logits(q.to(**to), k.to(**to), k_scale.to(**to), w.to(**to),
                               ks.to(**to), ke.to(**to), upcast=upcast).cpu()
    ref = reference_logits(q, k, k_scale, w)
    # One program row covers all 7 queries; it computes the 128-wide key tiles
    # that overlap the union of their ranges and writes -inf outside each range.
    first, last = int(ks.min()) // 128 * 128, min(N, -(-int(ke.max()) // 128) * 128)
    for m in range(M):
        lo, hi = int(ks[m]), int(ke[m])
        torch.testing.assert_close(out[m, lo:hi].double(), ref[m, lo:hi], rtol=1e-4, atol=1e-3)
        outside = torch.cat([out[m, first:lo], out[m, hi:last]])
        assert torch.isneginf(outside).all()


@pytest.mark.parametrize("next_n", [1, 2])
@pytest.mark.parametrize("upcast", [True, False], ids=["fp16-dot", "fp8-dot"])
def test_paged_decode_logits(next_n, upcast):
    if not upcast and DEVICE == "cpu":
        pytest.skip("fp8 tensor-core dots run on the GPU only")
    g = torch.Generator().manual_seed(1)
    B, H, D, BS, NB = 3, 4, 32, 16, 40
    ctx = [37, 16, 90]
    max_model_len = 112
    q = random_fp8(B, next_n, H, D, g=g)
    w = torch.randn(B * next_n, H, generator=g)
    keys = []
    cache = torch.zeros(NB, BS, D + 4, dtype=torch.uint8)
    table = torch.zeros(B, math.ceil(max_model_len / BS), dtype=torch.int32)
    free = torch.randperm(NB, generator=g).tolist()
    for b, n in enumerate(ctx):
        k = random_fp8(n, D, g=g)
        sc = torch.rand(n, generator=g) + 0.5
        for t in range(n):
            if t % BS == 0:
                table[b, t // BS] = free.pop()
            blk, off = int(table[b, t // BS]), t % BS
            flat = cache.view(NB, -1)
            flat[blk, off * D:(off + 1) * D] = k[t].view(torch.uint8)
            flat[blk, BS * D + off * 4:BS * D + off * 4 + 4] = sc[t:t + 1].view(torch.uint8)
        keys.append((k, sc))
    # Token j of next_n sees ctx - next_n + j + 1 keys (causal MTP rows).
    seq_lens = torch.tensor([[c - next_n + j + 1 for j in range(next_n)] for c in ctx],
                            dtype=torch.int32)
    to = dict(device=DEVICE)
    out = il.triton_paged_mqa_logits(q.to(**to), cache.to(**to), w.to(**to), seq_lens.to(**to),
                                     table.to(**to), max_model_len, upcast=upcast).cpu()
    assert out.shape == (B * next_n, max_model_len)
    for b, (k, sc) in enumerate(keys):
        for j in range(next_n):
            r, n = b * next_n + j, int(seq_lens[b, j])
            ref = reference_logits(q[b, j:j + 1], k[:n], sc[:n], w[r:r + 1])[0]
            torch.testing.assert_close(out[r, :n].double(), ref, rtol=1e-4, atol=1e-3)
            tail = out[r, n:math.ceil(n / BS) * BS]
            assert torch.isneginf(tail).all()


def test_backend_choice(monkeypatch):
    for value, expect in (("triton", "triton"), ("deepgemm", "deepgemm"), ("TRITON", "triton")):
        monkeypatch.setenv(il.LOGITS_BACKEND_ENV, value)
        il.indexer_logits_backend.cache_clear()
        assert il.indexer_logits_backend() == expect
    monkeypatch.setenv(il.LOGITS_BACKEND_ENV, "cutlass")
    il.indexer_logits_backend.cache_clear()
    with pytest.raises(ValueError, match="expected auto, deepgemm or triton"):
        il.indexer_logits_backend()
    il.indexer_logits_backend.cache_clear()


# Where vLLM 0.26 runs DeepGEMM's indexer kernels: `support_deep_gemm` is SM90,
# the SM100 family and (new in 0.26) the SM120 family, whose FP8 MQA logits
# kernels (sm120_fp8_mqa_logits / sm120_fp8_paged_mqa_logits) the DeepGEMM it
# vendors ships. Everywhere else the Triton kernels compute the logits.
DEEPGEMM_CAPABILITIES = {(9, 0), (10, 0), (10, 3), (12, 0), (12, 1)}


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3),
                                        (11, 0), (12, 0), (12, 1)])
@pytest.mark.parametrize("deep_gemm_installed", [True, False])
def test_auto_backend_follows_vllm_support(monkeypatch, capability, deep_gemm_installed):
    from cuda_platform import import_cuda_platform

    from vllm.platforms.interface import DeviceCapability
    from vllm.utils import import_utils

    cuda = import_cuda_platform()
    monkeypatch.setattr(cuda.CudaPlatform, "get_device_capability",
                        classmethod(lambda cls, device_id=0: DeviceCapability(*capability)))
    monkeypatch.setattr(il, "current_platform", cuda.CudaPlatform())
    monkeypatch.setattr(import_utils, "has_deep_gemm", lambda: deep_gemm_installed)
    monkeypatch.delenv(il.LOGITS_BACKEND_ENV, raising=False)
    il.indexer_logits_backend.cache_clear()
    try:
        native = deep_gemm_installed and capability in DEEPGEMM_CAPABILITIES
        assert il.indexer_logits_backend() == ("deepgemm" if native else "triton")
        # the same rule as upstream's DeepGEMM wrappers, less VLLM_USE_DEEP_GEMM
        assert native == (deep_gemm_installed and cuda.CudaPlatform.support_deep_gemm())
    finally:
        il.indexer_logits_backend.cache_clear()


# --------------------------------------------------------------------------------------
# GPU: GLM-5 indexer shapes against DeepGEMM
# --------------------------------------------------------------------------------------
def _deep_gemm_or_skip():
    from vllm.platforms import current_platform
    from vllm.utils import deep_gemm

    if not (deep_gemm.has_deep_gemm() and current_platform.support_deep_gemm()):
        pytest.skip("DeepGEMM's MQA logits need SM90, SM100 or SM120")
    return deep_gemm


def _glm5_weights(rows, g):
    # The model folds the per-token q scale and 1/sqrt(H*D) into the weights.
    return (torch.randn(rows, 32, generator=g) * 0.1).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("M,N", [(512, 1024), (1024, 4096), (256, 16384), (128, 65536)])
def test_prefill_matches_deepgemm(M, N):
    dg = _deep_gemm_or_skip()
    g = torch.Generator().manual_seed(2)
    q = random_fp8(M, 32, 128, g=g).cuda()
    k = random_fp8(N, 128, g=g).cuda()
    k_scale = (torch.rand(N, generator=g) * 0.02 + 0.01).cuda()
    w = _glm5_weights(M, g)
    # Causal rows of one request whose last M tokens are the queries.
    ke = torch.arange(N - M + 1, N + 1, dtype=torch.int32).cuda()
    ks = torch.zeros(M, dtype=torch.int32).cuda()
    ours = il.triton_mqa_logits(q, k, k_scale, w, ks, ke)
    theirs = dg.fp8_fp4_mqa_logits((q, None), (k, k_scale), w, ks, ke, clean_logits=True)
    topk = min(2048, N - M + 1)
    worst = 1.0
    for m in range(0, M, max(1, M // 16)):
        n = int(ke[m])
        torch.testing.assert_close(ours[m, :n], theirs[m, :n], rtol=2e-3, atol=2e-3)
        worst = min(worst, recall(ours[m, :n], theirs[m, :n].double(), min(topk, n)))
    assert worst >= 0.999


@pytest.mark.gpu
@pytest.mark.parametrize("next_n", [1, 2])
@pytest.mark.parametrize("ctx", [1024, 8192, 65536])
@pytest.mark.parametrize("batch", [1, 8])
def test_decode_matches_deepgemm(next_n, ctx, batch):
    dg = _deep_gemm_or_skip()
    g = torch.Generator().manual_seed(3)
    BS, D = 64, 128
    max_model_len = 65536 + 128
    lens = [max(next_n, ctx - 37 * i) for i in range(batch)]
    nb_per = [math.ceil(n / BS) for n in lens]
    NB = sum(nb_per) + 4
    cache = torch.zeros(NB, BS * (D + 4), dtype=torch.uint8)
    perm = torch.randperm(NB, generator=g)
    table = torch.zeros(batch, math.ceil(max_model_len / BS), dtype=torch.int32)
    used = 0
    for b, n in enumerate(nb_per):
        table[b, :n] = perm[used:used + n]
        used += n
    vals = random_fp8(NB, BS * D, g=g)
    cache[:, :BS * D] = vals.view(torch.uint8)
    cache[:, BS * D:] = (torch.rand(NB, BS, generator=g) * 0.02 + 0.01).view(torch.uint8)
    cache = cache.view(NB, BS, D + 4).cuda()
    table = table.cuda()
    q = random_fp8(batch, next_n, 32, D, g=g).cuda()
    w = _glm5_weights(batch * next_n, g)
    seq = torch.tensor([[n - next_n + j + 1 for j in range(next_n)] for n in lens],
                       dtype=torch.int32).cuda()
    ours = il.triton_paged_mqa_logits(q, cache, w, seq, table, max_model_len)
    meta = dg.get_paged_mqa_logits_metadata(seq, BS, torch.cuda.get_device_properties(0)
                                            .multi_processor_count)
    # clean_logits=False as vLLM calls it (DeepGEMM's cleaning refuses 2D context lens)
    theirs = dg.fp8_fp4_paged_mqa_logits((q, None), cache.unsqueeze(-2), w, seq, table, meta,
                                         max_model_len=max_model_len, clean_logits=False)
    for r in range(batch * next_n):
        n = int(seq.view(-1)[r])
        torch.testing.assert_close(ours[r, :n], theirs[r, :n], rtol=2e-3, atol=2e-3)
        assert recall(ours[r, :n], theirs[r, :n].double(), min(2048, n)) >= 0.999


@pytest.mark.gpu
def test_fp16_dot_path_matches_fp8_dot_path():
    # The fp16-dot path (used where fp8 dots are missing) computes the same sums, up
    # to the fp8 tensor cores' reduced-precision accumulation (~4e-4 relative here).
    g = torch.Generator().manual_seed(4)
    q = random_fp8(64, 32, 128, g=g).cuda()
    k = random_fp8(3000, 128, g=g).cuda()
    k_scale = (torch.rand(3000, generator=g) + 0.5).cuda()
    w = _glm5_weights(64, g)
    ks = torch.zeros(64, dtype=torch.int32).cuda()
    ke = torch.full((64,), 3000, dtype=torch.int32).cuda()
    a = il.triton_mqa_logits(q, k, k_scale, w, ks, ke, upcast=True)
    b = il.triton_mqa_logits(q, k, k_scale, w, ks, ke, upcast=False)
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-2)


def test_refused_below_sm89(monkeypatch):
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    monkeypatch.setattr(type(current_platform), "get_device_capability",
                        classmethod(lambda cls, device_id=0: DeviceCapability(8, 6)))
    with pytest.raises(RuntimeError, match="needs compute capability 8.9"):
        il.check_triton_indexer_supported()
    monkeypatch.setattr(type(current_platform), "get_device_capability",
                        classmethod(lambda cls, device_id=0: DeviceCapability(12, 0)))
    il.check_triton_indexer_supported()


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    # Both kernels launch with shapes only (no host sync): capture, then replay on
    # new queries, keys, lengths and tables in the same buffers equals eager runs.
    g = torch.Generator().manual_seed(5)
    B, BS, D, NB, L = 4, 64, 128, 64, 2048
    cache = torch.randint(0, 100, (NB, BS, D + 4), dtype=torch.uint8, generator=g).cuda()
    cache.view(NB, -1)[:, BS * D:].view(torch.float32).uniform_(0.01, 0.02)
    table = torch.randperm(NB, generator=g)[:B * 8].view(B, 8).to(torch.int32).cuda()
    q = random_fp8(B, 1, 32, D, g=g).cuda()
    w = _glm5_weights(B, g)
    seq = torch.tensor([[500], [64], [1], [511]], dtype=torch.int32).cuda()

    def run():
        return il.triton_paged_mqa_logits(q, cache, w, seq, table, L)

    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    q.copy_(random_fp8(B, 1, 32, D, g=g).cuda())
    seq.copy_(torch.tensor([[300], [512], [65], [2]], dtype=torch.int32))
    table.copy_(torch.randperm(NB, generator=g)[:B * 8].view(B, 8).to(torch.int32))
    graph.replay()
    eager = run()
    for r, n in enumerate(seq.view(-1).tolist()):
        torch.testing.assert_close(out[r, :n], eager[r, :n], rtol=0, atol=0)


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_topk_order_under_batch_invariance(batch_invariant, monkeypatch):
    """The top-k kernels write indices in atomic order; under VLLM_BATCH_INVARIANT
    the indexer puts each row in one fixed order (descending, -1 padding last), so
    two runs that selected the same set feed sparse attention the same slots."""
    import vllm.envs as envs
    from vllm.model_executor.layers.sparse_attn_indexer import sort_topk_if_batch_invariant

    monkeypatch.setattr(envs, "VLLM_BATCH_INVARIANT", batch_invariant)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n_valid in (128, 70, 1):  # full row, short row with padding, one slot
        valid = torch.randperm(1000, generator=gen)[:n_valid].to(torch.int32)
        rows.append(torch.cat([valid, torch.full((128 - n_valid,), -1, dtype=torch.int32)]))
    a = torch.stack(rows)
    # the same sets in other orders, as another run's top-k kernel may write them
    b = torch.stack([r[torch.cat([torch.randperm(int((r >= 0).sum()), generator=gen),
                                  torch.arange(int((r >= 0).sum()), 128)])] for r in rows])
    before_a, before_b = a.clone(), b.clone()
    sort_topk_if_batch_invariant(a)
    sort_topk_if_batch_invariant(b)
    if not batch_invariant:
        assert torch.equal(a, before_a) and torch.equal(b, before_b)
        return
    assert torch.equal(a, b)
    for row, orig in zip(a, before_a):
        n = int((orig >= 0).sum())
        assert torch.equal(row[:n], torch.sort(orig[:n], descending=True).values)
        assert (row[n:] == -1).all()
