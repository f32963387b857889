# SPDX-License-Identifier: Apache-2.0
"""TRITON_MLA_SPARSE against a float64 PyTorch reference of sparse MLA.

CPU (Triton interpreter): small shapes. GPU (`gpu` marker, H200): GLM-5 shapes,
memory-safety cases and CUDA-graph capture; `test_matches_flashmla_sparse`
compares with upstream's FlashMLA sparse kernel on the same inputs.
"""

import dataclasses
import functools
import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from vllm.v1.attention.ops import sparse_mla_launch as sml
from vllm.v1.attention.ops import triton_sparse_mla as tsm
from vllm.v1.attention.backends.mla.triton_mla_sparse import (
    TritonMLASparseImpl,
    TritonMLASparseMetadata,
)

KV_LORA, ROPE = 512, 64
HEAD = KV_LORA + ROPE
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def reference_sparse_mla(q, cache, block_table, req_id, indices, scale, k_scale=1.0):
    """float64 sparse MLA: softmax over each token's valid top-k entries.

    q [T,H,576]; cache [NB,BS,576] (any dtype; fp8 dequantized with k_scale);
    indices [T,K] request-local positions, -1 = unused. Duplicates count twice,
    as they do for every sparse MLA kernel. Rows with no valid entry give 0.
    """
    bs = cache.shape[1]
    kv = cache.cpu().to(torch.float64).reshape(-1, HEAD) * k_scale
    indices, block_table, req_id = indices.cpu(), block_table.cpu(), req_id.cpu()
    out = torch.zeros(q.shape[0], q.shape[1], KV_LORA, dtype=torch.float64)
    for t in range(q.shape[0]):
        idx = indices[t][indices[t] >= 0].long()
        if idx.numel() == 0:
            continue
        blocks = block_table[req_id[t]].long()[idx // bs]
        rows = kv[blocks * bs + idx % bs]  # [n, 576]
        logits = q[t].to(torch.float64).cpu() @ rows.T * scale  # [H, n]
        out[t] = torch.softmax(logits, dim=-1) @ rows[:, :KV_LORA]
    return out


def make_case(
    num_tokens_per_req,
    context_lens,
    num_heads,
    topk,
    block_size,
    dtype,
    kv_dtype,
    seed,
    empty_rows=(),
    duplicates=True,
    num_blocks=None,
    device=DEVICE,
):
    """Random requests with paged caches and indexer-style top-k rows."""
    g = torch.Generator().manual_seed(seed)
    num_reqs = len(context_lens)
    blocks_per_req = [math.ceil(c / block_size) for c in context_lens]
    total_blocks = num_blocks or sum(blocks_per_req) + 3
    perm = torch.randperm(total_blocks, generator=g)
    block_table = torch.zeros(num_reqs, max(blocks_per_req), dtype=torch.int32)
    used = 0
    for r, n in enumerate(blocks_per_req):
        block_table[r, :n] = perm[used : used + n]
        used += n
    cache = torch.randn(total_blocks, block_size, HEAD, generator=g) * 0.5
    cache = cache.to(kv_dtype)
    req_id, rows = [], []
    for r, (n_tok, ctx) in enumerate(zip(num_tokens_per_req, context_lens)):
        for i in range(n_tok):
            pos = ctx - n_tok + i  # causal: a token sees positions [0, pos]
            n_valid = int(torch.randint(1, min(topk, pos + 1) + 1, (1,), generator=g))
            idx = torch.randperm(pos + 1, generator=g)[:n_valid].to(torch.int32)
            if duplicates and n_valid > 2:
                idx[-1] = idx[0]  # the same position twice
            row = torch.full((topk,), -1, dtype=torch.int32)
            row[:n_valid] = idx
            rows.append(row)
            req_id.append(r)
    indices = torch.stack(rows)
    for t in empty_rows:
        indices[t] = -1
    q = (torch.randn(len(rows), num_heads, HEAD, generator=g) * 0.5).to(dtype)
    to = dict(device=device)
    return SimpleNamespace(
        q=q.to(**to),
        cache=cache.to(**to),
        block_table=block_table.to(**to),
        req_id=torch.tensor(req_id, dtype=torch.int32, device=device),
        indices=indices.to(**to),
        block_size=block_size,
        topk=topk,
    )


def run_backend(case, num_heads, kv_scale=1.0):
    """The impl's forward_mqa, fed as MLAAttention feeds it."""
    impl = TritonMLASparseImpl.__new__(TritonMLASparseImpl)
    impl.kv_lora_rank = KV_LORA
    impl.scale = 1.0 / math.sqrt(192 + ROPE)
    impl.topk_indices_buffer = case.indices
    md = TritonMLASparseMetadata(
        num_reqs=case.block_table.shape[0],
        max_query_len=0,
        max_seq_len=0,
        num_actual_tokens=case.q.shape[0],
        query_start_loc=None,
        slot_mapping=None,
        block_table=case.block_table,
        req_id_per_token=case.req_id,
        block_size=case.block_size,
        topk_tokens=case.topk,
    )
    # torch.full, not torch.tensor: no host-to-device copy (CUDA-graph capture).
    layer = SimpleNamespace(
        _k_scale=torch.full((1,), kv_scale, dtype=torch.float32, device=case.q.device)
    )
    q = (case.q[..., :KV_LORA], case.q[..., KV_LORA:])  # the layer passes a tuple
    o, lse = impl.forward_mqa(q, case.cache, md, layer)
    assert lse is None
    assert o.shape == (case.q.shape[0], num_heads, KV_LORA) and o.dtype == case.q.dtype
    return o, impl.scale


def check(case, num_heads, tol, kv_scale=1.0):
    o, scale = run_backend(case, num_heads, kv_scale=kv_scale)
    ref = reference_sparse_mla(
        case.q, case.cache, case.block_table, case.req_id, case.indices, scale, kv_scale
    )
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o.double().cpu(), ref, rtol=tol, atol=tol)
    return o


