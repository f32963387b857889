# SPDX-License-Identifier: Apache-2.0
"""Portable sparse-indexer logits against a float64 reference of the formula
logits[t, s] = scale_k[s] * sum_h w[t, h] * relu(q[t, h] . k[s]) (from the
dequantized fp8 inputs), both dot paths (fp8 dots, and 16-bit dots on the e4m3
bytes converted in registers: SM80/86) against each other, the e4m3 conversions
of the 16-bit path bit for bit, and on the GPU against DeepGEMM on the same inputs.
The 16-bit key cache (VLLM_SPARSE_INDEXER_CACHE=16bit): its logits on 16-bit q and
k against the same reference, its cache write and gather against torch indexing.

Without a GPU the kernels run in Triton's interpreter: both paths, the 16-bit
one with its integer-operation conversion (on a GPU also its inline PTX)."""

import math

import pytest
import torch

from vllm.v1.attention.ops import triton_indexer_logits as il

FP8 = torch.float8_e4m3fn
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
DOTS = pytest.mark.parametrize("upcast", [True, False], ids=["16bit-dot", "fp8-dot"])


def reference_logits(q, k, k_scale, w):
    """q [M,H,D] fp8, k [N,D] fp8, k_scale [N], w [M,H] -> float64 [M,N]."""
    s = torch.einsum("mhd,nd->mhn", q.double().cpu(), k.double().cpu())
    return (s.relu() * w.double().cpu()[:, :, None]).sum(1) * k_scale.double().cpu()[None]


def random_fp8(*shape, g, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).clamp(-448, 448).to(FP8)


def wide_fp8(*shape, g):
    """fp8 values over e4m3's whole range, subnormals (below 2^-6) to 448."""
    mag = torch.exp2(torch.rand(*shape, generator=g) * 18.8 - 10)
    sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
    return (sign * mag).clamp(-448, 448).to(FP8)


def all_e4m3() -> torch.Tensor:
    """Every finite e4m3fn value, as fp8 (254 patterns: all but the two NaNs)."""
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return b[(b & 0x7F) != 0x7F].view(FP8)


def recall(ours, ref, k):
    """Share of our top-k positions whose reference logit reaches the k-th best
    reference logit (ties count as hits)."""
    top = torch.topk(ours, k).indices
    kth = torch.topk(ref, k).values[-1]
    return (ref[top] >= kth - 1e-5 * kth.abs().clamp(min=1)).double().mean().item()


def prefill_bounds(M, N, g):
    """Random per-row key bounds [ks, ke) of M query rows over N keys."""
    ks = torch.randint(0, 60, (M,), generator=g, dtype=torch.int32)
    ke = torch.minimum(ks + torch.randint(1, 120, (M,), generator=g, dtype=torch.int32),
                       torch.tensor(N, dtype=torch.int32))
    return ks, ke


def assert_prefill_rows(out, ref, ks, ke, **tol):
    """Each row against the reference over [ks, ke), and -inf elsewhere within the
    128-wide key tiles that overlap the union of the rows' ranges (one program row
    covers them all: it computes those tiles only)."""
    N = out.shape[1]
    first, last = int(ks.min()) // 128 * 128, min(N, -(-int(ke.max()) // 128) * 128)
    for m in range(out.shape[0]):
        lo, hi = int(ks[m]), int(ke[m])
        torch.testing.assert_close(out[m, lo:hi].double(), ref[m, lo:hi], **tol)
        assert torch.isneginf(torch.cat([out[m, first:lo], out[m, hi:last]])).all()


def mtp_seq_lens(ctx, next_n):
    """[B, next_n]: token j of next_n sees ctx - next_n + j + 1 keys (causal MTP rows)."""
    return torch.tensor([[c - next_n + j + 1 for j in range(next_n)] for c in ctx],
                        dtype=torch.int32)


def assert_decode_rows(out, q, w, keys, seq_lens, BS, **tol):
    """Each decode row against the reference over its valid keys (`keys`: a request's
    keys and their scales), and -inf to the end of its last block."""
    next_n = seq_lens.shape[1]
    for b, (k, sc) in enumerate(keys):
        for j in range(next_n):
            r, n = b * next_n + j, int(seq_lens[b, j])
            ref = reference_logits(q[b, j:j + 1], k[:n], sc[:n], w[r:r + 1])[0]
            torch.testing.assert_close(out[r, :n].double(), ref, **tol)
            assert torch.isneginf(out[r, n:math.ceil(n / BS) * BS]).all()


# --------------------------------------------------------------------------------------
# CPU (Triton interpreter) and GPU
# --------------------------------------------------------------------------------------
@DOTS
def test_prefill_logits(upcast):
    g = torch.Generator().manual_seed(0)
    M, H, D, N = 7, 4, 32, 150
    q, k = random_fp8(M, H, D, g=g), random_fp8(N, D, g=g)
    k_scale = torch.rand(N, generator=g) + 0.5
    w = torch.randn(M, H, generator=g)
    ks, ke = prefill_bounds(M, N, g)
    ke[3] = ks[3]  # an empty row
    to = dict(device=DEVICE)
    out = il.triton_mqa_logits(q.to(**to), k.to(**to), k_scale.to(**to), w.to(**to),
                               ks.to(**to), ke.to(**to), upcast=upcast).cpu()
    assert_prefill_rows(out, reference_logits(q, k, k_scale, w), ks, ke, rtol=1e-4, atol=1e-3)


