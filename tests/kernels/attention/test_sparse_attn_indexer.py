# SPDX-License-Identifier: Apache-2.0
"""The sparse attention indexer op (`sparse_attn_indexer`) with the 16-bit key cache
(VLLM_SPARSE_INDEXER_CACHE=16bit), end to end on the CPU: the keys of a step written
into the paged cache, prefill over two chunks gathering their requests' keys, and
decode as vLLM 0.26's metadata builder lays it out (one token a request; MTP's two,
context lengths per token; a CUDA-graph batch padded with requests of no tokens, the
packed path), against a float64 reference of the top-k each token must select.

The op's CUDA-only pieces are replaced by torch equivalents with the semantics of
vLLM's kernels (`top_k_per_row_prefill`: indices from the row's first key;
`top_k_per_row_decode`: from the request's first key); the Triton kernels (logits,
cache write and gather, sequence packing) run in the interpreter. fp16: Triton 3.6's
interpreter dots bf16 operands as bit patterns.

Below, the key cache seam (`sparse_attn_indexer_key_cache`): the op and the layer choose
the fp8 or the 16-bit cache's kernels by dtype in one place, and the fp8 cache's are
upstream's calls."""

from types import SimpleNamespace

import pytest
import torch

from vllm.model_executor.layers import sparse_attn_indexer as sai
from vllm.model_executor.layers import sparse_attn_indexer_key_cache as kc
from vllm.v1.attention.backends.mla.indexer import (
    DeepseekV32IndexerMetadata,
    DeepseekV32IndexerPrefillChunkMetadata,
    DeepseekV32IndexerPrefillMetadata,
    DeepSeekV32IndexerDecodeMetadata,
)

H, D, BS, NB, TOPK, MAX_LEN = 4, 32, 16, 24, 8, 64
LAYER = "model.layers.0.self_attn.indexer.k_cache"


def _topk_rows(logits, lengths, starts, out, topk):
    for r, (n, s) in enumerate(zip(lengths, starts)):
        out[r] = -1
        if n > 0:
            idx = torch.topk(logits[r, s:s + n], min(topk, n)).indices
            out[r, :idx.numel()] = idx.to(out.dtype)


def top_k_per_row_prefill(logits, ks, ke, out, num_rows, stride0, stride1, topk):
    ks, ke = ks.tolist(), ke.tolist()
    _topk_rows(logits, [e - s for s, e in zip(ks, ke)], ks, out, topk)


def top_k_per_row_decode(logits, next_n, seq_lens, out, num_rows, stride0, stride1, topk):
    lens = seq_lens.reshape(-1).tolist()
    assert len(lens) == num_rows
    _topk_rows(logits, lens, [0] * num_rows, out, topk)