def launch(num_tokens, num_heads, topk, kv_dtype=torch.float16, *, capability=90,
           shared_mem=sml.HOPPER_SHARED_MEM, gluon=True, **changes):
    """`sparse_mla_launch` for fp16 queries on a GPU of 132 SMs, with `changes`."""
    device = sml.SparseMLADevice(capability, shared_mem, 132, gluon)
    return dataclasses.replace(
        sml.sparse_mla_launch(device, num_tokens, num_heads, HEAD, KV_LORA, topk,
                              torch.float16, kv_dtype), **changes)


# --------------------------------------------------------------------------------------
# CPU (Triton interpreter) and GPU
# --------------------------------------------------------------------------------------
# Triton 3.6's interpreter computes tl.dot on bf16 operands wrongly (a bf16
# 16x16 product is off by ~1e10 there), so bf16 runs on the GPU only.
BF16_GPU_ONLY = pytest.param(torch.bfloat16, 2e-2, marks=pytest.mark.gpu, id="bf16")


@pytest.mark.parametrize(
    "dtype,tol", [BF16_GPU_ONLY, pytest.param(torch.float16, 4e-3, id="fp16")]
)
def test_sparse_mla_small(dtype, tol):
    # Two requests (a 3-token prefill chunk and a decode), -1 suffixes,
    # a duplicated slot per row, and one row left without any valid slot.
    case = make_case(
        [3, 1], [40, 70], 16, 128, 16, dtype, dtype, seed=0, empty_rows=[1]
    )
    o = check(case, 16, tol)
    assert (o[1] == 0).all()


@pytest.mark.parametrize(
    "dtype,tol", [BF16_GPU_ONLY, pytest.param(torch.float16, 1e-2, id="fp16")]
)
def test_sparse_mla_fp8_cache(dtype, tol):
    # fp8 cache with a per-tensor scale; the reference dequantizes the same bytes.
    case = make_case([2], [50], 16, 128, 16, dtype, FP8, seed=1)
    check(case, 16, tol, kv_scale=0.75)


