# SPDX-License-Identifier: Apache-2.0
"""Test hook: make vLLM's CUDA platform report another compute capability.

    pip install --no-deps tests/plugins/vllm_report_capability
    VLLM_TEST_REPORT_CAPABILITY=12.0 VLLM_TEST_REPORT_SHARED_MEM=101376 vllm serve model.gguf

A vLLM general plugin (loaded in every vLLM process). With the variable set, the
CUDA platform's `get_device_capability` returns that capability, so everything
vLLM decides from it (attention backend, DeepGEMM or the portable indexer, GGUF's
fp16 default on SM>=100, ...) is decided as on that GPU, while the kernels run on
the real one. VLLM_TEST_REPORT_SHARED_MEM does the same for the opt-in shared
memory per block (bytes) that the overlay's kernels read to pick their launch
parameters (SM120: 99 KiB = 101376). Used to run the engine "as on SM120" on an
H200; never install it in production. Without the variables it changes nothing.

Kernels built for the reported GPU alone cannot run on the real one: where
vLLM's choice for the reported capability is such a kernel (since vLLM 0.26 a
bf16 DSA model with an fp8 or "auto" KV cache selects FLASHINFER_MLA_SPARSE_SM120
on SM12x), pick what the run is about with flags (e.g. --kv-cache-dtype bfloat16
or --attention-backend TRITON_MLA_SPARSE). DeepGEMM compiles for the device it
runs on, so its choice on SM120 (vLLM 0.26) runs on the H200 as its SM90 kernels.
"""

import os

ENV = "VLLM_TEST_REPORT_CAPABILITY"
SHARED_MEM_ENV = "VLLM_TEST_REPORT_SHARED_MEM"


def register() -> None:
    shared_mem = os.environ.get(SHARED_MEM_ENV)
    if shared_mem:
        report_shared_mem(int(shared_mem))
    value = os.environ.get(ENV)
    if not value:
        return
    major, _, minor = value.partition(".")
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    capability = DeviceCapability(major=int(major), minor=int(minor or 0))
    cls = type(current_platform)
    if getattr(cls, "_reported_capability", None) == capability:
        return
    cls._reported_capability = capability
    cls.get_device_capability = classmethod(lambda c, device_id=0: capability)
    from vllm.v1.attention.ops import triton_sparse_mla

    # the sparse MLA kernel's launch table reads the device's capability itself
    triton_sparse_mla.device_capability = lambda device_index: capability.to_int()
    from vllm.logger import init_logger

    init_logger(__name__).warning(
        "%s=%s: vLLM decides as on compute capability %s (test hook)", ENV, value, capability
    )


def report_shared_mem(nbytes: int) -> None:
    """The overlay's kernels choose tiles as on a GPU with `nbytes` per block (the
    sparse MLA table and the indexer's top-k both read this one function)."""
    from vllm.v1.attention.ops import triton_sparse_mla

    triton_sparse_mla.device_shared_mem = lambda device_index: nbytes
