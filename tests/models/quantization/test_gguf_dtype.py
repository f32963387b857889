# SPDX-License-Identifier: Apache-2.0
"""GGUF on SM>=100 (Blackwell, incl. SM120 workstation cards): vLLM's GGUF
quantization refuses bfloat16 there, and GLM-5 configs say bfloat16, so
upstream fails at start unless the user passes --dtype float16. The overlay
picks float16 for `dtype="auto"`; an explicit dtype is kept; other GPUs keep
the config's dtype. ModelConfig runs on the CPU with the CUDA platform and its
device capability mocked."""

from unittest.mock import patch

import pytest
import torch

from vllm.config import ModelConfig
from vllm.platforms.interface import DeviceCapability

from cuda_platform import import_cuda_platform

cuda = import_cuda_platform()


def model_config(gguf_path, model_dir, capability, dtype="auto"):
    platform = cuda.CudaPlatform()
    with (
        patch("vllm.platforms.current_platform", platform),
        patch("vllm.config.model.current_platform", platform),
        patch.object(cuda.CudaPlatform, "get_device_capability",
                     classmethod(lambda cls, device_id=0: DeviceCapability(*capability))),
    ):
        return ModelConfig(model=str(gguf_path), hf_config_path=str(model_dir),
                           tokenizer=str(model_dir), quantization="gguf", dtype=dtype)


@pytest.mark.parametrize("capability,expect", [
    ((12, 0), torch.float16), ((10, 0), torch.float16),
    ((9, 0), torch.bfloat16), ((8, 9), torch.bfloat16),
])
def test_auto_dtype(glm5_gguf, capability, expect):
    _, model_dir, gguf_path = glm5_gguf
    assert model_config(gguf_path, model_dir, capability).dtype == expect


def test_explicit_dtype_kept(glm5_gguf):
    _, model_dir, gguf_path = glm5_gguf
    assert model_config(gguf_path, model_dir, (12, 0), dtype="bfloat16").dtype == torch.bfloat16
