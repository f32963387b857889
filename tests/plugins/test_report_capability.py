# SPDX-License-Identifier: Apache-2.0
"""The "as on SM120" test hook: with VLLM_TEST_REPORT_CAPABILITY=12.0 and
VLLM_TEST_REPORT_SHARED_MEM=101376 vLLM's CUDA platform reports SM120's capability and
shared memory, and what vLLM and the overlay's kernels decide from them is SM120's;
with VLLM_TEST_REPORT_DEEP_GEMM=0 it reports no DeepGEMM support and the indexer takes
its Triton kernels. The variables set are in vLLM's compile cache key (CPU, no driver)."""

import functools
import os

import pytest

# the plugin's package from its project folder (no package itself: `pip install` takes it)
from tests.plugins.vllm_report_capability import vllm_report_capability as hook


@pytest.fixture
def cuda_platform(monkeypatch):
    from tests.cuda_platform import import_cuda_platform

    cuda = import_cuda_platform()
    platform = cuda.NonNvmlCudaPlatform()
    monkeypatch.setattr("vllm.platforms._current_platform", platform)
    cls = type(platform)
    for name in ("get_device_capability", "get_max_shared_memory_per_block",
                 "support_deep_gemm"):
        monkeypatch.setattr(cls, name, getattr(cls, name))
    # (the hook registers its variables with vLLM's: restored after each test)
    from vllm import envs

    # (an earlier test of the session may have registered them: each test starts without)
    monkeypatch.setattr(envs, "environment_variables",
                        {k: v for k, v in envs.environment_variables.items()
                         if k not in hook.VARIABLES})
    for name in hook.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return platform


def test_reports_the_capability(cuda_platform, monkeypatch):
    from vllm.v1.attention.ops import sparse_mla_launch as sml

    # (imported here after an engine's platform resolved to CUDA: the same object)
    monkeypatch.setattr(sml, "current_platform", cuda_platform)
    monkeypatch.setattr(type(cuda_platform), "num_compute_units",
                        classmethod(lambda cls, device_id=0: 132))  # no GPU here
    monkeypatch.setattr(type(cuda_platform), "get_max_shared_memory_per_block",
                        classmethod(lambda cls, device_id=0: 101376))
    monkeypatch.delenv(hook.SHARED_MEM_ENV, raising=False)
    for name in ("DISABLE_MMA_V3", "DISABLE_MMA_V5"):
        monkeypatch.setenv(name, "")  # (so that the teardown restores what was before)
        monkeypatch.delenv(name)
    monkeypatch.setenv(hook.ENV, "9.0")
    hook.register()
    assert "DISABLE_MMA_V3" not in os.environ  # Hopper's own dots
    monkeypatch.setenv(hook.ENV, "12.0")
    hook.register()
    assert cuda_platform.get_device_capability().to_int() == 120
    # Triton compiles mma.sync dots, as for SM120 (no wgmma, no tcgen05 there)
    assert os.environ["DISABLE_MMA_V3"] == os.environ["DISABLE_MMA_V5"] == "1"
    # the sparse MLA launch table's view (a cache of its own for this test)
    monkeypatch.setattr(sml, "cuda_device", functools.cache(sml.cuda_device.__wrapped__))
    assert sml.cuda_device(0).capability == 120
    assert cuda_platform.has_device_capability(100)
    assert not cuda_platform.is_device_capability(90)
    # the GGUF dtype rule and the indexer choice read it: since vLLM 0.26 the
    # platform supports DeepGEMM on SM120 (support_deep_gemm), whose vendored
    # DeepGEMM has SM120 indexer kernels; as on SM89 the Triton kernels run.
    from vllm.utils.import_utils import has_deep_gemm
    from vllm.v1.attention.ops import triton_indexer_logits as il

    # (imported here after an engine's platform resolved to CUDA: the same object)
    monkeypatch.setattr(il, "current_platform", cuda_platform)
    il.indexer_logits_backend.cache_clear()
    assert cuda_platform.support_deep_gemm()
    assert il.indexer_logits_backend() == ("deepgemm" if has_deep_gemm() else "triton")
    il.indexer_logits_backend.cache_clear()
    monkeypatch.setenv(hook.ENV, "8.9")
    hook.register()
    assert cuda_platform.get_device_capability().to_int() == 89
    sml.cuda_device.cache_clear()
    assert sml.cuda_device(0).capability == 89
    assert il.indexer_logits_backend() == "triton"
    il.indexer_logits_backend.cache_clear()


def test_without_the_variables_nothing_changes(cuda_platform, monkeypatch):
    from vllm import envs

    cls = type(cuda_platform)
    names = ("get_device_capability", "get_max_shared_memory_per_block", "support_deep_gemm")
    before = [getattr(cls, name) for name in names]
    hook.register()
    assert [getattr(cls, name) for name in names] == before
    assert not set(hook.VARIABLES) & set(envs.environment_variables)