def place_in_blocks(lengths, BS, NB, max_model_len, g):
    """Random blocks of BS tokens for requests of `lengths` tokens: their block table
    and, for each block, (request, its first position, the block)."""
    table = torch.zeros(len(lengths), math.ceil(max_model_len / BS), dtype=torch.int32)
    free = torch.randperm(NB, generator=g).tolist()
    places = []
    for b, n in enumerate(lengths):
        for first in range(0, n, BS):
            places.append((b, first, free.pop()))
            table[b, first // BS] = places[-1][2]
    return table, places


def paged_cache(keys, BS, NB, max_model_len, g):
    """The indexer's paged K cache (uint8 [NB, BS, D + 4]: per block BS x D fp8
    values, then BS fp32 scales) holding `keys` [(k fp8 [n, D], scale [n])] of the
    requests in random blocks, and their block table."""
    D = keys[0][0].shape[1]
    cache = torch.zeros(NB, BS, D + 4, dtype=torch.uint8)
    flat = cache.view(NB, -1)
    table, places = place_in_blocks([k.shape[0] for k, _ in keys], BS, NB, max_model_len, g)
    for b, first, blk in places:
        k, sc = keys[b]
        rows = k[first:first + BS]
        flat[blk, :rows.shape[0] * D] = rows.reshape(-1).view(torch.uint8)
        flat[blk, BS * D:BS * D + 4 * rows.shape[0]] = sc[first:first + BS].view(torch.uint8)
    return cache, table


@pytest.mark.parametrize("next_n", [1, 2])
@DOTS
def test_paged_decode_logits(next_n, upcast):
    g = torch.Generator().manual_seed(1)
    B, H, D, BS, NB = 3, 4, 32, 16, 40
    ctx = [37, 16, 90]
    max_model_len = 112
    q = random_fp8(B, next_n, H, D, g=g)
    w = torch.randn(B * next_n, H, generator=g)
    keys = [(random_fp8(n, D, g=g), torch.rand(n, generator=g) + 0.5) for n in ctx]
    cache, table = paged_cache(keys, BS, NB, max_model_len, g)
    seq_lens = mtp_seq_lens(ctx, next_n)
    to = dict(device=DEVICE)
    out = il.triton_paged_mqa_logits(q.to(**to), cache.to(**to), w.to(**to), seq_lens.to(**to),
                                     table.to(**to), max_model_len, upcast=upcast).cpu()
    assert out.shape == (B * next_n, max_model_len)
    assert_decode_rows(out, q, w, keys, seq_lens, BS, rtol=1e-4, atol=1e-3)


# the interpreter computes both paths' dots in fp32 from exact operands; fp8 tensor
# cores accumulate with less precision (~4e-4 relative measured on the H200); atol is
# relative to the largest reference logit of the row
GLM5_TOL = dict(rtol=1e-3, atol=1e-3) if ON_GPU else dict(rtol=1e-5, atol=1e-5)


def glm5_prefill_inputs(M, N, g):
    """GLM-5's indexer (32 heads x 128) on one request's last M tokens over N keys
    (causal rows), fp8 values over e4m3's whole range."""
    q, k = wide_fp8(M, 32, 128, g=g), wide_fp8(N, 128, g=g)
    k_scale = torch.rand(N, generator=g) * 0.02 + 0.01
    w = torch.randn(M, 32, generator=g) * 0.1
    ke = torch.arange(N - M + 1, N + 1, dtype=torch.int32)
    ks = torch.zeros(M, dtype=torch.int32)
    return q, k, k_scale, w, ks, ke


def test_16bit_dots_match_fp8_dots_prefill():
    """The 16-bit-dot path against the fp8-dot path on the same inputs (GLM-5's
    shapes and top-k 2048), and both against the float64 reference."""
    g = torch.Generator().manual_seed(6)
    M, N = 16, 4096
    inputs = glm5_prefill_inputs(M, N, g)
    q, k, k_scale, w, ks, ke = (x.to(DEVICE) for x in inputs)
    b16 = il.triton_mqa_logits(q, k, k_scale, w, ks, ke, upcast=True).cpu()
    fp8 = il.triton_mqa_logits(q, k, k_scale, w, ks, ke, upcast=False).cpu()
    ref = reference_logits(*inputs[:4])
    scale = ref.abs().max().item()
    for m in range(M):
        n = int(ke[m])
        torch.testing.assert_close(b16[m, :n], fp8[m, :n], rtol=GLM5_TOL["rtol"],
                                   atol=GLM5_TOL["atol"] * scale)
        torch.testing.assert_close(b16[m, :n].double(), ref[m, :n], rtol=1e-5,
                                   atol=1e-5 * scale)
        assert recall(b16[m, :n], fp8[m, :n].double(), 2048) >= 0.999
        assert recall(b16[m, :n], ref[m, :n], 2048) >= 0.999


@pytest.mark.parametrize("next_n", [1, 2])
def test_16bit_dots_match_fp8_dots_decode(next_n):
    g = torch.Generator().manual_seed(7)
    BS, D, ctx = 64, 128, [4000, 2500]
    max_model_len = 4096 + BS
    keys = [(wide_fp8(n, D, g=g), torch.rand(n, generator=g) * 0.02 + 0.01) for n in ctx]
    cache, table = paged_cache(keys, BS, sum(math.ceil(n / BS) for n in ctx) + 3,
                               max_model_len, g)
    q = wide_fp8(len(ctx), next_n, 32, D, g=g)
    w = torch.randn(len(ctx) * next_n, 32, generator=g) * 0.1
    seq = mtp_seq_lens(ctx, next_n)
    args = [x.to(DEVICE) for x in (q, cache, w, seq, table)]
    b16 = il.triton_paged_mqa_logits(*args, max_model_len, upcast=True).cpu()
    fp8 = il.triton_paged_mqa_logits(*args, max_model_len, upcast=False).cpu()
    for b, (k, sc) in enumerate(keys):
        for j in range(next_n):
            r, n = b * next_n + j, int(seq[b, j])
            ref = reference_logits(q[b, j:j + 1], k[:n], sc[:n], w[r:r + 1])[0]
            scale = ref.abs().max().item()
            torch.testing.assert_close(b16[r, :n], fp8[r, :n], rtol=GLM5_TOL["rtol"],
                                       atol=GLM5_TOL["atol"] * scale)
            torch.testing.assert_close(b16[r, :n].double(), ref, rtol=1e-5, atol=1e-5 * scale)
            assert recall(b16[r, :n], fp8[r, :n].double(), 2048) >= 0.999
            assert recall(b16[r, :n], ref, 2048) >= 0.999
            assert torch.isneginf(b16[r, n:math.ceil(n / BS) * BS]).all()


@pytest.mark.gpu
def test_16bit_dot_path_matches_fp8_dot_path():
    # The 16-bit-dot path (used where fp8 dots are missing) computes the same sums, up
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


@pytest.fixture(scope="module")
def conversion_kernels():
    from vllm.triton_utils import tl, triton

    @triton.jit
    def bytes_to_f16(X, Y, N: tl.constexpr, ASM: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Y + offs, il.e4m3_bytes_to_f16(tl.load(X + offs), ASM))

    @triton.jit
    def f32_to_e4m3(X, Y, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Y + offs, il.f32_to_e4m3(tl.load(X + offs), Y.dtype.element_ty))

    return bytes_to_f16, f32_to_e4m3


@pytest.mark.parametrize("asm", [False, pytest.param(True, marks=pytest.mark.gpu)],
                         ids=["integer-ops", "inline-ptx"])
def test_e4m3_bytes_to_f16_is_exact(conversion_kernels, asm):
    """Every finite e4m3 value, read as bytes, comes out as that value times 2^-8."""
    values = all_e4m3()
    x = values.view(torch.uint8).to(DEVICE)
    n = 256
    x = torch.nn.functional.pad(x, (0, n - x.numel()))
    y = torch.empty(n, dtype=torch.float16, device=DEVICE)
    conversion_kernels[0][(1,)](x, y, N=n, ASM=asm)
    got = y[:values.numel()].cpu().double() * 256
    assert torch.equal(got, values.double())
    # the sign of zero too
    assert torch.equal(torch.signbit(got), torch.signbit(values.float()))


def e4m3_rounding_cases() -> torch.Tensor:
    """fp32 values within +-448: every e4m3 value, every midpoint between neighbours
    (ties, to even) and the fp32 values just beside each midpoint, values far below
    the smallest subnormal, and random magnitudes over the whole range."""
    values = all_e4m3().float()
    pos = torch.sort(values[values >= 0]).values
    mids = (pos[1:] + pos[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, torch.tensor(1e9)),
                      torch.nextafter(mids, torch.tensor(-1e9))])
    g = torch.Generator().manual_seed(8)
    rand = torch.exp2(torch.rand(4096, generator=g) * 30 - 21)
    x = torch.cat([values, near, -near, rand, -rand,
                   torch.tensor([2.0**-10, 2.0**-11, 1e-30, 447.99, 2.0**-6 * (1 - 2**-20)])])
    return x[x.abs() <= 448]


