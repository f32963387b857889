# SPDX-License-Identifier: Apache-2.0
"""Sparse MLA backend selection on every CUDA generation, without a GPU.

vLLM's CUDA platform selection runs with a mocked device capability, once as
installed (the overlay's `vllm/platforms/cuda.py`, whose priority lists end in
TRITON_MLA_SPARSE) and once as upstream ships it: `vllm/platforms/cuda.py` of
the vLLM wheel pinned in upstream.lock, loaded as a module of its own. Both
validate the same backend classes, so wherever upstream finds a valid backend
ours must pick the same one, and TRITON_MLA_SPARSE may appear only where
upstream finds none, with one exception: on SM12x it goes ahead of
FLASHINFER_MLA_SPARSE_SM120 while the installed FlashInfer lacks the fixes of
that kernel's livelock (vllm#51921), as the pinned vLLM's FlashInfer does.

The selection depends on what the environment offers (which backend modules
import, FlashAttention's MLA support, FlashInfer's SM120 sparse decode API),
so it runs twice: in this environment, and "as on a GPU host", where those
availability probes report every upstream kernel present.
"""

import functools
import itertools
import sys
import types
import zipfile
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch

from tests.cuda_platform import import_cuda_platform
from tools import upstream
from vllm.config import AttentionConfig
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig

ROOT = Path(__file__).resolve().parents[3]


def _unimportable_backends() -> dict[AttentionBackendEnum, str]:
    """Backends whose module cannot be imported in this environment.

    On a CPU-only machine some backend modules touch the GPU at import time
    (CUTLASS MLA counts SMs) and raise RuntimeError instead of ImportError. The
    selector treats ImportError as "invalid"; `select` below maps these modules
    to ImportError so that the selection walks past them the same way. On a GPU
    host this set is empty.
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


@functools.cache
def upstream_cuda() -> types.ModuleType:
    """`vllm/platforms/cuda.py` of the pinned upstream wheel, as a module of its
    own beside the installed one (same package, so its relative imports and the
    backend registry it validates are the installed ones). Fetched on first use, so
    that importing this module (test_gguf_selfcheck does) needs no package index."""
    lock = upstream.load_lock()
    wheel = upstream.fetch_wheel(lock, upstream.DEFAULT_PLATFORM)
    with zipfile.ZipFile(wheel) as zf:
        source = zf.read("vllm/platforms/cuda.py").decode()
    name = "vllm.platforms._upstream_cuda"
    module = types.ModuleType(name)
    module.__package__ = cuda.__package__
    module.__file__ = f"{wheel}/vllm/platforms/cuda.py"
    sys.modules[name] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


cuda = import_cuda_platform()
UNIMPORTABLE = _unimportable_backends()
CAPABILITIES = [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0), (12, 1)]
KV_DTYPES = ["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_ds_mla"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SPARSE = AttentionBackendEnum.TRITON_MLA_SPARSE
SM120 = AttentionBackendEnum.FLASHINFER_MLA_SPARSE_SM120
FLASHINFER_FIXED = cuda.flashinfer_sparse_mla_sm120_is_fixed  # before any monkeypatch
NO_BACKEND = "ValueError: No valid attention backend"


def selector_config(use_sparse, kv_cache_dtype, use_mla=True, dtype=torch.bfloat16,
                    use_batch_invariant=False):
    return AttentionSelectorConfig(
        head_size=576 if use_mla else 128,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        block_size=None,
        use_mla=use_mla,
        has_sink=False,
        use_sparse=use_sparse,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        attn_type="decoder",
        use_batch_invariant=use_batch_invariant,
    )


def glm5_model_config(index_topk: int = 2048):
    """What the sparse backends read of the model config: GLM-5's MLA dims."""
    hf = SimpleNamespace(
        model_type="glm_moe_dsa",
        index_topk=index_topk,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
    )
    return SimpleNamespace(hf_config=hf, hf_text_config=hf)


