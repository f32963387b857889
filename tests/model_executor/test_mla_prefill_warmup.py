# SPDX-License-Identifier: Apache-2.0
"""vllm/model_executor/warmup/mla_prefill_warmup.py: before serving, each distinct MLA
prefill backend runs once as MLA's prefill calls it (new tokens causal, with and without
their log-sum-exp; a chunk of cached context unmasked), here vLLM's FlashAttention
prefill backend as on SM120 (FlashAttention 2, V padded), on a CPU stand-in for
`flash_attn_varlen_func` that checks each call's sequence bounds against its tensors
(and returns the attention they describe, as the kernel would)."""

import importlib
import math
from types import SimpleNamespace

import pytest
import torch

from tests.model_executor.test_token_count_warmup import run_kernel_warmup
from vllm.model_executor.warmup import mla_prefill_warmup as mpw
from vllm.v1.attention.backends import fa_utils

# GLM-5's MLA: 192 + 64 query/key dims, 256 value dims, a 512 latent
GLM = dict(kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256)


def varlen_reference(calls):
    """flash_attn_varlen_func's contract, on the CPU: (total, heads, dim) tensors split
    by cumulative lengths; returns out [, lse] as vLLM's FlashAttention does."""

    def attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             softmax_scale, causal, return_softmax_lse=False, out=None,
             output_scale=None, fa_version=None, **kwargs):
        assert out is None and output_scale is None and not kwargs
        assert q.dtype == k.dtype == v.dtype and q.shape[1:] == k.shape[1:]
        assert v.shape[:2] == k.shape[:2]
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        assert cq[0] == ck[0] == 0 and len(cq) == len(ck)
        assert cq[-1] == q.shape[0] and ck[-1] == k.shape[0]
        assert max_seqlen_q == max(b - a for a, b in zip(cq, cq[1:]))
        assert max_seqlen_k == max(b - a for a, b in zip(ck, ck[1:]))
        calls.append(dict(q=tuple(q.shape), k=tuple(k.shape), v=tuple(v.shape),
                          dtype=q.dtype, causal=causal, lse=return_softmax_lse,
                          fa_version=fa_version))
        outs, lses = [], []
        for (q0, q1), (k0, k1) in zip(zip(cq, cq[1:]), zip(ck, ck[1:])):
            s = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k[k0:k1].float())
            s = s * softmax_scale
            if causal:  # bottom-right aligned, as FlashAttention's
                nq, nk = q1 - q0, k1 - k0
                keep = torch.ones(nq, nk).tril(nk - nq).bool()
                s = s.masked_fill(~keep, -math.inf)
            lses.append(torch.logsumexp(s, -1))
            outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v[k0:k1].float()))
        o = torch.cat(outs).to(q.dtype)
        return (o, torch.cat(lses, 1)) if return_softmax_lse else o

    return attn


@pytest.fixture
def fa2(monkeypatch):
    """vLLM's FlashAttention prefill backend as it builds on SM120: version 2, V padded
    to the query's head dims."""
    # on a CPU platform fa_utils binds none of vllm_flash_attn's names
    monkeypatch.setattr(fa_utils, "compile_flash_attn_varlen_func_from_specs", None,
                        raising=False)
    fa_prefill = importlib.import_module("vllm.v1.attention.backends.mla.prefill.flash_attn")
    calls = []
    monkeypatch.setattr(fa_prefill, "flash_attn_varlen_func", varlen_reference(calls))
    monkeypatch.setattr(fa_prefill, "get_flash_attn_version", lambda **kw: 2)
    monkeypatch.setattr(fa_prefill.current_platform, "get_device_capability",
                        lambda device_id=0: (12, 0))
    monkeypatch.setattr(fa_prefill.current_platform, "is_cuda", lambda: True)

    def make(num_heads, **dims):
        return fa_prefill.FlashAttnPrefillBackend(
            num_heads=num_heads, scale=0.1, vllm_config=None, **dims)

    return make, calls, fa_prefill


def worker(layers, dtype=torch.float16, pooling=False):
    context = {f"model.layers.{i}.self_attn.attn": layer for i, layer in enumerate(layers)}
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=context),
        model_config=SimpleNamespace(dtype=dtype),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        attention_config=SimpleNamespace(use_prefill_query_quantization=False))
    runner = SimpleNamespace(is_pooling_model=pooling, device=torch.device("cpu"))
    return SimpleNamespace(model_runner=runner, vllm_config=config)


