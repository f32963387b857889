# SPDX-License-Identifier: Apache-2.0
"""Sparse MLA backend selection on every CUDA generation, without a GPU.

The CUDA platform's selection runs with a mocked device capability. The
reference for "nothing else changed" is the same selection with
TRITON_MLA_SPARSE removed from the priority lists, i.e. upstream's lists.
"""

from unittest.mock import patch

import pytest
import torch

from vllm.config import AttentionConfig
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig

from cuda_platform import import_cuda_platform


def _unimportable_backends() -> dict[AttentionBackendEnum, str]:
    """Backends whose module cannot be imported in this environment.

    On a CPU-only machine some backend modules touch the GPU at import time
    (FlashInfer MLA allocates a CUDA workspace, CUTLASS MLA counts SMs) and
    raise RuntimeError instead of ImportError. The selector treats ImportError
    as "invalid"; `select` below maps these modules to ImportError so that the
    selection walks past them the same way. On a GPU host this set is empty.
    """
    broken = {}
    for backend in AttentionBackendEnum:
        if not backend.value:
            continue
        try:
            backend.get_class()
        except Exception as e:  # noqa: BLE001 - any import-time failure
            broken[backend] = f"{type(e).__name__}: {e}"
    return broken


cuda = import_cuda_platform()
CudaPlatform = cuda.CudaPlatform
UNIMPORTABLE = _unimportable_backends()
CAPABILITIES = [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0), (12, 1)]
NATIVE_SPARSE_MAJORS = {9, 10}
KV_DTYPES = ["auto", "bfloat16", "fp8"]
SPARSE = AttentionBackendEnum.TRITON_MLA_SPARSE


def selector_config(use_sparse: bool, kv_cache_dtype: str, use_mla: bool = True):
    return AttentionSelectorConfig(
        head_size=576 if use_mla else 128,
        dtype=torch.bfloat16,
        kv_cache_dtype=kv_cache_dtype,
        block_size=None,
        use_mla=use_mla,
        has_sink=False,
        use_sparse=use_sparse,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        attn_type="decoder",
    )


def select(capability, config, selected=None, num_heads=64, upstream=False):
    """Backend class path chosen by CudaPlatform, or the ValueError text."""
    cuda._get_backend_priorities.cache_clear()
    original = cuda._get_backend_priorities.__wrapped__

    def priorities(*args, **kwargs):
        backends = original(*args, **kwargs)
        return [b for b in backends if b != SPARSE] if upstream else backends

    real_get_class = AttentionBackendEnum.get_class

    def get_class(self):
        if self in UNIMPORTABLE:
            raise ImportError(UNIMPORTABLE[self])
        return real_get_class(self)

    with (
        patch.object(
            CudaPlatform,
            "get_device_capability",
            classmethod(lambda cls, device_id=0: DeviceCapability(*capability)),
        ),
        patch.object(cuda, "_get_backend_priorities", priorities),
        patch.object(AttentionBackendEnum, "get_class", get_class),
    ):
        try:
            return CudaPlatform.get_attn_backend_cls(selected, config, num_heads)
        except ValueError as e:
            return f"ValueError: {e}"