@pytest.mark.parametrize("v_reload", [False, True])
def test_gather_kernel_fp8_cache_reads(v_reload):
    # The two ways the gather kernel reads fp8 rows for the PV dot: the tile it
    # converted for QK^T (the scale on the scores and the output) or a second copy
    # of the rows (V_RELOAD), against float64 on the dequantized cache.
    case = make_case([2, 1], [50, 90], 16, 128, 16, torch.float16, FP8, seed=3)
    slots, counts = tsm_inputs(case)
    scale = 1.0 / math.sqrt(192 + ROPE)
    ref = reference_sparse_mla(case.q, case.cache, case.block_table, case.req_id,
                               case.indices, scale, k_scale=0.75)
    tile = sml.SparseMLATile.TRITON_V_RELOAD if v_reload else sml.SparseMLATile.TRITON
    for splits in (1, 2):
        chosen = launch(3, 16, 128, FP8, gluon=False, splits=splits, block_n=16, tile=tile)
        o = tsm.sparse_mla_attention(case.q, case.cache, slots, counts, KV_LORA, scale,
                                     torch.full((1,), 0.75, device=DEVICE), launch=chosen)
        torch.testing.assert_close(o.double().cpu(), ref, rtol=1e-2, atol=1e-2)


def test_forward_mqa_on_the_leading_tokens():
    # When MLAAttention sends a batch's prefills to dense MHA, forward_mqa gets
    # only the leading (decode) tokens while the metadata and the top-k buffer
    # cover the whole batch.
    case = make_case([1, 1, 5], [40, 70, 90], 16, 128, 16, torch.float16, torch.float16,
                     seed=9)
    whole, _ = run_backend(case, 16)
    lead = SimpleNamespace(**{**vars(case), "q": case.q[:2]})
    o, _ = run_backend(lead, 16)
    torch.testing.assert_close(o, whole[:2], rtol=0, atol=0)


def mla_impl_args(**changes):
    args = dict(num_heads=16, head_size=HEAD, scale=0.1, num_kv_heads=1, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                attn_type="decoder", kv_sharing_target_layer_name=None, q_lora_rank=None,
                kv_lora_rank=KV_LORA, qk_nope_head_dim=192, qk_rope_head_dim=ROPE,
                qk_head_dim=192 + ROPE, v_head_dim=256, kv_b_proj=object())
    return {**args, **changes}


def test_impl_construction():
    # Constructed as MLAAttention constructs it: an indexer on layers that
    # compute the top-k, only the shared buffer on IndexCache skip layers.
    shared = torch.full((8, 128), -1, dtype=torch.int32)
    own = torch.full((8, 128), -1, dtype=torch.int32)
    impl = TritonMLASparseImpl(**mla_impl_args(topk_indices_buffer=shared,
                                               indexer=SimpleNamespace(topk_indices_buffer=own)))
    assert impl.topk_indices_buffer is own
    assert impl.is_sparse and not impl.supports_quant_query_input
    assert (impl.kv_lora_rank, impl.qk_nope_head_dim, impl.v_head_dim) == (KV_LORA, 192, 256)
    assert impl.dcp_world_size == 1 and not impl.need_to_return_lse_for_decode
    skip_layer = TritonMLASparseImpl(**mla_impl_args(topk_indices_buffer=shared))
    assert skip_layer.topk_indices_buffer is shared
    with pytest.raises(ValueError, match="top-k buffer"):
        TritonMLASparseImpl(**mla_impl_args())
    with pytest.raises(NotImplementedError, match="fp8_ds_mla"):
        TritonMLASparseImpl(**mla_impl_args(kv_cache_dtype="fp8_ds_mla",
                                            topk_indices_buffer=shared))
    with pytest.raises(NotImplementedError):
        TritonMLASparseImpl(**mla_impl_args(sliding_window=128, topk_indices_buffer=shared))


