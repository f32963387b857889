# SPDX-License-Identifier: Apache-2.0
"""Test hook: make vLLM's CUDA platform report another GPU's capability, shared memory
and DeepGEMM support.

    pip install --no-deps tests/plugins/vllm_report_capability
    VLLM_TEST_REPORT_CAPABILITY=12.0 VLLM_TEST_REPORT_SHARED_MEM=101376 vllm serve model.gguf
    VLLM_TEST_REPORT_DEEP_GEMM=0 vllm serve model.gguf  # the portable indexer on an H200

A vLLM general plugin (loaded in every vLLM process). With the variable set, the
CUDA platform's `get_device_capability` returns that capability, so everything
vLLM decides from it (attention backend, DeepGEMM or the portable indexer, GGUF's
fp16 default on SM>=100, ...) is decided as on that GPU, while the kernels run on
the real one. VLLM_TEST_REPORT_SHARED_MEM does the same for the platform's
`get_max_shared_memory_per_block`, the opt-in shared memory per block (bytes) by
which the overlay's kernels pick their launch parameters (SM120: 99 KiB = 101376).
VLLM_TEST_REPORT_DEEP_GEMM=0 makes the platform's `support_deep_gemm` false, as on a
GPU DeepGEMM has no kernels for: the sparse attention indexer then computes its logits
on the overlay's Triton kernels (with the dots the capability gives: fp8 from 8.9 on,
16-bit below), which is how benchmarks and tests run that path on an H200.
A reported capability of 8.x or 12.x (tensor cores through mma.sync only) also sets
DISABLE_MMA_V3=1 and DISABLE_MMA_V5=1, so that Triton compiles every kernel's dots as
it does for those GPUs instead of as Hopper's wgmma or SM100's tcgen05 dots (the tiles'
shared memory then matches theirs too; Triton keys its cache on both variables).
All patch the platform, the one place vLLM and the overlay read them from. The
variables set are registered as vLLM environment variables: vLLM keys its torch.compile
cache on those (the indexer's q quantization, traced, follows the capability) and
`--fail-on-environ-validation` refuses other VLLM_ names. Used to run the engine "as
on SM120" on an H200; never install it in production. Without the variables it changes
nothing.

Kernels built for the reported GPU alone cannot run on the real one: where
vLLM's choice for the reported capability is such a kernel (since vLLM 0.26 a
bf16 DSA model with an fp8 or "auto" KV cache selects FLASHINFER_MLA_SPARSE_SM120
on SM12x), pick what the run is about with flags (e.g. --kv-cache-dtype bfloat16
or --attention-backend TRITON_MLA_SPARSE). DeepGEMM compiles for the device it
runs on, so its choice on SM120 (vLLM 0.26) runs on the H200 as its SM90 kernels.
"""

import importlib.util
import os
from collections.abc import Mapping

ENV = "VLLM_TEST_REPORT_CAPABILITY"
SHARED_MEM_ENV = "VLLM_TEST_REPORT_SHARED_MEM"
DEEP_GEMM_ENV = "VLLM_TEST_REPORT_DEEP_GEMM"
VARIABLES = (ENV, SHARED_MEM_ENV, DEEP_GEMM_ENV)


def indexer_env(indexer: str) -> dict[str, str]:
    """The variables that run the sparse attention indexer's logits on `indexer`:
    'triton' (the portable kernels) has the platform report no DeepGEMM support;
    'auto' and 'deepgemm' leave the platform's own choice (DeepGEMM on an H200)."""
    if indexer not in ("auto", "deepgemm", "triton"):
        raise ValueError(f"indexer {indexer!r}: expected auto, deepgemm or triton")
    return {DEEP_GEMM_ENV: "0"} if indexer == "triton" else {}


def missing(env: Mapping[str, str]) -> bool:
    """Whether `env` sets one of the variables and this plugin is not installed: an
    engine in other processes (vLLM's default) loads it from its install alone."""
    return (any(name in env for name in VARIABLES)
            and importlib.util.find_spec("vllm_report_capability") is None)


def use_indexer(indexer: str) -> None:
    """`indexer_env(indexer)` set and the report applied in this process, for an engine
    that runs here (VLLM_ENABLE_V1_MULTIPROCESSING=0): no install needed."""
    os.environ.update(indexer_env(indexer))
    register()


def register() -> None:
    capability, shared_mem = os.environ.get(ENV), os.environ.get(SHARED_MEM_ENV)
    deep_gemm = os.environ.get(DEEP_GEMM_ENV)
    if not (capability or shared_mem or deep_gemm):
        return
    from vllm.logger import init_logger
    from vllm.overlay_switches import register_switches
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    cls = type(current_platform)
    if capability:
        major, _, minor = capability.partition(".")
        reported = DeviceCapability(major=int(major), minor=int(minor or 0))
        cls.get_device_capability = classmethod(lambda c, device_id=0: reported)
        if reported.major in (8, 12):
            os.environ["DISABLE_MMA_V3"] = os.environ["DISABLE_MMA_V5"] = "1"
    if shared_mem:
        nbytes = int(shared_mem)
        cls.get_max_shared_memory_per_block = classmethod(lambda c, device_id=0: nbytes)
    if deep_gemm:
        if deep_gemm.strip() != "0":
            raise ValueError(f"{DEEP_GEMM_ENV}={deep_gemm!r}: only 0 (no DeepGEMM) is a report")
        cls.support_deep_gemm = classmethod(lambda c: False)
    register_switches({name: lambda name=name: os.environ.get(name) for name in VARIABLES})
    init_logger(__name__).warning(
        "%s=%s %s=%s %s=%s: vLLM decides as on that GPU (test hook)", ENV, capability,
        SHARED_MEM_ENV, shared_mem, DEEP_GEMM_ENV, deep_gemm)
