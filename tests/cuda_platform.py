# SPDX-License-Identifier: Apache-2.0
"""vLLM's CUDA platform module, importable on a machine without the CUDA driver."""

import importlib
import sys
import types


def import_cuda_platform():
    """Return `vllm.platforms.cuda`.

    It imports vllm._C and vllm._C_stable_libtorch only to register kernels; both
    link libcuda.so.1, absent on CPU-only machines. Tests that mock the device
    (capability, selection, configuration) run no kernel, so there the two
    extensions are replaced by empty modules; any other import error is raised.
    """
    for name in ("vllm._C", "vllm._C_stable_libtorch"):
        try:
            importlib.import_module(name)
        except ImportError as e:
            if "libcuda" not in str(e):
                raise
            sys.modules[name] = types.ModuleType(name)
    return importlib.import_module("vllm.platforms.cuda")
