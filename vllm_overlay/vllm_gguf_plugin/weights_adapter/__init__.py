# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project

from .base import BaseGGUFWeightsAdapter
from .checked import CheckedGGUFWeightsAdapter  # overlay: the default, files checked
from .default import GGUFWeightsAdapter
from .diffusion import (
    DiffusionGGUFAdapter,
    Flux2KleinDiffusionGGUFAdapter,
    QwenImageDiffusionGGUFAdapter,
    ZImageDiffusionGGUFAdapter,
    get_diffusion_gguf_adapter,
)
from .gemma3 import Gemma3GGUFAdapter
from .glm_dsa import GlmDsaGGUFAdapter  # overlay: GLM-5 (llama.cpp glm-dsa)

_ADAPTER_REGISTRY: list[type[GGUFWeightsAdapter]] = [
    Gemma3GGUFAdapter,
    GlmDsaGGUFAdapter,  # overlay: GLM-5 (llama.cpp glm-dsa)
]


def get_weights_adapter(config) -> GGUFWeightsAdapter:
    """Return the adapter for *config*, falling back to the default."""
    for cls in _ADAPTER_REGISTRY:
        if cls.matches(config):
            return cls(config)
    # overlay: the default adapter, refusing files whose tensors are not the model's
    return CheckedGGUFWeightsAdapter(config)


__all__ = [
    "BaseGGUFWeightsAdapter",
    "CheckedGGUFWeightsAdapter",  # overlay: the default, files checked
    "DiffusionGGUFAdapter",
    "Flux2KleinDiffusionGGUFAdapter",
    "GGUFWeightsAdapter",
    "Gemma3GGUFAdapter",
    "GlmDsaGGUFAdapter",  # overlay: GLM-5 (llama.cpp glm-dsa)
    "QwenImageDiffusionGGUFAdapter",
    "ZImageDiffusionGGUFAdapter",
    "get_diffusion_gguf_adapter",
    "get_weights_adapter",
]