@pytest.mark.parametrize("num_heads", [5, 20, 40])
def test_gather_kernel_split_k_and_head_padding(num_heads):
    # Heads that do not fill a head block (masked rows of the MMA) and split-K
    # with the log-sum-exp merge, forced through `launch`, against float64; the
    # splits include ones past a row's valid entries (empty splits).
    case = make_case([2, 1], [90, 200], num_heads, 128, 16, torch.float16, torch.float16,
                     seed=8)
    o1 = check(case, num_heads, 4e-3)  # the launch table's choice
    slots, counts = tsm_inputs(case)
    scale = 1.0 / math.sqrt(192 + ROPE)
    one = torch.ones(1, device=DEVICE)
    ref = reference_sparse_mla(case.q, case.cache, case.block_table, case.req_id,
                               case.indices, scale)
    for splits in (1, 4):
        chosen = launch(3, num_heads, 128, gluon=False, splits=splits, block_n=16)
        o = tsm.sparse_mla_attention(case.q, case.cache, slots, counts, KV_LORA, scale,
                                     one, launch=chosen)
        torch.testing.assert_close(o.double().cpu(), ref, rtol=4e-3, atol=4e-3)
    assert o1.shape == o.shape


def tsm_inputs(case):
    from vllm.v1.attention.backends.mla.sparse_utils import (
        triton_convert_req_index_to_global_index,
    )

    return triton_convert_req_index_to_global_index(
        case.req_id, case.block_table, case.indices, BLOCK_SIZE=case.block_size,
        NUM_TOPK_TOKENS=case.topk, return_valid_counts=True)


def make_builder(monkeypatch, num_heads, batch_invariant=False, prefill_backend=None):
    """TRITON_MLA_SPARSE's metadata builder for GLM-5 shapes (no engine)."""
    from vllm.v1.attention.backends.mla.triton_mla_sparse import (
        TritonMLASparseMetadataBuilder,
    )
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1" if batch_invariant else "0")
    if DEVICE == "cpu":  # no pinned host memory without a driver
        monkeypatch.setattr("vllm.utils.torch_utils.PIN_MEMORY", False)
    hf = SimpleNamespace(index_topk=2048, kv_lora_rank=KV_LORA, qk_nope_head_dim=192,
                         qk_rope_head_dim=ROPE, v_head_dim=256)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(
            hf_config=hf, hf_text_config=hf, max_model_len=8192, dtype=torch.float16,
            get_num_attention_heads=lambda parallel_config: num_heads),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=4096, max_num_seqs=8),
        cache_config=SimpleNamespace(block_size=64),
        parallel_config=SimpleNamespace(prefill_context_parallel_size=1,
                                        decode_context_parallel_size=1,
                                        cp_kv_cache_interleave_size=1),
        speculative_config=None,
        # MLAAttention registers itself with the prefill backend it selected
        compilation_config=SimpleNamespace(
            static_forward_context={"layer": SimpleNamespace(prefill_backend=prefill_backend)}),
    )
    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=HEAD, dtype=torch.float16)
    return TritonMLASparseMetadataBuilder(spec, ["layer"], vllm_config, torch.device(DEVICE))


def common_metadata(query_lens, seq_lens):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    blocks = torch.arange(len(seq_lens) * 40, dtype=torch.int32).view(len(seq_lens), 40)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(DEVICE), query_start_loc_cpu=qsl, seq_lens=seq.to(DEVICE),
        seq_lens_cpu_upper_bound=seq, num_reqs=len(seq_lens),
        num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), block_table_tensor=blocks.to(DEVICE),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64, device=DEVICE))


# A reordered batch: two decodes, an MTP-sized query, a 200-token chunk with
# context, then a 300-token prefill and a 700-token chunk of a long prompt.
QUERY_LENS = [1, 1, 4, 200, 300, 700]
SEQ_LENS = [100, 5000, 50, 1000, 300, 1900]


@pytest.mark.parametrize("num_heads,batch_invariant,num_mqa_reqs",
                         [(64, False, 4), (128, False, 4), (16, False, 3), (32, False, 3),
                          (64, True, 6), (16, True, 6)])
