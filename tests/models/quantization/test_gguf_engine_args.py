# SPDX-License-Identifier: Apache-2.0
"""`vllm serve <GGUF reference>` up to the model config, on CPU: vLLM's EngineArgs with
the GGUF plugin (vllm-gguf-plugin) and the overlay's glm-dsa hooks in it.

Every form a user names a llama.cpp glm-dsa GGUF by (a file, any part of a split set,
the directory holding it, `local_dir:QUANT`, `org/repo:QUANT` from a Hugging Face cache,
offline) gives, with nothing but the GGUF, the config of its metadata (checked against
the HF checkpoint it was converted from) and its tokenizer (encoding as the HF one),
and the loader finds every part of the set. `--hf-config-path` and `--tokenizer` still
take precedence. dtype `auto` is float16 on compute capability >= 10.0 (bfloat16 GGUF
output was reported wrong on Blackwell), the checkpoint's bfloat16 elsewhere; the CUDA
platform and its capability are mocked.
"""

import shutil
from unittest.mock import patch

import pytest
import torch

from tests.cuda_platform import import_cuda_platform
from tests.models.quantization import gguf_reference as gr
from tests.models.quantization.test_gguf_glm_dsa import CONFIG_FIELDS, TEXTS

cuda = import_cuda_platform()


def model_config(model: str, capability=(9, 0), **kwargs):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms.interface import DeviceCapability

    platform = cuda.CudaPlatform()
    with (patch("vllm.platforms._current_platform", platform),
          patch.object(cuda.CudaPlatform, "get_device_capability",
                       classmethod(lambda cls, device_id=0: DeviceCapability(*capability)))):
        return EngineArgs(model=model, **kwargs).create_model_config()


def weights_file(config, download_dir=None) -> str:
    """The file the plugin's loader opens for this model config (no model is built)."""
    from vllm.config.load import LoadConfig
    from vllm_gguf_plugin.loader import GGUFModelLoader

    return GGUFModelLoader(LoadConfig(load_format="gguf", download_dir=download_dir)
                           )._prepare_weights(config)


@pytest.fixture(scope="module")
def hf_reference(glm5_gguf):
    from transformers import AutoConfig, AutoTokenizer

    _, model, _ = glm5_gguf
    return AutoConfig.from_pretrained(model), AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module")
def hub(glm5_ggufs, tmp_path_factory, monkeypatch_module):
    """An offline Hugging Face cache with the tiny GLM-5 as unsloth lays out a GGUF repo:
    a split Q8_0 in a folder of its own (here the bf16 parts renamed), a single-file F16,
    and a second "UD" variant of F16 for the ambiguity check."""
    import huggingface_hub.constants

    cache = tmp_path_factory.mktemp("hub")
    parts = gr_split_parts(glm5_ggufs)
    files = {f"Q8_0/tiny-glm5-Q8_0-{i:05d}-of-{len(parts):05d}.gguf": p
             for i, p in enumerate(parts, 1)}
    files["tiny-glm5-F16.gguf"] = glm5_ggufs["f16"]
    files["tiny-glm5-UD-BF16.gguf"] = glm5_ggufs["bf16"]
    files["tiny-glm5-BF16.gguf"] = glm5_ggufs["bf16"]
    gr.hf_cache_repo(cache, "org/tiny-glm5-GGUF", files)
    monkeypatch_module.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch_module.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache, parts


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def gr_split_parts(glm5_ggufs):
    from vllm_gguf_plugin.gguf_model import split_files

    return split_files(glm5_ggufs["split"])


def check_from_the_gguf_alone(config, hf_reference, first):
    from vllm.tokenizers import get_tokenizer

    ref_config, ref_tokenizer = hf_reference
    assert config.quantization == "gguf"
    assert config.hf_config_path == str(first) and config.tokenizer == str(first)
    assert config.tokenizer_mode == "glm_dsa_gguf"
    for f in CONFIG_FIELDS:
        assert getattr(config.hf_config, f, None) == getattr(ref_config, f, None), f
    tokenizer = get_tokenizer(config.tokenizer, tokenizer_mode=config.tokenizer_mode)
    for text in TEXTS:
        assert tokenizer.encode(text) == ref_tokenizer.encode(text), text