@pytest.mark.parametrize("dtype", [torch.uint8, pytest.param(FP8, marks=pytest.mark.gpu)],
                         ids=["bytes", "fp8e4nv"])
def test_f32_to_e4m3_rounds_to_nearest_even(conversion_kernels, dtype):
    """The bytes the q quantization writes where Triton has no e4m3 type equal
    PyTorch's conversion (round to nearest, ties to even); on a GPU with e4m3,
    so does Triton's own conversion there."""
    if dtype == FP8 and torch.cuda.get_device_capability() < (9, 0):
        # (SM89: no e4m3 type below; on SM89 Triton converts f32 -> f16 -> e4m3)
        pytest.skip("Triton converts f32 to e4m3 in one rounding from SM90 on")
    x = e4m3_rounding_cases()
    n = triton_next_pow2(x.numel())
    x = torch.nn.functional.pad(x, (0, n - x.numel()))
    y = torch.empty(n, dtype=dtype, device=DEVICE)
    conversion_kernels[1][(1,)](x.to(DEVICE), y, N=n)
    got, want = y.cpu().view(torch.uint8), x.to(FP8).view(torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, list(zip(x[bad][:8].tolist(), got[bad][:8].tolist(),
                                      want[bad][:8].tolist()))


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def rope_quant_reference(q, positions, cos_sin, weights, is_neox):
    """What `fused_indexer_q_rope_quant` computes, in float64: rope on the first 64
    dims, one e8m0 scale per token and head, the scale folded into the weights."""
    q = q.double()
    cos, sin = cos_sin[positions, :32].double()[:, None], cos_sin[positions, 32:].double()[:, None]
    x0, x1 = (q[..., :32], q[..., 32:64]) if is_neox else (q[..., 0:64:2], q[..., 1:64:2])
    r0, r1 = x0 * cos - x1 * sin, x1 * cos + x0 * sin
    rot = torch.cat([r0, r1], -1) if is_neox else torch.stack([r0, r1], -1).flatten(-2)
    out = torch.cat([rot, q[..., 64:]], -1)
    scale = torch.exp2(torch.ceil(torch.log2(out.abs().amax(-1).clamp(min=1e-10) / 448)))
    return out, scale


@pytest.mark.parametrize("is_neox", [True, False])
def test_q_rope_quant_as_bytes(monkeypatch, is_neox):
    """The indexer's fused q rope + fp8 quantization (upstream's Triton kernel) with
    its e4m3 stores as bytes, as on SM80/86: a float64 reference on CPU, and on a
    GPU with e4m3 the same bytes as its fp8 stores."""
    from vllm.model_executor.layers import sparse_attn_indexer as sai

    g = torch.Generator().manual_seed(9)
    T, H = 5, 32
    q = (torch.randn(T, H, 128, generator=g) * torch.exp2(torch.randint(-8, 8, (T, H, 1),
                                                                         generator=g))).bfloat16()
    positions = torch.randint(0, 64, (T,), generator=g)
    angle = torch.rand(64, 32, generator=g) * 6.3
    cos_sin = torch.cat([angle.cos(), angle.sin()], -1)
    weights = torch.randn(T, H, generator=g).bfloat16()
    softmax_scale, head_scale = 128**-0.5, H**-0.5
    args = [x.to(DEVICE) for x in (positions, q, cos_sin, weights)]
    if ON_GPU:  # as on an RTX 3090 (SM86): 16-bit dots
        _report_capability(monkeypatch, (8, 6))
        q8, w_out = sai.fused_indexer_q_rope_quant(args[0], args[1], args[2], args[3],
                                                   softmax_scale, head_scale, is_neox)
    else:  # the wrapper asserts a CUDA platform: launch the kernel as it does
        q8 = torch.empty(T, H, 128, dtype=FP8)
        w_out = torch.empty(T, H)
        sai._fused_indexer_q_rope_quant_kernel[(T, H)](
            args[0], args[1], q.stride(0), q.stride(1), args[2], cos_sin.stride(0),
            q8.view(torch.uint8), q8.stride(0), q8.stride(1), args[3], weights.stride(0),
            weights.stride(1), w_out, w_out.stride(0), w_out.stride(1), softmax_scale,
            head_scale, fp8_min=-448.0, fp8_max=448.0, is_neox=is_neox, num_warps=1)
    q8, w_out = q8.cpu(), w_out.cpu()
    ref, ref_scale = rope_quant_reference(q, positions, cos_sin, weights, is_neox)
    # the q scale (a power of two) is folded into the weights (in fp32)
    folded = weights.double() * softmax_scale * head_scale
    q_scale = torch.exp2(torch.round(torch.log2(w_out.double() / folded)))
    torch.testing.assert_close(w_out.double(), folded * q_scale, rtol=1e-6, atol=0)
    # (the kernel rounds the rotated values to bf16 first, which may move the amax
    # across a power of two)
    assert torch.isin(q_scale / ref_scale, torch.tensor([0.5, 1.0, 2.0],
                                                        dtype=torch.float64)).all()
    deq = q8.double() * q_scale[..., None]
    # e4m3 keeps 3 mantissa bits (half a unit: 2^-4 relative), bf16 rounding 2^-9
    tol = ref.abs() * (2**-4 + 2**-8) + q_scale[..., None] * 2**-10
    assert ((deq - ref).abs() <= tol).all()
    if ON_GPU and torch.cuda.get_device_capability() >= (8, 9):
        _report_capability(monkeypatch, (9, 0))  # fp8 dots
        fp8, w_fp8 = sai.fused_indexer_q_rope_quant(args[0], args[1], args[2], args[3],
                                                    softmax_scale, head_scale, is_neox)
        assert torch.equal(fp8.cpu().view(torch.uint8), q8.view(torch.uint8))
        assert torch.equal(w_fp8.cpu(), w_out)


def test_pack_decode_queries_as_bytes():
    """Short prefills in the decode group are padded (pack_seq_triton); where the
    indexer takes e4m3 as bytes its q is packed as bytes, with zeros as padding."""
    from vllm.v1.attention.ops.common import pack_seq_triton

    g = torch.Generator().manual_seed(10)
    lens = torch.tensor([2, 1, 2], dtype=torch.int32)
    q = random_fp8(int(lens.sum()), 32, 128, g=g)
    packed = pack_seq_triton(q.view(torch.uint8).to(DEVICE), lens.to(DEVICE),
                             pad_value=0).view(FP8).cpu()
    assert packed.shape == (3, 2, 32, 128)
    starts = [0, 2, 3]
    for b, (start, n) in enumerate(zip(starts, lens.tolist())):
        assert torch.equal(packed[b, :n].view(torch.uint8), q[start:start + n].view(torch.uint8))
        assert (packed[b, n:].view(torch.uint8) == 0).all()


def _report_capability(monkeypatch, capability):
    from tests.cuda_platform import import_cuda_platform
    from vllm.platforms.interface import DeviceCapability

    cuda = import_cuda_platform()
    monkeypatch.setattr(cuda.CudaPlatform, "get_device_capability",
                        classmethod(lambda cls, device_id=0: DeviceCapability(*capability)))
    monkeypatch.setattr(il, "current_platform", cuda.CudaPlatform())


@pytest.mark.parametrize("capability,dots", [
    ((8, 0), "16bit"), ((8, 6), "16bit"), ((8, 7), "16bit"),
    ((8, 9), "fp8"), ((9, 0), "fp8"), ((12, 0), "fp8"),
])
def test_dots_choice(monkeypatch, capability, dots):
    """16-bit dots where the GPU has no fp8 dots, fp8 elsewhere: by the capability alone
    (no setting: tests emulate a GPU by reporting its capability). The q quantization's
    stores follow (bytes with 16-bit dots)."""
    _report_capability(monkeypatch, capability)
    assert il.triton_indexer_dots() == dots
    assert il.e4m3_as_bytes() == (dots == "16bit")
    il.check_triton_indexer_supported()


def test_dots_choice_opens_nvml_once(monkeypatch):
    """The dots (and e4m3 as bytes) are asked per indexer layer and step (the Triton
    logits, the decode queries' padding, the eager q quantization), and so is
    `has_device_capability` (the sparse indexer's top-k choice): vLLM 0.26.0's NVML
    platform caches the capability but opened and shut NVML at every
    `has_device_capability` call; the overlay's does not. A counting NVML: one init for
    the first query, none after, for the choice and for `has_device_capability`."""
    from types import SimpleNamespace

    from tests.cuda_platform import import_cuda_platform

    cuda = import_cuda_platform()
    inits = []
    fake_nvml = SimpleNamespace(
        nvmlInit=lambda: inits.append(1),
        nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetCudaComputeCapability=lambda handle: (8, 6),
    )
    monkeypatch.setattr(cuda, "pynvml", fake_nvml)
    monkeypatch.setattr(cuda.NvmlCudaPlatform, "visible_device_id_to_physical_device_id",
                        classmethod(lambda cls, device_id: device_id), raising=False)
    platform = cuda.NvmlCudaPlatform()
    monkeypatch.setattr(il, "current_platform", platform)
    cuda.NvmlCudaPlatform.get_device_capability.cache_clear()
    try:
        for _ in range(100):
            assert il.triton_indexer_dots() == "16bit"
            assert il.e4m3_as_bytes()
        assert len(inits) == 1  # the capability's first, cached read
        # its own first read (the cache keys `device_id=0` apart from the default)
        assert not platform.has_device_capability(89)
        opened = len(inits)
        for _ in range(100):
            assert not platform.has_device_capability(89)
            assert platform.has_device_capability(86) and platform.has_device_capability((8, 0))
        assert len(inits) == opened <= 2
    finally:
        cuda.NvmlCudaPlatform.get_device_capability.cache_clear()


def test_e4m3_as_bytes_is_a_constant_to_torch_compile(monkeypatch):
    """The q quantization asks `e4m3_as_bytes` inside the compiled model, where the
    capability query (NVML) cannot be traced: torch.compile takes its result as a
    constant, and the whole graph compiles."""
    import ctypes

    from tests.cuda_platform import import_cuda_platform
    from vllm.platforms.interface import DeviceCapability

    cuda = import_cuda_platform()
    queried = []

    def untraceable(cls, device_id=0):
        queried.append(ctypes.CDLL(None).getpid())  # a foreign call Dynamo skips
        return DeviceCapability(8, 0)

    monkeypatch.setattr(cuda.NonNvmlCudaPlatform, "get_device_capability",
                        classmethod(untraceable))
    monkeypatch.setattr(il, "current_platform", cuda.NonNvmlCudaPlatform())

    def quantize(q):
        out = torch.empty_like(q, dtype=torch.uint8 if il.e4m3_as_bytes() else FP8)
        return out.view(FP8), q + 1

    with pytest.raises(torch._dynamo.exc.Unsupported):
        # (what a plain call of the query does under fullgraph)
        torch.compile(lambda q: (q + 1, il.triton_indexer_dots()), fullgraph=True,
                      backend="eager")(torch.ones(4))
    torch._dynamo.reset()
    out, _ = torch.compile(quantize, fullgraph=True, backend="eager")(torch.ones(4))
    assert out.dtype == FP8 and queried
    torch._dynamo.reset()


def test_cache_switch_keys_the_compile_cache(monkeypatch):
    """vLLM keys its torch.compile cache on the environment variables it knows: with the
    key cache's switch in the key, a graph traced with unquantized (16-bit) queries is not
    loaded where q is quantized to fp8. The dots and the logits backend follow the GPU
    (its name is in Inductor's part of the key): no variables of their own, registered or
    read, that a user could set."""
    from vllm import envs
    from vllm.config.utils import hash_factors

    keys = set()
    for value in ("fp8", "16bit"):
        monkeypatch.setenv(il.CACHE_ENV, value)
        factors = envs.compile_factors()
        assert factors[il.CACHE_ENV] == value
        keys.add(hash_factors(factors))
    assert len(keys) == 2
    sparse = {name for name in envs.environment_variables
              if name.startswith("VLLM_SPARSE_INDEXER_")}
    assert sparse == {il.CACHE_ENV, "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB"}


@pytest.mark.parametrize("capability", [(7, 5), (8, 0), (8, 6), (8, 9), (12, 0)])
def test_supported_from_sm80(monkeypatch, capability):
    """The Triton kernels need 16-bit tensor-core dots: SM80 and newer run them."""
    _report_capability(monkeypatch, capability)
    if capability < (8, 0):
        with pytest.raises(RuntimeError, match="needs compute capability 8.0"):
            il.check_triton_indexer_supported()
    else:
        il.check_triton_indexer_supported()


def test_wrappers_follow_the_dots_choice(monkeypatch):
    """With upcast unset, the launch wrappers take the dots of the GPU's capability."""
    seen = []

    class Launch:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append((kw["UPCAST"], a[0].dtype))

    monkeypatch.setattr(il, "_mqa_logits_kernel", Launch())
    monkeypatch.setattr(il, "_paged_mqa_logits_kernel", Launch())
    q, k = torch.zeros(2, 4, 16, dtype=FP8), torch.zeros(8, 16, dtype=FP8)
    cache = torch.zeros(2, 4, 20, dtype=torch.uint8)
    for capability, upcast in (((8, 6), True), ((9, 0), False)):
        _report_capability(monkeypatch, capability)
        il.triton_mqa_logits(q, k, torch.ones(8), torch.ones(2, 4),
                             torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32))
        il.triton_paged_mqa_logits(q[:, None], cache, torch.ones(2, 4),
                                   torch.ones(2, 1, dtype=torch.int32),
                                   torch.zeros(2, 2, dtype=torch.int32), 8)
        dtype = torch.uint8 if upcast else FP8
        assert seen == [(upcast, dtype), (upcast, dtype)]
        seen.clear()