def test_metadata_builder_routes_like_upstream(monkeypatch, num_heads, batch_invariant,
                                               num_mqa_reqs):
    # 0.26's sparse MLA contract: the builder splits the batch at the reorder
    # threshold (FLASH_ATTN_MLA_SPARSE's per-head-count table), MLAAttention runs
    # the leading num_decode_tokens through forward_mqa and the rest on dense MHA
    # when every prefill fits the top-k. Under VLLM_BATCH_INVARIANT every request
    # takes forward_mqa, so no request's path depends on its batch.
    builder = make_builder(monkeypatch, num_heads, batch_invariant)
    expected_threshold = 4096 if batch_invariant else (128 if num_heads <= 32 else 256)
    assert builder.reorder_batch_threshold == expected_threshold
    assert not builder.require_uniform_decodes  # rows attend independently
    md = builder.build(0, common_metadata(QUERY_LENS, SEQ_LENS))
    assert isinstance(md, TritonMLASparseMetadata)
    assert (md.num_decodes, md.num_prefills) == (num_mqa_reqs, 6 - num_mqa_reqs)
    assert md.num_decode_tokens == sum(QUERY_LENS[:num_mqa_reqs])
    assert md.num_actual_tokens == sum(QUERY_LENS)
    assert (md.block_size, md.topk_tokens) == (64, 2048)
    expected_req = torch.repeat_interleave(torch.arange(6), torch.tensor(QUERY_LENS))
    assert torch.equal(md.req_id_per_token.cpu().long(), expected_req)
    # no prefill backend: no dense-MHA metadata, MLAAttention keeps all on MQA
    assert md.prefill is None and md.prefill_max_seq_len == 0


@pytest.mark.parametrize("long_prompt", [
    700,  # a whole prompt
    # a later chunk: its 1200 tokens of context are gathered in chunks (whose
    # metadata vLLM builds in pinned host memory: GPU hosts only)
    pytest.param(1900, marks=pytest.mark.gpu, id="chunked-context"),
])
def test_metadata_builder_dense_prefill_fields(monkeypatch, long_prompt):
    # With the layer's prefill backend the builder fills what MLAAttention's
    # dense-MHA routing reads: the prefills' longest sequence (within the top-k
    # of 2048 here) and the shared MLA prefill metadata.
    prepared = []
    backend = SimpleNamespace(prepare_metadata=prepared.append)
    backend.clone = lambda: backend
    builder = make_builder(monkeypatch, 64, prefill_backend=backend)
    md = builder.build(0, common_metadata([1, 1, 300, 700], [100, 5000, 300, long_prompt]))
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens) == (2, 2, 2)
    assert md.prefill_max_seq_len == long_prompt
    assert md.prefill is not None and prepared == [md.prefill]
    assert md.prefill.max_query_len == 700
    assert md.prefill.query_start_loc.cpu().tolist() == [0, 300, 1000]
    assert (md.prefill.chunked_context is not None) == (long_prompt > 700)


def test_gather_launch_config():
    # Shapes only; heads in blocks of 16/32/64; splits fill about one wave at
    # small batch (two programs of up to 32 heads per SM on Hopper), keep >= 64
    # slots per split and bound the partial buffer.
    c = launch(1, 64, 2048)
    assert (c.block_h, c.splits) == (64, 32)
    assert [launch(t, 64, 2048).splits for t in (8, 64, 67)] == [16, 2, 1]
    assert [launch(t, 8, 2048).splits for t in (8, 64, 132)] == [32, 4, 2]
    assert launch(1, 8, 2048).block_h == 16
    assert launch(4096, 64, 2048).splits == 1
    assert launch(1, 8, 128).splits == 2
    assert launch(1, 8, 64).splits == 1

    # The Triton tiles (without Hopper's Gluon tiles): 32 heads of a 16-bit cache as
    # two 16-head programs while the tokens do not fill the GPU, one 32-head program
    # once they do; an fp8 cache keeps 32
    def tile(t, kv_dtype=torch.float16, **device):
        c = launch(t, 32, 2048, kv_dtype, gluon=False, **device)
        return c.block_h, c.splits

    assert [tile(t) for t in (8, 64, 128, 4096)] == [(16, 16), (16, 2), (16, 1), (32, 1)]
    assert [tile(t, FP8) for t in (8, 64, 4096)] == [(32, 32), (32, 4), (32, 1)]
    # one program per SM there
    assert tile(8, capability=120, shared_mem=99 * 1024) == (32, 16)
    for t in (1, 2, 8, 64, 131):
        for h in (8, 16, 64, 128):
            s = launch(t, h, 2048).splits
            assert s & (s - 1) == 0 and 2048 // s >= 64
            assert s == 1 or t * h * s * 512 * 4 <= sml._MAX_PARTIAL_BYTES
    # an fp8 cache is read twice by mma.sync tiles (fewer heads, or no Hopper /
    # SM100), once by Hopper's wgmma and SM100's tcgen05 tiles of 64 heads
    reload = sml.SparseMLATile.TRITON_V_RELOAD
    for cap, smem in ((90, sml.HOPPER_SHARED_MEM), (100, sml.HOPPER_SHARED_MEM),
                      (120, 99 * 1024), (89, 99 * 1024)):
        device = {"capability": cap, "shared_mem": smem, "gluon": False}
        for h, reloads in ((8, True), (32, True), (64, cap >= 110 or cap < 90)):
            assert (launch(1, h, 2048, FP8, **device).tile is reload) is reloads, (cap, h)
            assert launch(1, h, 2048, **device).tile is sml.SparseMLATile.TRITON


