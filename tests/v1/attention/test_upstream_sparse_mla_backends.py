# SPDX-License-Identifier: Apache-2.0
"""Upstream's sparse MLA backend test, run against TRITON_MLA_SPARSE.

`tests/v1/attention/test_sparse_mla_backends.py` from the pinned vLLM sdist is
imported unmodified; its `test_sparse_backend_decode_correctness` is re-applied
here with every parametrization upstream declares, except that the backend
list is TRITON_MLA_SPARSE. Its reference (SDPA over the dense context with the
sparse mask) and tolerances are upstream's. Since vLLM 0.26 sparse MLA backends
also run short prefills through the shared dense-MHA path
(`SparseMLACommonImpl.forward_mha`); upstream's
`test_sparse_backend_prefill_correctness` checks it on FLASHMLA_SPARSE and is
re-applied here, with its marks, on TRITON_MLA_SPARSE's metadata builder and impl.

Where the upstream files come from: $VLLM_OVERLAY_UPSTREAM_TESTS (a folder that
holds `tests/...` as in the sdist), else the sdist pinned in upstream.lock
(downloaded and cached by `build.py sdist`).

Plumbing the offline GPU host needs, and nothing else:
- `create_vllm_config("deepseek-ai/DeepSeek-V2-Lite-Chat")` reads that model's
  config.json from the Hugging Face hub. A stand-in with DeepSeek-V2-Lite's
  published dimensions is written to a private hub cache; the test overrides
  every MLA dimension it uses.
(Before vLLM 0.26 the FlashInfer sparse backend module that upstream's test
imports needed the flashinfer package and had a stand-in here; it no longer does.)
"""

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest
import torch

import tests.v1.attention

if not torch.cuda.is_available():
    pytest.skip("upstream's sparse MLA test needs a CUDA GPU", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[3]
UPSTREAM_FILES = [
    "tests/v1/attention/test_sparse_mla_backends.py",
    "tests/v1/attention/test_mla_backends.py",
    "tests/v1/attention/utils.py",
]
DEEPSEEK_V2_LITE_CHAT = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "torch_dtype": "bfloat16",
}


def upstream_root() -> Path:
    given = os.environ.get("VLLM_OVERLAY_UPSTREAM_TESTS")
    if given:
        return Path(given)
    sdist = subprocess.run(
        [sys.executable, str(ROOT / "build.py"), "sdist", "-q"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    dest = Path(tempfile.mkdtemp(prefix="vllm-upstream-tests-"))
    with tarfile.open(sdist) as tar:
        prefix = tar.getnames()[0].split("/")[0]
        for rel in UPSTREAM_FILES:
            member = tar.getmember(f"{prefix}/{rel}")
            member.name = rel
            tar.extract(member, dest, filter="data")
    return dest


def offline_hub_cache() -> Path:
    cache = Path(tempfile.mkdtemp(prefix="hf-stand-in-"))
    repo = cache / "models--deepseek-ai--DeepSeek-V2-Lite-Chat"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(DEEPSEEK_V2_LITE_CHAT))
    return cache


if os.environ.get("HF_HUB_OFFLINE") == "1" and "VLLM_OVERLAY_KEEP_HF_CACHE" not in os.environ:
    os.environ["HF_HUB_CACHE"] = str(offline_hub_cache())
    import huggingface_hub.constants as hub_constants

    hub_constants.HF_HUB_CACHE = os.environ["HF_HUB_CACHE"]

# Upstream's files import each other as tests.v1.attention.*, the package this file is in:
# their folder joins it (no file name is in both).
tests.v1.attention.__path__.append(str(upstream_root() / "tests" / "v1" / "attention"))
from tests.v1.attention import test_sparse_mla_backends as upstream  # noqa: E402

from vllm.v1.attention.backends.mla.triton_mla_sparse import (  # noqa: E402
    TritonMLASparseBackend,
)

UPSTREAM_TEST = upstream.test_sparse_backend_decode_correctness
_param_marks = [
    m for m in UPSTREAM_TEST.pytestmark
    if m.name == "parametrize" and m.args[0] != "backend_cls"
]
assert len(_param_marks) == len(UPSTREAM_TEST.pytestmark) - 1, "upstream test changed"
UPSTREAM_PREFILL_TEST = upstream.test_sparse_backend_prefill_correctness
# Its marks: the parametrization and upstream's skip below SM100 (FA4 prefill).
_prefill_marks = list(UPSTREAM_PREFILL_TEST.pytestmark)
assert {m.name for m in _prefill_marks} == {"parametrize", "skipif"}, "upstream test changed"


def _apply(marks):
    def wrap(fn):
        for mark in reversed(marks):
            fn = getattr(pytest.mark, mark.name)(*mark.args, **mark.kwargs)(fn)
        return fn

    return wrap


@pytest.mark.gpu
@pytest.mark.parametrize("backend_cls", [TritonMLASparseBackend], ids=["TritonMLASparse"])
@_apply(_param_marks)
def test_sparse_backend_decode_correctness(
    default_vllm_config,
    dist_init,
    backend_cls,
    batch_name,
    kv_cache_dtype,
    tensor_parallel_size,
    block_size,
    workspace_init,
    q_scale,
    k_scale,
):
    UPSTREAM_TEST(
        default_vllm_config,
        dist_init,
        backend_cls,
        batch_name,
        kv_cache_dtype,
        tensor_parallel_size,
        block_size,
        workspace_init,
        q_scale,
        k_scale,
    )


@pytest.mark.gpu
@_apply(_prefill_marks)
def test_sparse_backend_prefill_correctness(
    default_vllm_config,
    dist_init,
    batch_name,
    kv_cache_dtype,
    workspace_init,
    monkeypatch,
):
    # Upstream's test takes the backend from its module's FlashMLASparseBackend.
    monkeypatch.setattr(upstream, "FlashMLASparseBackend", TritonMLASparseBackend)
    UPSTREAM_PREFILL_TEST(
        default_vllm_config,
        dist_init,
        batch_name,
        kv_cache_dtype,
        workspace_init,
    )
