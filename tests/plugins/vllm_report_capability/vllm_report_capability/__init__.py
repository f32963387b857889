# SPDX-License-Identifier: Apache-2.0
"""Test hook: make vLLM's CUDA platform report another compute capability.

    pip install --no-deps tests/plugins/vllm_report_capability
    VLLM_TEST_REPORT_CAPABILITY=12.0 vllm serve model.gguf

A vLLM general plugin (loaded in every vLLM process). With the variable set, the
CUDA platform's `get_device_capability` returns that capability, so everything
vLLM decides from it (attention backend, DeepGEMM or the portable indexer, GGUF's
fp16 default on SM>=100, ...) is decided as on that GPU, while the kernels run on
the real one. Used to run the engine "as on SM120" on an H200; never install it
in production. Without the variable it changes nothing.
"""

import os

ENV = "VLLM_TEST_REPORT_CAPABILITY"


def register() -> None:
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
    from vllm.logger import init_logger

    init_logger(__name__).warning(
        "%s=%s: vLLM decides as on compute capability %s (test hook)", ENV, value, capability
    )