@pytest.fixture(autouse=True)
def cuda_platform_config():
    """The CUDA platform as current platform, and a default VllmConfig."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with patch("vllm.platforms.current_platform", CudaPlatform()):
        config = VllmConfig()
        with set_current_vllm_config(config):
            yield config


def test_sparse_backends_importable():
    # The sparse selection below is exact only if every sparse backend's class
    # can be validated here; dense ones may be missing on a CPU-only machine.
    # FlashInfer's needs the flashinfer package (a vLLM dependency, but absent
    # on the offline GPU host, where SM100 is not selectable anyway).
    import importlib.util

    required = [SPARSE, AttentionBackendEnum.FLASHMLA_SPARSE]
    if importlib.util.find_spec("flashinfer") is not None:
        required.append(AttentionBackendEnum.FLASHINFER_MLA_SPARSE)
    for backend in required:
        assert backend not in UNIMPORTABLE, UNIMPORTABLE[backend]


@pytest.mark.parametrize("capability", CAPABILITIES)
@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
@pytest.mark.parametrize("num_heads", [8, 64])
def test_sparse_mla_selection(capability, kv_cache_dtype, num_heads):
    config = selector_config(True, kv_cache_dtype)
    ours = select(capability, config, num_heads=num_heads)
    before = select(capability, config, num_heads=num_heads, upstream=True)
    fp8_without_hw = kv_cache_dtype == "fp8" and capability < (8, 9)

    if capability[0] not in NATIVE_SPARSE_MAJORS:
        # Upstream has no sparse MLA backend here at all.
        assert before.startswith("ValueError: No valid attention backend")
        if fp8_without_hw:
            assert ours.startswith("ValueError: No valid attention backend")
            assert "fp8 KV cache needs compute capability 8.9" in ours
        else:
            assert ours == SPARSE.get_path()
    elif not before.startswith("ValueError"):
        # A native sparse backend is valid: it keeps its place.
        assert ours == before
        assert ours != SPARSE.get_path()
    else:
        # Native ones unusable in this environment (e.g. not importable):
        # the portable backend is the fallback, as on the other generations.
        assert ours == SPARSE.get_path()


@pytest.mark.parametrize("capability", CAPABILITIES)
@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
@pytest.mark.parametrize("use_mla", [True, False])
def test_dense_selection_unchanged(capability, kv_cache_dtype, use_mla):
    config = selector_config(False, kv_cache_dtype, use_mla=use_mla)
    ours = select(capability, config)
    assert ours == select(capability, config, upstream=True)
    assert ours != SPARSE.get_path()


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_forced_backend_everywhere(capability):
    backend = AttentionConfig(backend="TRITON_MLA_SPARSE").backend
    assert backend is SPARSE
    ours = select(capability, selector_config(True, "auto"), selected=backend)
    assert ours == SPARSE.get_path()


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_batch_invariant_selection(capability):
    """VLLM_BATCH_INVARIANT: FlashMLA-sparse refuses it, so sparse MLA runs on
    TRITON_MLA_SPARSE on every generation (upstream has no valid backend)."""
    config = selector_config(True, "auto")._replace(use_batch_invariant=True)
    assert SPARSE.get_class().supports_batch_invariance()
    assert not AttentionBackendEnum.FLASHMLA_SPARSE.get_class().supports_batch_invariance()
    assert select(capability, config) == SPARSE.get_path()
    assert select(capability, config, upstream=True).startswith(
        "ValueError: No valid attention backend")


def test_forced_backend_rejects_dense_model():
    ours = select((12, 0), selector_config(False, "auto"), selected=SPARSE)
    assert ours.startswith("ValueError") and "sparse" in ours


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_validate_configuration(capability):
    backend = SPARSE.get_class()
    assert backend.get_name() == "TRITON_MLA_SPARSE"
    assert backend.is_mla() and backend.is_sparse()
    glm5 = dict(
        head_size=576,
        dtype=torch.bfloat16,
        kv_cache_dtype="auto",
        block_size=64,
        use_mla=True,
        has_sink=False,
        use_sparse=True,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        device_capability=DeviceCapability(*capability),
        attn_type="decoder",
    )
    for dtype in (torch.float16, torch.bfloat16):
        for kv in ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3"):
            reasons = backend.validate_configuration(
                **{**glm5, "dtype": dtype, "kv_cache_dtype": kv}
            )
            expect_fp8_refusal = kv.startswith("fp8") and capability < (8, 9)
            assert bool(reasons) == expect_fp8_refusal, (dtype, kv, reasons)
    # What it must refuse, everywhere.
    for change in (
        {"use_sparse": False},
        {"head_size": 512},
        {"dtype": torch.float32},
        {"kv_cache_dtype": "fp8_ds_mla"},
        {"block_size": 16},
        {"use_mla": False},
    ):
        assert backend.validate_configuration(**{**glm5, **change}), change