def test_gather_batch_invariant(monkeypatch):
    # VLLM_BATCH_INVARIANT: no split-K, so a token's result does not depend on
    # how many other tokens share the launch.
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    for t in (1, 8, 64):
        assert launch(t, 64, 2048).splits == 1
    # nor does its tile (the same launch at every token count)
    for cap, smem in ((90, sml.HOPPER_SHARED_MEM), (100, sml.HOPPER_SHARED_MEM),
                      (120, 99 * 1024), (80, 163 * 1024)):
        for heads in (8, 16, 20, 32, 64, 128):
            for kv_dtype in (torch.float16, FP8):
                launches = {launch(t, heads, 2048, kv_dtype, capability=cap, shared_mem=smem)
                            for t in (1, 2, 7, 8, 64, 4096)}
                assert len(launches) == 1, (cap, heads, kv_dtype, launches)


def test_empty_batch():
    q = torch.empty(0, 16, HEAD, dtype=torch.bfloat16, device=DEVICE)
    cache = torch.zeros(2, 16, HEAD, dtype=torch.bfloat16, device=DEVICE)
    slots = torch.empty(0, 128, dtype=torch.int32, device=DEVICE)
    valid = torch.empty(0, dtype=torch.int32, device=DEVICE)
    one = torch.ones(1, device=DEVICE)
    o = tsm.sparse_mla_attention(q, cache, slots, valid, KV_LORA, 0.1, one)
    assert o.shape == (0, 16, KV_LORA)


# --------------------------------------------------------------------------------------
# GPU only: GLM-5 shapes, memory safety, CUDA graphs, FlashMLA sparse
# --------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kv", ["model", "fp8"])
def test_glm5_shapes(num_heads, dtype, kv):
    # GLM-5: topk 2048, block 64; one long-context decode (64K), a short request
    # whose context is below topk, and a 4-token speculative/prefill chunk.
    kv_dtype = FP8 if kv == "fp8" else dtype
    case = make_case(
        [1, 1, 4], [65536, 1500, 9000], num_heads, 2048, 64, dtype, kv_dtype, seed=3
    )
    tol = 3e-2 if kv == "fp8" or dtype == torch.bfloat16 else 5e-3
    check(case, num_heads, tol, kv_scale=0.5 if kv == "fp8" else 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [32, 64, 128])
@pytest.mark.parametrize("kv", ["model", "fp8"])
def test_glm5_shapes_small_shared_memory(monkeypatch, num_heads, kv):
    # The launch table of a 99 KiB GPU (SM 8.6/8.9/12.x), run on this one: the
    # same results with the halved key blocks.
    from vllm.platforms import current_platform

    wide = sml.sparse_mla_device(torch.device("cuda"))
    monkeypatch.setattr(type(current_platform), "get_max_shared_memory_per_block",
                        classmethod(lambda cls, device_id=0: 99 * 1024))
    # a cache of its own for this test (the module's keeps this GPU's limits)
    monkeypatch.setattr(sml, "cuda_device", functools.cache(sml.cuda_device.__wrapped__))
    small = sml.sparse_mla_device(torch.device("cuda"))
    assert small == dataclasses.replace(wide, shared_mem=99 * 1024)
    kv_dtype = FP8 if kv == "fp8" else torch.bfloat16
    assert (sml.sparse_mla_launch(small, 1, num_heads, HEAD, KV_LORA, 2048, torch.bfloat16,
                                  kv_dtype).block_n
            < sml.sparse_mla_launch(wide, 1, num_heads, HEAD, KV_LORA, 2048, torch.bfloat16,
                                    kv_dtype).block_n)
    case = make_case(
        [1, 1, 4], [65536, 1500, 9000], num_heads, 2048, 64, torch.bfloat16, kv_dtype, seed=5
    )
    check(case, num_heads, 3e-2, kv_scale=0.5 if kv == "fp8" else 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 64])  # 64: Hopper's warp-specialized tile
