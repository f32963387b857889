# SPDX-License-Identifier: Apache-2.0
"""vLLM's CUDA platform module, importable on a machine without the CUDA driver."""

import importlib
import sys
import types


def import_cuda_platform():
    """Return `vllm.platforms.cuda`.

    It imports its compiled extensions (vllm._C_stable_libtorch; vllm._C before
    0.24) only to register kernels; they link libcuda.so.1, absent on CPU-only
    machines. Tests that mock the device (capability, selection, configuration) run
    no kernel, so there the extensions are replaced by empty modules; any other
    import error is raised.
    """
    for name in ("vllm._C", "vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch"):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise  # the wheel has it, something it needs is missing
        except ImportError as e:
            if "libcuda" not in str(e):
                raise
            sys.modules[name] = types.ModuleType(name)
    return importlib.import_module("vllm.platforms.cuda")