def select(platform, capability, config, selected=None, num_heads=64):
    """Backend class path chosen by `platform`, or the ValueError text."""
    capability = DeviceCapability(*capability)
    real_get_class = AttentionBackendEnum.get_class

    def get_class(self):
        if self in UNIMPORTABLE:
            raise ImportError(UNIMPORTABLE[self])
        return real_get_class(self)

    reported = classmethod(lambda cls, device_id=0: capability)
    with (
        # the platform that selects, and the current one that backends consult
        patch.object(platform, "get_device_capability", reported),
        patch.object(cuda.CudaPlatform, "get_device_capability", reported),
        patch.object(AttentionBackendEnum, "get_class", get_class),
    ):
        try:
            return platform.get_attn_backend_cls(selected, config, num_heads)
        except ValueError as e:
            return f"ValueError: {e}"


@pytest.fixture(autouse=True)
def cuda_platform_config():
    """The CUDA platform as current platform, and a default VllmConfig."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with patch("vllm.platforms.current_platform", cuda.CudaPlatform()):
        config = VllmConfig()
        with set_current_vllm_config(config):
            yield config


def as_on_gpu_host(monkeypatch):
    """The availability probes of upstream's sparse backends report their kernels
    present: FlashAttention 3's MLA on SM90, FlashInfer's SM120 sparse decode."""
    from vllm.platforms import current_platform
    from vllm.utils import flashinfer
    from vllm.v1.attention.backends.mla import flashattn_mla_sparse

    monkeypatch.setattr(flashattn_mla_sparse, "flash_attn_supports_mla",
                        lambda: current_platform.is_device_capability_family(90))
    monkeypatch.setattr(flashinfer, "has_flashinfer_sparse_mla_sm120", lambda: True)
    for backend in (AttentionBackendEnum.FLASHMLA_SPARSE,
                    AttentionBackendEnum.FLASH_ATTN_MLA_SPARSE,
                    AttentionBackendEnum.FLASHINFER_MLA_SPARSE,
                    AttentionBackendEnum.FLASHINFER_MLA_SPARSE_SM120):
        assert backend not in UNIMPORTABLE, UNIMPORTABLE[backend]


@pytest.fixture(params=["here", "gpu_host"])
def environment(request, monkeypatch):
    """The backends as this environment offers them, and as on a GPU host."""
    if request.param == "gpu_host":
        as_on_gpu_host(monkeypatch)
    return request.param


def test_upstream_module_is_the_pinned_release():
    import vllm

    assert upstream_cuda().__file__.endswith("/vllm/platforms/cuda.py")
    assert Path(upstream_cuda().__file__).parent.parent.parent.name.startswith(
        f"vllm-{vllm.__version__.split('+')[0]}-")
    assert upstream_cuda().CudaPlatform is not cuda.CudaPlatform


def set_flashinfer_fixed(monkeypatch, fixed: bool) -> None:
    """Whether the installed FlashInfer's SM120 sparse MLA counts as fixed."""
    monkeypatch.setattr(cuda, "flashinfer_sparse_mla_sm120_is_fixed", lambda: fixed)
    cuda._get_backend_priorities.cache_clear()


@pytest.fixture(autouse=True)
def pinned_flashinfer(monkeypatch):
    """Every selection as with the pinned vLLM's FlashInfer (checked below to lack the
    fixes), whatever this environment has installed; tests that want the other
    case set it."""
    set_flashinfer_fixed(monkeypatch, False)
    yield
    cuda._get_backend_priorities.cache_clear()


def flashinfer_pin() -> str:
    """The flashinfer-python version the pinned vLLM wheel requires (==)."""
    lock = upstream.load_lock()
    wheel = upstream.fetch_wheel(lock, upstream.DEFAULT_PLATFORM)
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = zf.read(name).decode()
    pins = [line.split("==", 1)[1].split(";")[0].strip() for line in metadata.splitlines()
            if line.startswith("Requires-Dist: flashinfer-python==")]
    assert len(pins) == 1, pins
    return pins[0]


def test_pinned_flashinfer_lacks_the_sm120_fixes():
    from packaging.version import Version

    assert Version(flashinfer_pin()) < Version(cuda.FLASHINFER_SPARSE_MLA_SM120_FIXED_VERSION)