def test_memory_safety_edges(num_heads):
    # Slots in the very last cache block, all -1 rows, topk larger than context.
    bs, topk = 64, 2048
    case = make_case([2, 1], [100, 64], num_heads, topk, bs, torch.bfloat16, torch.bfloat16,
                     4)
    nb = case.cache.shape[0]
    case.block_table[1, 0] = nb - 1  # the second request lives in the last block
    case.indices[2] = -1
    case.indices[2, :64] = torch.arange(64, dtype=torch.int32)  # all of it
    case.indices[1] = -1  # a row without any valid entry
    o = check(case, num_heads, 2e-2)
    assert (o[1] == 0).all()
    # A cache that ends exactly at the last block: an out-of-bounds read would
    # fault or bring NaN from a poisoned neighbour, which is placed right after.
    big = torch.full((nb + 1, bs, HEAD), float("nan"), dtype=torch.bfloat16, device="cuda")
    big[:nb] = case.cache
    case.cache = big[:nb]
    check(case, num_heads, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 64])
def test_cuda_graph_capture_and_replay(num_heads):
    # UNIFORM_BATCH capture: the same launch replayed on new data gives eager results.
    case = make_case([1] * 4, [3000, 500, 70, 2048], num_heads, 2048, 64,
                     torch.bfloat16, torch.bfloat16, seed=5)
    eager, _ = run_backend(case, num_heads)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run_backend(case, num_heads)  # warm up (Triton compilation) off-graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed, _ = run_backend(case, num_heads)
    graph.replay()
    torch.testing.assert_close(graphed, eager, rtol=0, atol=0)
    # New queries, cache and indices in the same buffers.
    fresh = make_case([1] * 4, [3000, 500, 70, 2048], num_heads, 2048, 64,
                      torch.bfloat16, torch.bfloat16, seed=6)
    case.q.copy_(fresh.q)
    case.cache.copy_(fresh.cache)
    case.indices.copy_(fresh.indices)
    graph.replay()
    expect, _ = run_backend(case, num_heads)
    torch.testing.assert_close(graphed, expect, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 64, 128])
def test_matches_flashmla_sparse(num_heads):
    flashmla = pytest.importorskip("vllm.v1.attention.ops.flashmla")
    ok, reason = flashmla.is_flashmla_sparse_supported()
    if not ok:
        pytest.skip(reason)
    from vllm.v1.attention.backends.mla.sparse_utils import (
        triton_convert_req_index_to_global_index,
    )

    case = make_case([1, 1, 8], [20000, 900, 5000], num_heads, 2048, 64,
                     torch.bfloat16, torch.bfloat16, seed=7)
    ours, scale = run_backend(case, num_heads)
    slots = triton_convert_req_index_to_global_index(
        case.req_id, case.block_table, case.indices, BLOCK_SIZE=64, NUM_TOPK_TOKENS=2048
    )
    padded = 64 if num_heads <= 64 else 128
    q = torch.zeros(case.q.shape[0], padded, HEAD, dtype=torch.bfloat16, device="cuda")
    q[:, :num_heads] = case.q
    theirs = flashmla.flash_mla_sparse_fwd(
        q, case.cache.view(-1, 1, HEAD), slots.unsqueeze(1), scale, KV_LORA
    )[0][:, :num_heads]
    torch.testing.assert_close(ours, theirs, rtol=1e-2, atol=1e-2)