class Workspace:
    """One buffer for every request, as vLLM's workspace manager, filled with NaN
    (what a previous step left there must not matter)."""

    def __init__(self):
        self.buffer = torch.full((1 << 20,), float("nan"), dtype=torch.float16).view(torch.uint8)

    def get_simultaneous(self, *specs):
        out, offset = [], 0
        for shape, dtype in specs:
            n = torch.Size(shape).numel() * dtype.itemsize
            out.append(self.buffer[offset:offset + n].view(dtype).view(shape))
            offset += -(-n // 256) * 256
        return out


def reference_topk(q, w, keys, n):
    """The top-k positions among keys[:n] of one token (float64 formula)."""
    s = torch.einsum("hd,nd->hn", q.double(), keys[:n].double()).relu()
    logits = (s * w.double()[:, None]).sum(0)
    return set(torch.topk(logits, min(TOPK, n)).indices.tolist())


@pytest.mark.parametrize("decode_lens,with_prefill", [
    ([1, 1], True), ([2, 2], True), ([2, 2, 0], False)], ids=["plain", "mtp", "padded"])
def test_keys16_indexer_op(monkeypatch, decode_lens, with_prefill):
    g = torch.Generator().manual_seed(3)
    dtype = torch.float16
    # decode requests first (vLLM's order): context lengths after this step's tokens
    # (0: a padding request of a CUDA-graph batch, the last; decodes are otherwise of
    # one length: split_decodes_and_prefills(require_uniform=True))
    decode_ctx = [21, 37, 0][:len(decode_lens)]
    # prefill requests: (tokens already cached, new tokens), one chunk each
    prefill = [(10, 7), (0, 20)] if with_prefill else []
    reqs = [(c - d, d) for c, d in zip(decode_ctx, decode_lens)] + prefill
    keys = [torch.randn(old + new, D, generator=g).to(dtype) for old, new in reqs]
    free = torch.randperm(NB, generator=g).tolist()
    tables = torch.zeros(len(reqs), MAX_LEN // BS, dtype=torch.int32)
    cache = torch.full((NB, BS, D), float("nan"), dtype=dtype)
    slots, new_keys = [], []
    for r, ((old, new), k) in enumerate(zip(reqs, keys)):
        for b in range(-(-(old + new) // BS)):
            tables[r, b] = free.pop()
        for pos in range(old + new):
            slot = int(tables[r, pos // BS]) * BS + pos % BS
            if pos < old:
                cache.view(-1, D)[slot] = k[pos]  # cached by earlier steps
            else:
                slots.append(slot)
                new_keys.append(k[pos])
    T = len(slots)
    slot_mapping = torch.tensor(slots + [-1], dtype=torch.int64)  # + a graph's padding token
    k_step = torch.stack(new_keys + [torch.full((D,), 7.0, dtype=dtype)])
    q = torch.randn(T + 1, H, D, generator=g).to(dtype)
    w = torch.randn(T + 1, H, generator=g)

    nd, num_decodes = sum(decode_lens), len(decode_lens)
    Lmax = max(decode_lens)
    chunks, token = [], nd
    for i, (old, new) in enumerate(prefill):
        r = num_decodes + i
        total = old + new
        ks = torch.zeros(new, dtype=torch.int32)
        chunks.append(DeepseekV32IndexerPrefillChunkMetadata(
            block_table=tables[r:r + 1], cu_seqlen_ks=ks,
            cu_seqlen_ke=torch.arange(old + 1, total + 1, dtype=torch.int32),
            cu_seq_lens=torch.tensor([0, total], dtype=torch.int32),
            token_to_seq=torch.zeros(total, dtype=torch.int32), total_seq_lens=total,
            token_start=token, token_end=token + new, num_reqs=1,
            local_cu_seq_lens=torch.tensor([0, total], dtype=torch.int32),
            local_total_seq_lens=total, max_local_total_seq_lens=total + 5))
        token += new
    # decode: per (request, j) the keys token j sees, as the builder's native path
    seq_lens = torch.tensor([[max(0, c - Lmax + j + 1) for j in range(Lmax)]
                             for c in decode_ctx], dtype=torch.int32)
    meta = DeepseekV32IndexerMetadata(
        seq_lens=torch.tensor([c for c, _ in reqs]), max_seq_len=MAX_LEN,
        slot_mapping=slot_mapping, num_decodes=num_decodes, num_decode_tokens=nd,
        num_prefills=len(prefill), num_prefill_tokens=T - nd,
        decode=DeepSeekV32IndexerDecodeMetadata(
            block_table=tables[:num_decodes], seq_lens=seq_lens,
            decode_lens=torch.tensor(decode_lens, dtype=torch.int32),
            requires_padding=min(decode_lens) != Lmax,
            schedule_metadata=torch.empty(0, dtype=torch.int32)),
        prefill=DeepseekV32IndexerPrefillMetadata(chunks=chunks) if chunks else None)

    monkeypatch.setattr(sai, "get_forward_context",
                        lambda: SimpleNamespace(attn_metadata={LAYER: meta}))
    monkeypatch.setattr(sai, "current_workspace_manager", Workspace)
    chosen = []  # the key cache, chosen once (by the queries' dtype: the cache's)
    monkeypatch.setattr(sai, "indexer_key_cache",
                        lambda d: chosen.append(d) or kc.indexer_key_cache(d))
    monkeypatch.setattr(sai, "ops", SimpleNamespace(
        top_k_per_row_prefill=top_k_per_row_prefill,
        top_k_per_row_decode=top_k_per_row_decode))
    topk_buffer = torch.full((64, TOPK), 5, dtype=torch.int32)  # (max_num_batched_tokens)
    sai.sparse_attn_indexer(
        torch.empty(T + 1, 8), LAYER, cache, q, None, k_step, w, 128, "ue8m0", TOPK, D,
        MAX_LEN, 256, topk_buffer, False, False)
    assert chosen == [dtype]

    # every key of the step is in the cache now (the padding token's nowhere)
    for (old, new), k, r in zip(reqs, keys, range(len(reqs))):
        for pos in range(old + new):
            slot = int(tables[r, pos // BS]) * BS + pos % BS
            assert torch.equal(cache.view(-1, D)[slot], k[pos]), (r, pos)
    assert not (cache == 7.0).all(-1).any()
    got = [set(row) - {-1} for row in topk_buffer[:T].tolist()]
    token = 0
    for b, d in enumerate(decode_lens):  # decode: as many keys as seq_lens gives
        for j in range(d):
            n = int(seq_lens[b, j])
            assert got[token] == reference_topk(q[token], w[token], keys[b], n), (b, j)
            token += 1
    for i, (old, new) in enumerate(prefill):  # prefill: causal
        for j in range(new):
            ref = reference_topk(q[token], w[token], keys[num_decodes + i], old + j + 1)
            assert got[token] == ref, (i, j)
            token += 1


# --------------------------------------------------------------------------------------
# The key cache seam: one choice by dtype, upstream's calls for fp8 keys
# --------------------------------------------------------------------------------------
def test_key_cache_chosen_by_dtype():
    """`indexer_key_cache` is the one choice of the key cache's kernels: the 16-bit
    cache for the model's float16/bfloat16 (the cache's and its queries' dtype),
    upstream's fp8 cache for bytes (its uint8 cache, fp8 or MXFP4 queries); a float32
    cache is refused with the switch's name."""
    from vllm.model_executor.layers import sparse_attn_indexer_key_cache as kc

    for dtype in (torch.uint8, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.int8):
        assert kc.indexer_key_cache(dtype) is kc.FP8_KEY_CACHE
    for dtype in (torch.float16, torch.bfloat16):
        chosen = kc.indexer_key_cache(dtype)
        assert isinstance(chosen, kc.Keys16KeyCache) and chosen.dtype == dtype
        assert chosen is kc.indexer_key_cache(dtype)
        assert chosen.workspace_shapes(40, D, torch.float8_e4m3fn, False) == (
            ((40, D), dtype), ((40, 0), torch.uint8))
        assert chosen.logits_key_scales(torch.empty(40, 0, dtype=torch.uint8)) is None
    with pytest.raises(ValueError, match="VLLM_SPARSE_INDEXER_CACHE=16bit needs a "
                       "float16 or bfloat16 model; this one is torch.float32"):
        kc.indexer_key_cache(torch.float32)


def test_op_has_one_key_cache_choice():
    """Upstream's op and layer change only by call sites of the chosen key cache: each
    asks `indexer_key_cache` once, and neither branches on the 16-bit cache."""
    import inspect

    for fn, asked_with in ((sai.sparse_attn_indexer, "indexer_key_cache(q_quant.dtype)"),
                           (sai.SparseAttnIndexer.__init__,
                            "indexer_key_cache(k_cache.dtype)")):
        source = inspect.getsource(fn)
        assert source.count("indexer_key_cache(") == 1 and asked_with in source
        for word in ("keys16", "KEYS16", "16bit", "_16bit", "float16", "bfloat16"):
            assert word not in source, (fn.__name__, word)


@pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.float16, torch.bfloat16])
def test_profiling_run_reserves_the_key_caches_workspace(monkeypatch, q_dtype):
    """The profiling run (no metadata, no cache allocated yet: the layer's placeholder is
    float32) reserves the prefill workspace of the key cache its queries' dtype
    chooses: upstream's fp8 keys and 4-byte scales, or 16-bit keys and no scales."""
    reserved = []

    class Recorder:
        def get_simultaneous(self, *specs):
            reserved.append(specs)

    monkeypatch.setenv("VLLM_SPARSE_INDEXER_MAX_LOGITS_MB", "1")
    monkeypatch.setattr(sai, "get_forward_context", lambda: SimpleNamespace(attn_metadata=None))
    monkeypatch.setattr(sai, "current_workspace_manager", Recorder)
    T = 3
    buffer = torch.full((T, TOPK), -1, dtype=torch.int32)
    out = sai.sparse_attn_indexer(
        torch.empty(T, 8), LAYER, torch.tensor([]), torch.zeros(T, H, D).to(q_dtype), None,
        torch.zeros(T, D), torch.zeros(T, H), 128, "ue8m0", TOPK, D, MAX_LEN, 256, buffer,
        False, False)
    assert out is buffer
    if q_dtype == torch.float8_e4m3fn:
        fp8 = sai.current_platform.fp8_dtype()
        values, scales = sai._gather_workspace_shapes(256, D, fp8, False)
    else:
        values, scales = ((256, D), q_dtype), ((256, 0), torch.uint8)
    assert reserved == [(values, scales, ((sai.RADIX_TOPK_WORKSPACE_SIZE,), torch.uint8))]


def test_fp8_key_cache_is_upstreams_calls(monkeypatch):
    """The fp8 key cache makes exactly the calls upstream's op makes in its place:
    `indexer_k_quant_and_cache`, `cp_gather_indexer_k_quant_cache` with the op's
    arguments, the scales viewed as fp32, queries padded with pack_seq_triton's default
    (or with 0 bytes where Triton takes e4m3 as bytes, SM80/86)."""
    from vllm.model_executor.layers import sparse_attn_indexer_key_cache as kc

    calls = []
    monkeypatch.setattr(kc, "ops", SimpleNamespace(
        indexer_k_quant_and_cache=lambda *a: calls.append(("write", a)),
        cp_gather_indexer_k_quant_cache=lambda *a: calls.append(("gather", a))))
    fp8 = kc.FP8_KEY_CACHE
    k, cache, slots, table, cu = (torch.empty(1) for _ in range(5))
    fp8.write_keys(k, cache, slots, 128, "ue8m0")
    values, scales = torch.empty(4, D), torch.empty(4, 4, dtype=torch.uint8)
    fp8.gather_keys(cache, values, scales, table, cu)
    assert calls == [("write", (k, cache, slots, 128, "ue8m0")),
                     ("gather", (cache, values, scales, table, cu))]
    for fp4 in (False, True):
        assert fp8.workspace_shapes(40, D, torch.float8_e4m3fn, fp4) == \
            sai._gather_workspace_shapes(40, D, torch.float8_e4m3fn, fp4)
    got = fp8.logits_key_scales(scales)
    assert got.dtype == torch.float32 and got.shape == (4,)
    assert got.data_ptr() == scales.data_ptr()

    packed = []
    monkeypatch.setattr(kc, "pack_seq_triton",
                        lambda x, lens, **kw: packed.append((x.dtype, kw)) or x)
    q = torch.zeros(3, H, D, dtype=torch.float8_e4m3fn)
    for as_bytes in (False, True):
        monkeypatch.setattr(kc.indexer_logits, "e4m3_as_bytes", lambda: as_bytes)
        assert fp8.pad_decode_q(q, torch.tensor([3])).dtype == q.dtype
    keys16 = kc.indexer_key_cache(torch.bfloat16)
    keys16.pad_decode_q(q.to(torch.bfloat16), torch.tensor([3]))
    assert packed == [(torch.float8_e4m3fn, {}), (torch.uint8, {"pad_value": 0}),
                      (torch.bfloat16, {"pad_value": 0})]


@pytest.mark.parametrize("keys", ["fp8", "16bit"])
def test_prefill_workspace_is_no_larger_than_upstreams(monkeypatch, keys):
    """At GLM-5's whole context the indexer's prefill workspace, the prefill buffer's
    tokens times the key cache's bytes a token, is at most upstream's: 40 x
    max_model_len tokens of 128 fp8 bytes and a 4-byte scale (vLLM 0.26's
    get_max_prefill_buffer_size, sized to fit FlashMLA's sparse workspace). The
    logits a prefill chunk computes are [tokens, keys] float32 on DeepGEMM's and
    the Triton kernels alike."""
    from vllm.v1.attention.backends.mla.indexer import get_max_prefill_buffer_size

    monkeypatch.setenv("VLLM_SPARSE_INDEXER_CACHE", keys)
    max_len, head_dim = 202752, 128
    config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=max_len))
    tokens = get_max_prefill_buffer_size(config)
    dtype = torch.uint8 if keys == "fp8" else torch.bfloat16
    shapes = kc.indexer_key_cache(dtype).workspace_shapes(
        tokens, head_dim, torch.float8_e4m3fn, False)
    got = sum(torch.Size(shape).numel() * torch.empty(0, dtype=t).element_size()
              for shape, t in shapes)
    upstream = 40 * max_len * (head_dim + 4)
    assert got <= upstream
    assert got == upstream if keys == "fp8" else got > 0.9 * upstream