@pytest.mark.parametrize("form", ["file", "split part", "directory", "local_dir:QUANT"])
def test_local_gguf_alone(glm5_ggufs, hf_reference, tmp_path, form):
    parts = gr_split_parts(glm5_ggufs)
    if form == "file":
        ref, first, expect = glm5_ggufs["q8_0"], glm5_ggufs["q8_0"], [glm5_ggufs["q8_0"]]
    elif form == "split part":
        ref, first, expect = parts[-1], parts[0], parts
    elif form == "directory":
        ref, first, expect = parts[0].parent, parts[0], parts
    else:
        folder = tmp_path / "models"
        (folder / "Q8_0").mkdir(parents=True)
        for i, p in enumerate(parts, 1):
            (folder / "Q8_0" / f"tiny-Q8_0-{i:05d}-of-{len(parts):05d}.gguf").symlink_to(p)
        (folder / "tiny-F16.gguf").symlink_to(glm5_ggufs["f16"])
        ref = f"{folder}:Q8_0"
        first = folder / "Q8_0" / f"tiny-Q8_0-00001-of-{len(parts):05d}.gguf"
        expect = sorted((folder / "Q8_0").iterdir())
    config = model_config(str(ref))
    check_from_the_gguf_alone(config, hf_reference, first)
    from vllm_gguf_plugin.gguf_model import split_files

    assert split_files(weights_file(config)) == [type(first)(p) for p in expect]
    assert config.served_model_name == str(ref)


def test_repo_quant_from_the_hub_cache(hub, hf_reference):
    """`org/repo:Q8_0` offline: the cached snapshot's Q8_0 folder, every part."""
    from vllm_gguf_plugin.gguf_model import split_files

    cache, parts = hub
    config = model_config("org/tiny-glm5-GGUF:Q8_0")
    snapshot = next(cache.glob("models--org--tiny-glm5-GGUF/snapshots/*"))
    first = snapshot / "Q8_0" / f"tiny-glm5-Q8_0-00001-of-{len(parts):05d}.gguf"
    check_from_the_gguf_alone(config, hf_reference, first)
    loaded = split_files(weights_file(config))
    assert [p.name for p in loaded] == [f"tiny-glm5-Q8_0-{i:05d}-of-{len(parts):05d}.gguf"
                                        for i in range(1, len(parts) + 1)]
    assert [p.read_bytes()[:4096] for p in loaded] == [p.read_bytes()[:4096] for p in parts]
    single = model_config("org/tiny-glm5-GGUF:F16")
    assert single.hf_config_path == str(snapshot / "tiny-glm5-F16.gguf")


def test_repo_quant_names_one_model(hub):
    """BF16 names two models there (tiny-glm5-BF16 and tiny-glm5-UD-BF16): an error
    naming both, not a guess; UD-BF16 names one."""
    with pytest.raises(ValueError, match=r"holds 2 GGUF models for quant type 'BF16': "
                                         r"tiny-glm5-BF16 \(1 files\), tiny-glm5-UD-BF16"):
        model_config("org/tiny-glm5-GGUF:BF16")
    assert model_config("org/tiny-glm5-GGUF:UD-BF16").hf_config_path.endswith(
        "tiny-glm5-UD-BF16.gguf")