@pytest.mark.parametrize("installed,fixed", [
    ("0.6.14", False), ("0.6.18", False), ("0.7.0rc1", False), ("0.7.0", True),
    ("0.7.4", True), (None, False)])
def test_flashinfer_sm120_fix_by_version(monkeypatch, installed, fixed):
    from importlib import metadata

    def version(name):
        assert name == "flashinfer-python"
        if installed is None:
            raise metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(metadata, "version", version)
    assert FLASHINFER_FIXED.__wrapped__() is fixed


@pytest.mark.parametrize("capability", CAPABILITIES)
@pytest.mark.parametrize("kv_cache_dtype", [None, *KV_DTYPES])
@pytest.mark.parametrize("num_heads", [8, 64])
@pytest.mark.parametrize("use_mla", [True, False])
@pytest.mark.parametrize("fixed", [False, True])
def test_priority_lists_extend_upstream(monkeypatch, capability, kv_cache_dtype, num_heads,
                                        use_mla, fixed):
    """Our lists are upstream's with TRITON_MLA_SPARSE appended to the MLA ones; on
    SM12x it stands before FLASHINFER_MLA_SPARSE_SM120 unless FlashInfer is fixed."""
    set_flashinfer_fixed(monkeypatch, fixed)
    args = (use_mla, DeviceCapability(*capability), num_heads, kv_cache_dtype)
    ours = cuda._get_backend_priorities(*args)
    theirs = upstream_cuda()._get_backend_priorities(*args)
    assert SPARSE not in theirs
    if not use_mla:
        assert ours == theirs
    elif capability[0] == 12 and not fixed:
        at = theirs.index(SM120)
        assert ours == theirs[:at] + [SPARSE] + theirs[at:]
    else:
        assert ours == theirs + [SPARSE]


SPARSE_CASES = [
    pytest.param(cap, dtype, kv, topk, bi, id=f"sm{cap[0]}{cap[1]}-{dtype}-{kv}-topk{topk}"
                 + ("-batch_invariant" if bi else ""))
    for cap, dtype, kv, topk, bi in itertools.product(
        CAPABILITIES, DTYPES, KV_DTYPES, [2048, 1024], [False, True])
]


@pytest.mark.parametrize("capability,dtype,kv_cache_dtype,index_topk,batch_invariant",
                         SPARSE_CASES)
@pytest.mark.parametrize("num_heads", [8, 64])
def test_sparse_mla_selection(cuda_platform_config, monkeypatch, environment, capability,
                              dtype, kv_cache_dtype, index_topk, batch_invariant, num_heads):
    monkeypatch.setattr(cuda_platform_config, "model_config", glm5_model_config(index_topk))
    config = selector_config(True, kv_cache_dtype, dtype=DTYPES[dtype],
                             use_batch_invariant=batch_invariant)
    ours = select(cuda.CudaPlatform, capability, config, num_heads=num_heads)
    theirs = select(upstream_cuda().CudaPlatform, capability, config, num_heads=num_heads)
    reasons = SPARSE.get_class().validate_configuration(
        device_capability=DeviceCapability(*capability), **config._asdict())
    if theirs == SM120.get_path() and not reasons:
        # FlashInfer's SM120 kernel without its livelock fixes: ours goes first.
        assert ours == SPARSE.get_path()
        return
    if not theirs.startswith("ValueError"):
        # An upstream backend is valid: it keeps its place.
        assert ours == theirs
        return
    assert theirs.startswith(NO_BACKEND)
    # Upstream has none: TRITON_MLA_SPARSE, wherever it is valid itself.
    if reasons:
        assert ours.startswith(NO_BACKEND)
        assert kv_cache_dtype == "fp8_ds_mla" or (
            kv_cache_dtype.startswith("fp8") and capability < (8, 9)), reasons
    else:
        assert ours == SPARSE.get_path()