def test_each_distinct_backend_runs_both_prefill_kernels(fa2, monkeypatch):
    make, calls, fa_prefill = fa2
    glm = make(8, **GLM)
    smaller = make(4, **GLM)  # fewer heads a rank: another launch shape
    layers = [SimpleNamespace(prefill_backend=b) for b in (glm, make(8, **GLM), smaller)]
    layers.append(SimpleNamespace(prefill_backend=None))  # a sparse layer without one
    layers.append(SimpleNamespace())  # not an MLA layer
    assert glm.requires_v_padding
    # the layers' backends run as they were built (FA2 here), not as a backend built
    # now would be
    monkeypatch.setattr(fa_prefill, "get_flash_attn_version", lambda **kw: 3)

    mpw.mla_prefill_warmup(worker(layers))

    n, m = mpw._WARMUP_QUERY_TOKENS, mpw._WARMUP_CONTEXT_TOKENS
    qk = GLM["qk_nope_head_dim"] + GLM["qk_rope_head_dim"]
    expected = []
    for heads in (8, 4):
        expected += [dict(q=(n, heads, qk), k=(n, heads, qk), v=(n, heads, qk),
                          dtype=torch.float16, causal=True, lse=lse, fa_version=2)
                     for lse in (False, True)]
        expected.append(dict(q=(n, heads, qk), k=(m, heads, qk), v=(m, heads, qk),
                             dtype=torch.float16, causal=False, lse=True, fa_version=2))
    assert calls == expected
    # the layers' own backends hold no warm-up metadata
    assert not hasattr(glm, "_prefill_metadata")


def test_nothing_to_warm(fa2):
    make, calls, _ = fa2
    mpw.mla_prefill_warmup(worker([SimpleNamespace(prefill_backend=None)]))
    mpw.mla_prefill_warmup(worker([SimpleNamespace(prefill_backend=make(8, **GLM))],
                                  pooling=True))
    assert calls == []


def test_a_failing_backend_is_named_and_serving_goes_on(fa2, monkeypatch, caplog):
    make, _, fa_prefill = fa2

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(fa_prefill, "flash_attn_varlen_func", broken)
    layer = SimpleNamespace(prefill_backend=make(8, **GLM))
    with caplog.at_level("WARNING"):
        mpw.mla_prefill_warmup(worker([layer]))
    assert "Skipping the MLA prefill warmup" in caplog.text
    assert "no kernel image" in caplog.text


def test_kernel_warmup_calls_it_last(monkeypatch):
    """Called from vLLM's kernel warm-up (before CUDA graph capture), after upstream's
    CuTeDSL warm-up, which compiles FA4's MLA prefill on SM100: those kernels are
    built by then and the warm-up only runs them."""
    order = []
    w = run_kernel_warmup(monkeypatch, {
        "mla_prefill_warmup": lambda w: order.append(("mla_prefill", w)),
        "cutedsl_warmup": lambda: order.append(("cutedsl",))}, cutedsl=True)
    assert order == [("cutedsl",), ("mla_prefill", w)]


def fatbin_entries(path) -> dict[str, int]:
    """Counts of a shared object's CUDA fat binary entries, "sass sm_80" or "ptx
    compute_80": the ELF's .nv_fatbin section, a run of fat binaries (magic 0xBA55ED50)
    of entries with kind (1 PTX, 2 ELF code), header size, size and arch at 28."""
    import struct
    from collections import Counter

    data = path.read_bytes()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def section(i):
        name, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        return name, offset, size

    _, str_off, _ = section(shstrndx)
    for i in range(shnum):
        name, offset, size = section(i)
        if data[str_off + name:data.index(b"\0", str_off + name)] == b".nv_fatbin":
            break
    else:
        return {}
    counts, pos, end = Counter(), offset, offset + size
    while pos + 16 <= end:
        magic, _, header, body = struct.unpack_from("<IHHQ", data, pos)
        if magic != 0xBA55ED50:
            pos += 8
            continue
        entry, pos = pos + header, pos + header + body
        while entry < pos:
            kind, _, entry_header, entry_size = struct.unpack_from("<HHIQ", data, entry)
            arch, = struct.unpack_from("<I", data, entry + 28)
            counts["ptx compute_%d" % arch if kind == 1 else "sass sm_%d" % arch] += 1
            entry += entry_header + entry_size
    return dict(counts)


def test_flash_attention_2_ships_no_code_past_sm80():
    """Why the warm-up: vLLM's FlashAttention 2, SM120's MLA prefill, holds sm_80 code
    and compute_80 PTX only (the driver compiles it at first launch on SM90 and SM120),
    FlashAttention 3 sm_90 code. Read from the installed wheel's binaries."""
    from pathlib import Path

    import vllm

    fa = Path(vllm.__file__).parent / "vllm_flash_attn"
    fa2, fa3 = fa / "_vllm_fa2_C.abi3.so", fa / "_vllm_fa3_C.abi3.so"
    if not fa2.exists():
        pytest.skip("this vLLM build has no FlashAttention binaries")
    entries = fatbin_entries(fa2)
    assert set(entries) == {"sass sm_80", "ptx compute_80"}, entries
    assert set(fatbin_entries(fa3)) == {"sass sm_90"}
    # the reader reads vLLM's own kernels as built for every GPU family it supports
    own = fatbin_entries(Path(vllm.__file__).parent / "_C_stable_libtorch.abi3.so")
    assert {"sass sm_80", "sass sm_90", "sass sm_120"} <= set(own)