# Where vLLM 0.26 runs DeepGEMM's indexer kernels: `support_deep_gemm` is SM90,
# the SM100 family and (new in 0.26) the SM120 family, whose FP8 MQA logits
# kernels (sm120_fp8_mqa_logits / sm120_fp8_paged_mqa_logits) the DeepGEMM it
# vendors ships. Everywhere else the Triton kernels compute the logits.
DEEPGEMM_CAPABILITIES = {(9, 0), (10, 0), (10, 3), (12, 0), (12, 1)}


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3),
                                        (11, 0), (12, 0), (12, 1)])
@pytest.mark.parametrize("deep_gemm_installed", [True, False])
def test_auto_backend_follows_vllm_support(monkeypatch, capability, deep_gemm_installed):
    from tests.cuda_platform import import_cuda_platform
    from vllm.platforms.interface import DeviceCapability
    from vllm.utils import import_utils

    cuda = import_cuda_platform()
    monkeypatch.setattr(cuda.CudaPlatform, "get_device_capability",
                        classmethod(lambda cls, device_id=0: DeviceCapability(*capability)))
    monkeypatch.setattr(il, "current_platform", cuda.CudaPlatform())
    monkeypatch.setattr(import_utils, "has_deep_gemm", lambda: deep_gemm_installed)
    il.indexer_logits_backend.cache_clear()
    try:
        native = deep_gemm_installed and capability in DEEPGEMM_CAPABILITIES
        assert il.indexer_logits_backend() == ("deepgemm" if native else "triton")
        # the same rule as upstream's DeepGEMM wrappers, less VLLM_USE_DEEP_GEMM
        assert native == (deep_gemm_installed and cuda.CudaPlatform.support_deep_gemm())
    finally:
        il.indexer_logits_backend.cache_clear()