def _gpu_host_expectation(capability, dtype, kv, index_topk, batch_invariant):
    """Who runs sparse MLA on a GPU host with every upstream kernel installed (and
    the pinned FlashInfer): 'upstream' (one of 0.26's sparse backends, which upstream
    picks too), 'ours' or 'none'; 'ours' over upstream's on SM12x."""
    major = capability[0]
    if batch_invariant or major == 8:
        # None of upstream's sparse backends is batch invariant or runs on SM8x.
        upstream = False
    elif major == 9:
        # FLASH_ATTN_MLA_SPARSE: fp16/bf16 with a 16-bit cache; FLASHMLA_SPARSE:
        # bf16 with fp8 (stored as fp8_ds_mla) or a 16-bit cache.
        upstream = kv in ("auto", "bfloat16", "float16") or (
            dtype == "bf16" and kv in ("fp8", "fp8_ds_mla"))
    elif major == 10:
        # FLASHINFER_MLA_SPARSE: fp16/bf16, a 16-bit or fp8 cache;
        # FLASHMLA_SPARSE: bf16 with fp8_ds_mla too.
        upstream = kv != "fp8_ds_mla" or dtype == "bf16"
    else:
        # FLASHINFER_MLA_SPARSE_SM120: bf16, fp8 stored as fp8_ds_mla, top-k 2048;
        # without its livelock fixes, only where ours cannot run (fp8_ds_mla).
        upstream = (dtype == "bf16" and index_topk == 2048
                    and kv in ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla"))
        if upstream and kv != "fp8_ds_mla":
            return "ours over upstream"
    if upstream:
        return "upstream"
    fp8_without_hw = kv.startswith("fp8") and capability < (8, 9)
    return "none" if kv == "fp8_ds_mla" or fp8_without_hw else "ours"


@pytest.mark.parametrize("capability,dtype,kv_cache_dtype,index_topk,batch_invariant",
                         SPARSE_CASES)
def test_sparse_mla_selection_on_gpu_hosts(cuda_platform_config, monkeypatch, capability,
                                           dtype, kv_cache_dtype, index_topk,
                                           batch_invariant):
    """Where TRITON_MLA_SPARSE runs on real GPUs: fp16 activations, a 16-bit or
    fp8_e4m3 cache where upstream's backends want fp8_ds_mla or bf16, index_topk
    other than 2048 (SM12x), VLLM_BATCH_INVARIANT, and SM80/86/89."""
    as_on_gpu_host(monkeypatch)
    monkeypatch.setattr(cuda_platform_config, "model_config", glm5_model_config(index_topk))
    config = selector_config(True, kv_cache_dtype, dtype=DTYPES[dtype],
                             use_batch_invariant=batch_invariant)
    ours = select(cuda.CudaPlatform, capability, config)
    theirs = select(upstream_cuda().CudaPlatform, capability, config)
    expect = _gpu_host_expectation(capability, dtype, kv_cache_dtype, index_topk,
                                   batch_invariant)
    if expect == "upstream":
        assert not theirs.startswith("ValueError") and ours == theirs
    elif expect == "ours over upstream":
        assert theirs == SM120.get_path() and ours == SPARSE.get_path()
    else:
        assert theirs.startswith(NO_BACKEND)
        if expect == "ours":
            assert ours == SPARSE.get_path()
        else:
            assert ours.startswith(NO_BACKEND)


@pytest.mark.parametrize("capability", CAPABILITIES)
@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_mla", [True, False])
def test_dense_selection_unchanged(environment, capability, kv_cache_dtype, dtype, use_mla):
    config = selector_config(False, kv_cache_dtype, use_mla=use_mla, dtype=DTYPES[dtype])
    ours = select(cuda.CudaPlatform, capability, config)
    theirs = select(upstream_cuda().CudaPlatform, capability, config)
    if theirs.startswith(NO_BACKEND):
        # (our message lists TRITON_MLA_SPARSE's reasons as well)
        assert ours.startswith(NO_BACKEND)
    else:
        assert ours == theirs
    assert ours != SPARSE.get_path()


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_forced_backend_everywhere(capability):
    backend = AttentionConfig(backend="TRITON_MLA_SPARSE").backend
    assert backend is SPARSE
    ours = select(cuda.CudaPlatform, capability, selector_config(True, "auto"),
                  selected=backend)
    assert ours == SPARSE.get_path()


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_batch_invariant_selection(environment, capability):
    """VLLM_BATCH_INVARIANT: no upstream sparse backend supports it, so sparse MLA
    runs on TRITON_MLA_SPARSE on every generation."""
    config = selector_config(True, "auto", use_batch_invariant=True)
    assert SPARSE.get_class().supports_batch_invariance()
    for backend in (AttentionBackendEnum.FLASHMLA_SPARSE,
                    AttentionBackendEnum.FLASH_ATTN_MLA_SPARSE,
                    AttentionBackendEnum.FLASHINFER_MLA_SPARSE,
                    AttentionBackendEnum.FLASHINFER_MLA_SPARSE_SM120):
        assert not backend.get_class().supports_batch_invariance(), backend
    assert select(cuda.CudaPlatform, capability, config) == SPARSE.get_path()
    assert select(upstream_cuda().CudaPlatform, capability, config).startswith(NO_BACKEND)


@pytest.mark.parametrize("capability", [(12, 0), (12, 1)])
@pytest.mark.parametrize("fixed", [False, True])
def test_sm12x_flashinfer_when_named_or_fixed(cuda_platform_config, monkeypatch, capability,
                                              fixed):
    """GLM-5 in bf16 on SM12x (as on a GPU host): TRITON_MLA_SPARSE while FlashInfer
    lacks the fixes, FlashInfer's kernel once it has them, and FlashInfer's kernel
    whenever it is named (--attention-backend)."""
    as_on_gpu_host(monkeypatch)
    set_flashinfer_fixed(monkeypatch, fixed)
    monkeypatch.setattr(cuda_platform_config, "model_config", glm5_model_config())
    for kv in ("auto", "fp8"):
        config = selector_config(True, kv)
        chosen = select(cuda.CudaPlatform, capability, config)
        assert chosen == (SM120 if fixed else SPARSE).get_path(), kv
        assert select(cuda.CudaPlatform, capability, config, selected=SM120) == \
            SM120.get_path()
    # fp8_ds_mla is FlashInfer's layout alone: it stays there
    assert select(cuda.CudaPlatform, capability, selector_config(True, "fp8_ds_mla")) == \
        SM120.get_path()


def test_forced_backend_rejects_dense_model():
    ours = select(cuda.CudaPlatform, (12, 0), selector_config(False, "auto"), selected=SPARSE)
    assert ours.startswith("ValueError") and "sparse" in ours


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_validate_configuration(cuda_platform_config, monkeypatch, capability):
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
    # Block sizes the KV cache may use with a 64-token kernel block.
    assert not backend.validate_configuration(**{**glm5, "block_size": 128})
    # What it must refuse, everywhere.
    for change in (
        {"use_sparse": False},
        {"head_size": 512},
        {"dtype": torch.float32},
        {"kv_cache_dtype": "fp8_ds_mla"},
        {"block_size": 16},
        {"use_mla": False},
        {"use_non_causal": True},
        {"has_sliding_window": True},
    ):
        assert backend.validate_configuration(**{**glm5, **change}), change
    # An index_topk the index conversion kernel cannot tile.
    monkeypatch.setattr(cuda_platform_config, "model_config", glm5_model_config(2000))
    assert backend.validate_configuration(**glm5) == [
        "index_topk (2000) must be a multiple of 128"]


@pytest.mark.parametrize("deep_gemm", [True, False])
def test_indexer_layer_with_16bit_keys(cuda_platform_config, monkeypatch, deep_gemm):
    """VLLM_SPARSE_INDEXER_CACHE=16bit on an H200 (capability 9.0): an indexer layer
    whose cache holds 16-bit keys starts on the Triton kernels with or without DeepGEMM
    (a layer of fp8 keys needs it where it is the backend), and refuses a float32
    cache."""
    from vllm.model_executor.layers import sparse_attn_indexer as sai
    from vllm.model_executor.layers import sparse_attn_indexer_key_cache as kc
    from vllm.v1.attention.ops import triton_indexer_logits as il

    platform = cuda.CudaPlatform()
    monkeypatch.setattr(cuda.CudaPlatform, "get_device_capability",
                        classmethod(lambda cls, device_id=0: DeviceCapability(9, 0)))
    monkeypatch.setattr(il, "current_platform", platform)
    monkeypatch.setattr(kc, "current_platform", platform)
    monkeypatch.setattr(kc, "has_deep_gemm", lambda: deep_gemm)
    monkeypatch.setenv(il.CACHE_ENV, "16bit")

    def layer(dtype):
        return sai.SparseAttnIndexer(SimpleNamespace(prefix="layers.0.indexer.k_cache",
                                                     dtype=dtype),
                                     128, "ue8m0", 2048, 128, 4096, 8192,
                                     torch.full((8, 2048), -1, dtype=torch.int32))

    # (DeepGEMM the backend of fp8 keys, as vLLM's auto choice on an H200)
    monkeypatch.setattr(il, "indexer_logits_backend", lambda: "deepgemm")
    for dtype in (torch.bfloat16, torch.float16):
        layer(dtype)
    if not deep_gemm:
        with pytest.raises(RuntimeError, match="requires DeepGEMM"):
            layer(torch.uint8)
    with pytest.raises(ValueError, match="float16 or bfloat16 model; this one is"):
        layer(torch.float32)


@pytest.mark.parametrize("capability,shared_mem", [((8, 0), 163 * 1024), ((8, 6), 99 * 1024)])
def test_glm5_on_sm8x_without_flags(cuda_platform_config, monkeypatch, capability, shared_mem):
    """GLM-5 on A100/A800 (SM80) and RTX 3090/A6000 (SM86), as on a GPU host: sparse
    MLA on TRITON_MLA_SPARSE with a 16-bit cache (an fp8 one refused with its
    reason), the Triton indexer with 16-bit dots, which the indexer layer accepts
    at start, and the decode top-k kernel that fits the GPU's shared memory."""
    from vllm.model_executor.layers import sparse_attn_indexer as sai
    from vllm.model_executor.layers import sparse_attn_indexer_key_cache as kc
    from vllm.v1.attention.ops import triton_indexer_logits as il

    as_on_gpu_host(monkeypatch)
    monkeypatch.setattr(cuda_platform_config, "model_config", glm5_model_config())
    for dtype, kv in itertools.product(DTYPES, ("auto", "bfloat16", "float16")):
        config = selector_config(True, kv, dtype=DTYPES[dtype])
        assert select(cuda.CudaPlatform, capability, config) == SPARSE.get_path()
    for kv in ("fp8", "fp8_e4m3"):
        refused = select(cuda.CudaPlatform, capability, selector_config(True, kv))
        assert refused.startswith(NO_BACKEND)
        assert "fp8 KV cache needs compute capability 8.9 or newer" in refused

    platform = cuda.CudaPlatform()
    reported = classmethod(lambda cls, device_id=0: DeviceCapability(*capability))
    monkeypatch.setattr(cuda.CudaPlatform, "get_device_capability", reported)
    monkeypatch.setattr(il, "current_platform", platform)
    monkeypatch.setattr(kc, "current_platform", platform)
    monkeypatch.setattr("vllm.utils.import_utils.has_deep_gemm", lambda: True)
    monkeypatch.setattr(kc, "has_deep_gemm", lambda: True)
    il.indexer_logits_backend.cache_clear()
    try:
        assert il.indexer_logits_backend() == "triton"
        assert il.triton_indexer_dots() == "16bit" and il.e4m3_as_bytes()
        # the indexer layer's start-up check (it refused SM8x before)
        indexer = sai.SparseAttnIndexer(SimpleNamespace(prefix="layers.0.indexer.k_cache",
                                                        dtype=torch.uint8),
                                        128, "ue8m0", 2048, 128, 4096, 8192,
                                        torch.full((8, 2048), -1, dtype=torch.int32))
        assert indexer.topk_tokens == 2048
    finally:
        il.indexer_logits_backend.cache_clear()
    # decode top-k: persistent_topk where its 128 KiB plan fits (SM80's 163 KiB),
    # top_k_per_row_decode on SM86's 99 KiB; cooperative_topk needs SM90 (upstream)
    monkeypatch.setattr(cuda.CudaPlatform, "get_max_shared_memory_per_block",
                        classmethod(lambda cls, device_id=0: shared_mem))
    monkeypatch.setattr("torch.cuda.current_device", lambda: 0)
    assert il.use_persistent_topk(2048) == (capability == (8, 0))
    assert not platform.has_device_capability(90)


# --------------------------------------------------------------------------------------
# The README's support table is this selection (generated from it, checked against it)
# --------------------------------------------------------------------------------------
# a row of several GPUs holds what each of them selects (checked to be the same)
README_GPUS = [("SM80, SM86", [(8, 0), (8, 6)]), ("SM89", [(8, 9)]), ("SM90", [(9, 0)]),
               ("SM100", [(10, 0)]), ("SM120, SM121", [(12, 0), (12, 1)])]
README_COLUMNS = [("bf16", "auto"), ("bf16", "fp8"), ("fp16", "auto"), ("fp16", "fp8")]


def readme_table(monkeypatch, config) -> list[str]:
    """GLM-5's sparse MLA backend (64 heads, top-k 2048) for bf16/fp16 activations with a
    16-bit or an fp8 KV cache, and the indexer's logits, on a GPU host of each kind."""
    from vllm.v1.attention.ops import triton_indexer_logits as il

    as_on_gpu_host(monkeypatch)
    set_flashinfer_fixed(monkeypatch, False)  # the pin's FlashInfer (checked above)
    monkeypatch.setattr(config, "model_config", glm5_model_config())
    monkeypatch.setattr("vllm.utils.import_utils.has_deep_gemm", lambda: True)
    monkeypatch.setattr(il, "current_platform", cuda.CudaPlatform())
    rows = ["| GPU | bf16, 16-bit KV | bf16, fp8 KV | fp16, 16-bit KV | fp16, fp8 KV | indexer |",
            "|---|---|---|---|---|---|"]
    for name, capabilities in README_GPUS:
        cells = {tuple(readme_cells(il, capability)) for capability in capabilities}
        assert len(cells) == 1, (name, cells)
        rows.append(f"| {name} | " + " | ".join(cells.pop()) + " |")
    return rows


def readme_cells(il, capability) -> list[str]:
    """A README row's cells for one GPU: the backend of each column, the indexer."""
    cells = []
    for dtype, kv in README_COLUMNS:
        chosen = select(cuda.CudaPlatform, capability,
                        selector_config(True, kv, dtype=DTYPES[dtype]))
        cells.append("-" if chosen.startswith("ValueError") else next(
            b.name for b in AttentionBackendEnum if b.value and b.get_path() == chosen))
    reported = classmethod(lambda cls, device_id=0: DeviceCapability(*capability))
    with patch.object(cuda.CudaPlatform, "get_device_capability", reported):
        il.indexer_logits_backend.cache_clear()
        indexer = "DeepGEMM"
        if il.indexer_logits_backend() == "triton":
            try:
                il.check_triton_indexer_supported()
                dots = {"fp8": "fp8", "16bit": "16-bit"}[il.triton_indexer_dots()]
                indexer = f"Triton, {dots} dots (ours)"
            except RuntimeError:
                indexer = "refused"
    il.indexer_logits_backend.cache_clear()
    return cells + [indexer]


def test_readme_selection_table(cuda_platform_config, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    begin, end = "<!-- selection: begin -->\n", "<!-- selection: end -->"
    assert begin in readme and end in readme, "README lacks the selection table markers"
    table = readme.split(begin, 1)[1].split(end, 1)[0].strip().splitlines()
    expect = readme_table(monkeypatch, cuda_platform_config)
    assert table == expect, "README's selection table is stale; it should read:\n" + \
        "\n".join(expect)