def test_repo_quant_online_downloads_that_quant_only(monkeypatch, tmp_path):
    """Online, the repo's listing picks the files: the config needs the first part, the
    loader every part of that quant and nothing of another."""
    from vllm_gguf_plugin import weight_utils

    listing = ["README.md", "tiny-UD-Q4_K_M-00001-of-00002.gguf",
               "tiny-UD-Q4_K_M-00002-of-00002.gguf", "Q4_K_M/tiny-Q4_K_M-00001-of-00002.gguf",
               "Q4_K_M/tiny-Q4_K_M-00002-of-00002.gguf", "tiny-Q8_0.gguf"]
    asked = []

    def snapshot_download(repo_id, allow_patterns, **kwargs):
        asked.append(list(allow_patterns))
        return str(tmp_path)

    monkeypatch.setattr("vllm.transformers_utils.repo_utils.list_repo_files",
                        lambda repo_id, revision=None: listing)
    monkeypatch.setattr(weight_utils, "snapshot_download", snapshot_download)
    first = weight_utils.download_gguf("org/tiny", "UD-Q4_K_M", first_part_only=True)
    assert first == str(tmp_path / "tiny-UD-Q4_K_M-00001-of-00002.gguf")
    weight_utils.download_gguf("org/tiny", "q8_0")
    with pytest.raises(ValueError, match="holds 2 GGUF models for quant type 'Q4_K_M'"):
        weight_utils.download_gguf("org/tiny", "Q4_K_M")
    assert asked == [["tiny-UD-Q4_K_M-00001-of-00002.gguf"], ["tiny-Q8_0.gguf"]]
    listing.remove("tiny-UD-Q4_K_M-00002-of-00002.gguf")
    with pytest.raises(ValueError, match=r"split set lacks parts 2 of 2"):
        weight_utils.download_gguf("org/tiny", "UD-Q4_K_M")


def test_hf_checkpoint_named_takes_precedence(glm5_gguf, glm5_ggufs, tmp_path):
    """--hf-config-path / --tokenizer name the checkpoint: the plugin's own behaviour."""
    _, model, _ = glm5_gguf
    edited = tmp_path / "hf"
    shutil.copytree(model, edited, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = gr.config(edited)
    cfg["max_position_embeddings"] = 2048
    (edited / "config.json").write_text(__import__("json").dumps(cfg))
    for kwargs in ({"hf_config_path": str(edited), "tokenizer": str(edited)},
                   {"tokenizer": str(edited)}):
        config = model_config(str(glm5_ggufs["q8_0"]), **kwargs)
        assert config.hf_config.max_position_embeddings == 2048
        assert config.tokenizer == str(edited)


@pytest.mark.parametrize("capability,dtype,expect", [
    ((12, 0), "auto", torch.float16), ((12, 1), "auto", torch.float16),
    ((10, 0), "auto", torch.float16), ((9, 0), "auto", torch.bfloat16),
    ((8, 9), "auto", torch.bfloat16), ((8, 0), "auto", torch.bfloat16),
    ((12, 0), "bfloat16", torch.bfloat16), ((9, 0), "float16", torch.float16),
])
def test_dtype(glm5_ggufs, capability, dtype, expect):
    assert model_config(str(glm5_ggufs["bf16"]), capability, dtype=dtype).dtype == expect


@pytest.mark.parametrize("name", ["VLLM_GGUF_MOE_MARLIN"])
def test_kernel_switch_keys_the_compile_cache(monkeypatch, name):
    """Each GGUF kernel switch is a vLLM environment variable: set one way and the other,
    it gives two torch.compile cache keys (a graph traced with a switch one way runs
    other kernels: a removed dense Marlin switch's graph read marlin_qweight, and loaded
    from the cache without it the engine failed with KeyError), and vLLM's strict
    environment check (--fail-on-environ-validation) accepts it."""
    import os

    from vllm import envs
    from vllm.config.utils import hash_factors
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    for other in [v for v in os.environ
                  if v.startswith("VLLM_") and v not in envs.environment_variables]:
        monkeypatch.delenv(other)  # e.g. the tests' own VLLM_OVERLAY_* settings
    keys = set()
    for value in ("0", "1"):
        monkeypatch.setenv(name, value)
        envs.validate_environ(hard_fail=True)
        keys.add(hash_factors(envs.compile_factors()))
    assert len(keys) == 2