# --------------------------------------------------------------------------------------
# The 16-bit key cache (CPU: Triton interpreter, and GPU)
# --------------------------------------------------------------------------------------
KEYS16 = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16],
                                 ids=["bf16", "fp16"])
# Triton 3.6's interpreter multiplies bfloat16 operands of tl.dot as their raw bit
# patterns (a 16 x 16 product comes out ~1e10): the bf16 logits run on the GPU only.
# 16-bit operands exact in the float64 reference: the interpreter's fp32 sums; a GPU's
# tensor cores
KEYS16_TOL = dict(rtol=2e-3, atol=2e-3) if ON_GPU else dict(rtol=1e-5, atol=1e-4)
KEYS16_DOT = pytest.mark.parametrize(
    "dtype", [pytest.param(torch.bfloat16, marks=pytest.mark.gpu), torch.float16],
    ids=["bf16", "fp16"])


@KEYS16_DOT
def test_prefill_logits_16bit_keys(dtype):
    """16-bit q and k, no key scales: the formula with scale 1, the 16-bit values
    exact in the float64 reference."""
    g = torch.Generator().manual_seed(5)
    M, H, D, N = 7, 4, 32, 150
    q, k = torch.randn(M, H, D, generator=g).to(dtype), torch.randn(N, D, generator=g).to(dtype)
    w = torch.randn(M, H, generator=g)
    ks, ke = prefill_bounds(M, N, g)
    to = dict(device=DEVICE)
    out = il.triton_mqa_logits(q.to(**to), k.to(**to), None, w.to(**to),
                               ks.to(**to), ke.to(**to)).cpu()
    assert_prefill_rows(out, reference_logits(q, k, torch.ones(N), w), ks, ke, **KEYS16_TOL)