def test_reports_no_deep_gemm(cuda_platform, monkeypatch):
    """An H200 (9.0) that reports no DeepGEMM: the indexer's logits on the Triton kernels
    with the fp8 dots its capability has, the q quantization's e4m3 as e4m3; the report
    in the compile cache's key, so a graph compiled without it does not load with it."""
    import torch

    from vllm import envs
    from vllm.platforms.interface import DeviceCapability
    from vllm.utils import import_utils
    from vllm.v1.attention.ops import triton_indexer_logits as il

    cls = type(cuda_platform)
    monkeypatch.setattr(cls, "get_device_capability",
                        classmethod(lambda c, device_id=0: DeviceCapability(9, 0)))
    monkeypatch.setattr(il, "current_platform", cuda_platform)
    monkeypatch.setattr(import_utils, "has_deep_gemm", lambda: True)
    il.indexer_logits_backend.cache_clear()
    assert il.indexer_logits_backend() == "deepgemm"
    without = envs.compile_factors()
    assert hook.indexer_env("deepgemm") == hook.indexer_env("auto") == {}
    for name, value in hook.indexer_env("triton").items():
        monkeypatch.setenv(name, value)
    hook.register()
    il.indexer_logits_backend.cache_clear()
    try:
        assert not cuda_platform.support_deep_gemm()
        assert il.indexer_logits_backend() == "triton"
        assert il.triton_indexer_dots() == "fp8"
        assert not il.deep_gemm_computes(torch.uint8)
    finally:
        il.indexer_logits_backend.cache_clear()
    with_report = envs.compile_factors()
    assert with_report[hook.DEEP_GEMM_ENV] == "0"
    assert hook.DEEP_GEMM_ENV not in without
    # a capability reported is in the key too (the q quantization's stores follow it)
    monkeypatch.setenv(hook.ENV, "8.6")
    monkeypatch.setenv("DISABLE_MMA_V3", "")  # (restored by the teardown)
    monkeypatch.setenv("DISABLE_MMA_V5", "")
    hook.register()
    assert envs.compile_factors()[hook.ENV] == "8.6"
    assert il.triton_indexer_dots() == "16bit"
    monkeypatch.setenv(hook.DEEP_GEMM_ENV, "1")
    with pytest.raises(ValueError, match="only 0"):
        hook.register()
    with pytest.raises(ValueError, match="expected auto, deepgemm or triton"):
        hook.indexer_env("cutlass")


def test_missing_only_where_a_report_is_set(monkeypatch):
    """An engine in other processes sees the report only from the installed plugin."""
    monkeypatch.setattr(hook.importlib.util, "find_spec", lambda name: None)
    assert hook.missing(hook.indexer_env("triton"))
    assert hook.missing({hook.ENV: "12.0"})
    assert not hook.missing({"VLLM_SPARSE_INDEXER_CACHE": "16bit"})
    monkeypatch.setattr(hook.importlib.util, "find_spec", lambda name: object())
    assert not hook.missing(hook.indexer_env("triton"))


def test_reports_shared_memory(cuda_platform, monkeypatch):
    import torch

    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.ops import sparse_mla_launch as sml
    from vllm.v1.attention.ops import triton_indexer_logits as il

    for module in (il, sml):
        monkeypatch.setattr(module, "current_platform", cuda_platform)
    cls = type(cuda_platform)
    monkeypatch.setattr(cls, "num_compute_units", classmethod(lambda c, device_id=0: 132))
    monkeypatch.setattr(cls, "get_device_capability",
                        classmethod(lambda c, device_id=0: DeviceCapability(9, 0)))
    monkeypatch.delenv(hook.ENV, raising=False)
    monkeypatch.setenv(hook.SHARED_MEM_ENV, "101376")
    hook.register()
    assert cuda_platform.get_max_shared_memory_per_block(0) == 101376
    # the persistent top-k kernel needs 128 KiB: not on a 99 KiB GPU
    monkeypatch.setattr("torch.cuda.current_device", lambda: 0)  # no GPU here
    assert not il.use_persistent_topk(2048)

    # sparse_mla_attention's launch table reads it: the 99 KiB tiles
    def block_n():
        # (a cache of its own for each reading)
        monkeypatch.setattr(sml, "cuda_device", functools.cache(sml.cuda_device.__wrapped__))
        device = sml.sparse_mla_device(torch.device("cuda", 0))
        return sml.sparse_mla_launch(device, 1, 64, 576, 512, 2048, torch.bfloat16,
                                     torch.bfloat16).block_n

    assert block_n() == 16
    monkeypatch.setenv(hook.SHARED_MEM_ENV, str(227 * 1024))
    hook.register()
    assert il.use_persistent_topk(2048)
    assert block_n() == 64
