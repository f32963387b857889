# SPDX-License-Identifier: Apache-2.0

from functools import wraps
from pathlib import Path

import vllm.engine.arg_utils as arg_utils_module
import vllm.transformers_utils.config as config_module
from vllm.config.load import LoadConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.logger import init_logger  # overlay: the dtype default's log line
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.model_loader import (
    _LOAD_FORMAT_TO_MODEL_LOADER,
    get_model_loader,
    register_model_loader,
)
from vllm.transformers_utils.config import get_config_parser, register_config_parser

from .gguf_model import (  # overlay: GLM-5 GGUF alone
    TOKENIZER_MODE,
    first_file,
    is_glm_dsa_gguf,
    register_tokenizer_mode,
    resolve_gguf_dir,
)
from .gguf_model.config_parser import GlmDsaGGUFConfigParser  # overlay: GLM-5 GGUF
from .gguf_utils import check_gguf_file, is_gguf, is_remote_gguf, split_remote_gguf
from .gguf_utils import is_local_gguf_quant  # overlay: glm-dsa config source
from .loader import GGUFModelLoader
from .quantization import DiffusionGGUFConfig, GGUFConfig
from .weight_utils import download_gguf, resolve_local_gguf  # overlay: glm-dsa source
from .weights_adapter import _ADAPTER_REGISTRY  # overlay: adapters registered
from .weights_adapter.checked import CheckedGGUFWeightsAdapter  # overlay: default
from .weights_adapter.diffusion.integration import _patch_diffusers_loader
from .weights_adapter.glm_dsa import GlmDsaGGUFAdapter  # overlay: GLM-5 (glm-dsa)

OOTGGUFConfig = GGUFConfig
OOTGGUFModelLoader = GGUFModelLoader
logger = init_logger(__name__)  # overlay: the dtype default's log line


def _is_gguf_reference(model: str | None) -> bool:
    if not model:
        return False
    return model.endswith(".gguf") or is_remote_gguf(model) or is_gguf(model)


def _get_gguf_config_source(
    model: str,
    tokenizer: str | None,
    hf_config_path: str | None,
) -> str:
    if hf_config_path is not None:
        return hf_config_path
    if tokenizer is not None and not _is_gguf_reference(tokenizer):
        return tokenizer
    if is_remote_gguf(model):
        repo_id, _ = split_remote_gguf(model)
        return repo_id
    if check_gguf_file(model):
        return str(Path(model).parent)
    return model


# overlay: GGUF in bfloat16 on Blackwell gave garbage on an RTX 5090 (vllm #30090,
# #30408: in-tree GGUF then refused bfloat16 on SM >= 100); this plugin lifted the
# refusal (#73) from reading its kernels, with no Blackwell run reported. Until one
# shows bfloat16 right there, dtype auto stays float16 on those GPUs.
def _gguf_prefers_float16() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda() and current_platform.has_device_capability(100)


# overlay: the local first part of a glm-dsa GGUF reference (file, any part of a
# split set, local_dir:quant, repo_id:quant), or None for any other GGUF
def _glm_dsa_first_part(
    model: str, download_dir: str | None, revision: str | None
) -> str | None:
    if is_local_gguf_quant(model):
        model = resolve_local_gguf(*model.rsplit(":", 1))
    elif is_remote_gguf(model):
        repo_id, quant_type = split_remote_gguf(model)
        model = download_gguf(
            repo_id, quant_type, download_dir, revision, first_part_only=True
        )
    if not check_gguf_file(model):
        return None
    first = str(first_file(model))
    return first if is_glm_dsa_gguf(first) else None


def _patch_engine_args() -> None:
    if getattr(EngineArgs, "_gguf_create_model_config_patched", False):
        return

    original_create_model_config = EngineArgs.create_model_config

    @wraps(original_create_model_config)
    def create_model_config(self, *args, **kwargs):
        # overlay: a directory holding one GGUF model (e.g. a split set) means
        # that model's first file, served under the name given
        if (first := resolve_gguf_dir(self.model)) != self.model:
            if self.served_model_name is None:
                self.served_model_name = [self.model]
            self.model = first
        if _is_gguf_reference(self.model):
            gguf_model = self.model
            if self.quantization is None:
                self.quantization = "gguf"
            if self.load_format == "auto":
                self.load_format = "gguf"
            # overlay: dtype auto is float16 on compute capability >= 10.0
            if self.dtype == "auto" and _gguf_prefers_float16():
                logger.info(
                    "GGUF model on compute capability >= 10.0: using float16 "
                    "(bfloat16 GGUF output was reported wrong on Blackwell); "
                    "--dtype overrides."
                )
                self.dtype = "float16"
            if self.config_format == "auto":
                self.config_format = "gguf"
            if not self.model_weights:
                self.model_weights = gguf_model
            if self.served_model_name is None:
                self.served_model_name = [gguf_model]
            # overlay: a glm-dsa GGUF carries its config and tokenizer: with no HF
            # checkpoint named, its (first) file is the source of both
            glm_dsa = None
            if self.hf_config_path is None and (
                not isinstance(self.tokenizer, str) or _is_gguf_reference(self.tokenizer)
            ):
                glm_dsa = _glm_dsa_first_part(gguf_model, self.download_dir, self.revision)
            self.model = _get_gguf_config_source(
                gguf_model,
                self.tokenizer if isinstance(self.tokenizer, str) else None,
                self.hf_config_path,
            )
            if glm_dsa is not None:  # overlay: the model stays its folder (or repo)
                self.hf_config_path = glm_dsa
                self.tokenizer = self.tokenizer or glm_dsa
                # its tokenizer through vLLM's tokenizer registry (HF's cannot read it)
                if self.tokenizer_mode in ("auto", "hf"):
                    self.tokenizer_mode = TOKENIZER_MODE
                if not is_remote_gguf(gguf_model):
                    self.model = str(Path(glm_dsa).parent)
        return original_create_model_config(self, *args, **kwargs)

    EngineArgs.create_model_config = create_model_config
    EngineArgs._gguf_create_model_config_patched = True