def paged_cache_16bit(keys, BS, NB, max_model_len, g):
    """The 16-bit key cache [NB, BS, D] holding `keys` [k [n, D]] of the requests
    in random blocks (NaN in the slots no key fills), and their block table."""
    D, dtype = keys[0].shape[1], keys[0].dtype
    cache = torch.full((NB, BS, D), float("nan"), dtype=dtype)
    table, places = place_in_blocks([k.shape[0] for k in keys], BS, NB, max_model_len, g)
    for b, first, blk in places:
        rows = keys[b][first:first + BS]
        cache[blk, :rows.shape[0]] = rows
    return cache, table


@pytest.mark.parametrize("next_n", [1, 2])
@KEYS16_DOT
def test_paged_decode_logits_16bit_keys(next_n, dtype):
    g = torch.Generator().manual_seed(6)
    B, H, D, BS, NB = 3, 4, 32, 16, 40
    ctx = [37, 16, 90]
    max_model_len = 112
    q = torch.randn(B, next_n, H, D, generator=g).to(dtype)
    w = torch.randn(B * next_n, H, generator=g)
    keys = [torch.randn(n, D, generator=g).to(dtype) for n in ctx]
    cache, table = paged_cache_16bit(keys, BS, NB, max_model_len, g)  # (NaN where unwritten)
    seq_lens = mtp_seq_lens(ctx, next_n)
    to = dict(device=DEVICE)
    out = il.triton_paged_mqa_logits(q.to(**to), cache.to(**to), w.to(**to), seq_lens.to(**to),
                                     table.to(**to), max_model_len).cpu()
    assert_decode_rows(out, q, w, [(k, torch.ones(k.shape[0])) for k in keys], seq_lens, BS,
                       **KEYS16_TOL)


@KEYS16
def test_write_k_cache_16bit(dtype):
    """Each key lands at its slot (block * BS + offset), bit for bit; padding slots
    (-1) write nothing; the other slots keep what they held."""
    g = torch.Generator().manual_seed(7)
    NB, BS, D, T = 6, 16, 32, 40
    k = torch.randn(T, 2 * D, generator=g).to(dtype)[:, :D]  # a strided view, as kw's
    slots = torch.randperm(NB * BS, generator=g)[:T].to(torch.int64)
    slots[[3, 17, 39]] = -1
    before = torch.randn(NB, BS, D, generator=g).to(dtype)
    cache = before.clone().to(DEVICE)
    il.write_k_cache_16bit(k.to(DEVICE), cache, slots.to(DEVICE))
    expect = before.clone().view(-1, D)
    valid = slots >= 0
    expect[slots[valid]] = k[valid]
    assert torch.equal(cache.cpu().view(-1, D), expect)
    with pytest.raises(TypeError, match="16-bit key cache"):
        il.write_k_cache_16bit(k.float().to(DEVICE), cache, slots.to(DEVICE))


@KEYS16
def test_gather_k_cache_16bit(dtype):
    """Rows [cu[b], cu[b + 1]) of the output are request b's first positions, read
    through its block table; rows past cu[-1] (an upper-bound allocation) stay."""
    g = torch.Generator().manual_seed(8)
    NB, BS, D = 24, 16, 32
    lens = [37, 1, 16, 70]
    keys = [torch.randn(n, D, generator=g).to(dtype) for n in lens]
    cache, table = paged_cache_16bit(keys, BS, NB, 80, g)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    T = int(cu[-1]) + 11
    out = torch.full((T, D), 7.0, dtype=dtype, device=DEVICE)
    il.gather_k_cache_16bit(cache.to(DEVICE), out, table.to(DEVICE), cu.to(DEVICE))
    out = out.cpu()
    assert torch.equal(out[:int(cu[-1])], torch.cat(keys))
    assert (out[int(cu[-1]):] == 7.0).all()


def test_cache_switch(monkeypatch):
    """fp8 by default, 16bit on request, other values refused; a layer with 16-bit keys
    passes the Triton kernels' check on a GPU whose fp8 keys take fp8 dots."""
    _report_capability(monkeypatch, (9, 0))
    monkeypatch.delenv(il.CACHE_ENV, raising=False)
    assert not il.indexer_cache_16bit()
    monkeypatch.setenv(il.CACHE_ENV, " 16BIT ")
    assert il.indexer_cache_16bit()
    il.check_triton_indexer_supported(keys16=True)
    il.check_triton_indexer_supported()  # (layers of fp8 keys: as before)
    monkeypatch.setenv(il.CACHE_ENV, "bf16")
    with pytest.raises(ValueError, match="expected fp8 or 16bit"):
        il.indexer_cache_16bit()