def _patch_speculator_probe() -> None:
    if getattr(arg_utils_module, "_gguf_speculator_probe_patched", False):
        return

    original_maybe_override = arg_utils_module.maybe_override_with_speculators

    @wraps(original_maybe_override)
    def maybe_override_with_speculators(model, tokenizer, *args, **kwargs):
        if _is_gguf_reference(model):
            return model, tokenizer, kwargs.get("vllm_speculative_config")
        return original_maybe_override(model, tokenizer, *args, **kwargs)

    arg_utils_module.maybe_override_with_speculators = maybe_override_with_speculators
    config_module.maybe_override_with_speculators = maybe_override_with_speculators
    arg_utils_module._gguf_speculator_probe_patched = True
    config_module._gguf_speculator_probe_patched = True


# overlay: offline (HF_HUB_OFFLINE), EngineArgs replaces a model id by its cached
# snapshot folder; a repo_id:quant_type reference becomes <snapshot>:quant_type,
# which the loader reads as a local_dir:quant_type reference (not an invalid repo id)
def _patch_offline_model_path() -> None:
    if getattr(arg_utils_module, "_gguf_model_path_patched", False):
        return

    original_get_model_path = arg_utils_module.get_model_path

    @wraps(original_get_model_path)
    def get_model_path(model, revision=None):
        if isinstance(model, str) and not Path(model).exists() and is_remote_gguf(model):
            repo_id, quant_type = split_remote_gguf(model)
            return f"{original_get_model_path(repo_id, revision)}:{quant_type}"
        return original_get_model_path(model, revision)

    arg_utils_module.get_model_path = get_model_path
    arg_utils_module._gguf_model_path_patched = True


# overlay: the glm-dsa adapter, then the checked default adapter, which takes every model
# (so it comes last), in the plugin's adapter registry
def _register_weights_adapters() -> None:
    for adapter in (GlmDsaGGUFAdapter, CheckedGGUFWeightsAdapter):
        if adapter not in _ADAPTER_REGISTRY:
            _ADAPTER_REGISTRY.append(adapter)


def _register_omni_diffusion_quantization() -> None:
    try:
        from vllm_omni.quantization import register_quantization_override
    except ImportError:
        return

    register_quantization_override("gguf", lambda **kw: DiffusionGGUFConfig(**kw))


# overlay: the GGUF kernel switches as vLLM environment variables. vLLM keys its
# torch.compile cache on the ones it knows, and a switch changes the kernels a traced
# layer runs; --fail-on-environ-validation refuses unknown VLLM_ names.
def _register_switches() -> None:
    from vllm.overlay_switches import register_switches

    from .quantization import gguf_kernels

    register_switches(gguf_kernels.SWITCHES)


def register() -> None:
    """Register the out-of-tree GGUF integration."""
    register_quantization_config("gguf")(GGUFConfig)
    _register_omni_diffusion_quantization()

    if "gguf" not in _LOAD_FORMAT_TO_MODEL_LOADER or not isinstance(
        get_model_loader(LoadConfig(load_format="gguf")), GGUFModelLoader
    ):
        register_model_loader("gguf")(GGUFModelLoader)

    try:
        parser = get_config_parser("gguf")
    except ValueError:
        parser = None
    # overlay: config format gguf with glm-dsa GGUFs as their own config source
    if not isinstance(parser, GlmDsaGGUFConfigParser):
        register_config_parser("gguf")(GlmDsaGGUFConfigParser)
    _patch_engine_args()
    _patch_speculator_probe()
    _patch_offline_model_path()  # overlay: repo_id:quant_type offline
    register_tokenizer_mode()  # overlay: a glm-dsa GGUF's tokenizer
    _register_weights_adapters()  # overlay: GLM-5's and the checked default
    _register_switches()  # overlay: in the compile cache's key
    _patch_diffusers_loader()