def test_16bit_keys_take_the_triton_kernels(monkeypatch):
    """Whatever computes fp8 keys (DeepGEMM here), 16-bit keys go to the Triton
    kernels; fp8 keys keep the chosen backend."""
    from vllm.utils import deep_gemm

    seen = []
    monkeypatch.setattr(il, "indexer_logits_backend", lambda: "deepgemm")
    monkeypatch.setattr(deep_gemm, "fp8_fp4_mqa_logits", lambda *a, **kw: seen.append("dg"))
    monkeypatch.setattr(deep_gemm, "fp8_fp4_paged_mqa_logits",
                        lambda *a, **kw: seen.append("dg-paged"))
    monkeypatch.setattr(il, "triton_mqa_logits", lambda *a: seen.append("triton"))
    monkeypatch.setattr(il, "triton_paged_mqa_logits", lambda *a: seen.append("triton-paged"))
    ks, ke = torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    for dtype in (torch.bfloat16, FP8):
        q, k = torch.zeros(2, 4, 16, dtype=dtype), torch.zeros(8, 16, dtype=dtype)
        scales = None if dtype != FP8 else torch.ones(8)
        cache = (torch.zeros(2, 4, 16, dtype=dtype) if dtype != FP8
                 else torch.zeros(2, 4, 20, dtype=torch.uint8))
        il.mqa_logits((q, None), (k, scales), torch.ones(2, 4), ks, ke, clean_logits=False)
        il.paged_mqa_logits((q[:, None], None), cache, torch.ones(2, 4),
                            torch.ones(2, 1, dtype=torch.int32),
                            torch.zeros(2, 2, dtype=torch.int32), None, 8, clean_logits=False)
    assert seen == ["triton", "triton-paged", "dg", "dg-paged"]


@pytest.mark.parametrize("backend", ["deepgemm", "triton"])
@pytest.mark.parametrize("deep_gemm_installed", [True, False])
def test_decode_metadata_asks_deepgemm_only_for_its_keys(monkeypatch, backend,
                                                         deep_gemm_installed):
    """The metadata builder computes DeepGEMM's schedule only where DeepGEMM computes the
    decode logits: fp8 keys (a uint8 cache) on that backend, never the 16-bit cache."""
    from vllm.v1.attention.backends.mla import indexer

    monkeypatch.setattr(il, "indexer_logits_backend", lambda: backend)
    monkeypatch.setattr(indexer, "has_deep_gemm", lambda: deep_gemm_installed)
    native = backend == "deepgemm" and deep_gemm_installed
    assert indexer._uses_deep_gemm_logits(torch.uint8) == native
    for dtype in il.KEYS16_DTYPES:
        assert not indexer._uses_deep_gemm_logits(dtype)


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
@DOTS
@pytest.mark.parametrize("M,N", [(512, 1024), (1024, 4096), (256, 16384), (128, 65536)])
def test_prefill_matches_deepgemm(M, N, upcast):
    dg = _deep_gemm_or_skip()
    g = torch.Generator().manual_seed(2)
    q = random_fp8(M, 32, 128, g=g).cuda()
    k = random_fp8(N, 128, g=g).cuda()
    k_scale = (torch.rand(N, generator=g) * 0.02 + 0.01).cuda()
    w = _glm5_weights(M, g)
    # Causal rows of one request whose last M tokens are the queries.
    ke = torch.arange(N - M + 1, N + 1, dtype=torch.int32).cuda()
    ks = torch.zeros(M, dtype=torch.int32).cuda()
    ours = il.triton_mqa_logits(q, k, k_scale, w, ks, ke, upcast=upcast)
    theirs = dg.fp8_fp4_mqa_logits((q, None), (k, k_scale), w, ks, ke, clean_logits=True)
    topk = min(2048, N - M + 1)
    worst = 1.0
    for m in range(0, M, max(1, M // 16)):
        n = int(ke[m])
        torch.testing.assert_close(ours[m, :n], theirs[m, :n], rtol=2e-3, atol=2e-3)
        worst = min(worst, recall(ours[m, :n], theirs[m, :n].double(), min(topk, n)))
    assert worst >= 0.999


@pytest.mark.gpu
@DOTS
@pytest.mark.parametrize("next_n", [1, 2])
@pytest.mark.parametrize("ctx", [1024, 8192, 65536])
@pytest.mark.parametrize("batch", [1, 8])
def test_decode_matches_deepgemm(next_n, ctx, batch, upcast):
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
    seq = mtp_seq_lens(lens, next_n).cuda()
    ours = il.triton_paged_mqa_logits(q, cache, w, seq, table, max_model_len, upcast=upcast)
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
@DOTS
def test_cuda_graph_capture_and_replay(upcast):
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
        return il.triton_paged_mqa_logits(q, cache, w, seq, table, L, upcast=upcast)

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
