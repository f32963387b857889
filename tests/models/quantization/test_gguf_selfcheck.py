# SPDX-License-Identifier: Apache-2.0
"""`python -m vllm_gguf_plugin.selfcheck`: its selection report, its verdicts, its file.

Reference for the selection: the README's selection table as
tests/kernels/attention/test_attention_selector_sparse.py computes it (readme_cells:
vLLM's CUDA platform with the capability mocked, as on a GPU host), in the column
of the dtype a GGUF gets by default (float16 from SM100 on, else bfloat16) with a
16-bit KV cache (kv-cache-dtype auto). The self-check must print that choice,
and the capability test hook (VLLM_TEST_REPORT_CAPABILITY) must change it.
"""

import json
import subprocess
import sys
from contextlib import contextmanager
from types import SimpleNamespace
from unittest.mock import patch

import pytest

from tests.kernels.attention import test_attention_selector_sparse as sel
from tests.plugins.vllm_report_capability import vllm_report_capability as hook
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm_gguf_plugin import selfcheck
from vllm_gguf_plugin.gguf_model import config_from_gguf, open_gguf, tokenizer_from_gguf
from vllm_gguf_plugin.gguf_model.synthetic import write_glm_dsa_gguf


@pytest.fixture(scope="module")
def selfcheck_gguf(tmp_path_factory):
    """The self-check's tiny GLM-5 (GLM-5's heads and top-k), as it writes it."""
    path = tmp_path_factory.mktemp("selfcheck") / "glm5-selfcheck-Q4_K_M.gguf"
    return write_glm_dsa_gguf(path, selfcheck.model_shape(), layers=selfcheck.LAYERS)


@contextmanager
def as_gpu_host(monkeypatch, capability):
    """vLLM's CUDA platform as current platform, reporting `capability`, with every
    upstream kernel present (the selector test's as_on_gpu_host and readme_table)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.ops import triton_indexer_logits as il

    platform = sel.cuda.CudaPlatform()
    reported = classmethod(lambda cls, device_id=0: DeviceCapability(*capability))
    real_get_class = AttentionBackendEnum.get_class

    def get_class(self):
        if self in sel.UNIMPORTABLE:
            raise ImportError(sel.UNIMPORTABLE[self])
        return real_get_class(self)

    with (patch("vllm.platforms.current_platform", platform),
          patch.object(sel.cuda.CudaPlatform, "get_device_capability", reported),
          patch.object(AttentionBackendEnum, "get_class", get_class)):
        config = VllmConfig()
        with set_current_vllm_config(config):
            sel.as_on_gpu_host(monkeypatch)
            monkeypatch.setattr(config, "model_config", sel.glm5_model_config())
            monkeypatch.setattr("vllm.utils.import_utils.has_deep_gemm", lambda: True)
            monkeypatch.setattr(il, "current_platform", platform)
            for env in (il.CACHE_ENV, *hook.VARIABLES):
                monkeypatch.delenv(env, raising=False)
            yield il


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (9, 0), (12, 0)])
def test_selection_is_the_readme_table(monkeypatch, capsys, selfcheck_gguf, capability):
    with as_gpu_host(monkeypatch, capability) as il:
        fp16 = capability >= (10, 0)
        column = sel.README_COLUMNS.index(("fp16" if fp16 else "bf16", "auto"))
        cells = sel.readme_cells(il, capability)
        report = selfcheck.selection(config_from_gguf(selfcheck_gguf))
        selfcheck.print_selection({"gpu": selfcheck.gpu_report(), "selection": report})
    assert report["dtype"] == ("float16" if fp16 else "bfloat16")
    assert report["attention_backend"] == cells[column]
    assert report["indexer"] == cells[-1].removesuffix(" (ours)")
    out = capsys.readouterr().out
    assert f"compute capability {capability[0]}.{capability[1]}" in out
    assert f"attention backend {cells[column]}, indexer {report['indexer']}" in out


def test_capability_hook_changes_the_report(monkeypatch, selfcheck_gguf):
    """VLLM_TEST_REPORT_CAPABILITY=12.0 on an H200 (9.0): the report is SM120's."""
    with as_gpu_host(monkeypatch, (9, 0)) as il:
        cls = sel.cuda.CudaPlatform
        for name in ("get_device_capability", "get_max_shared_memory_per_block"):
            monkeypatch.setattr(cls, name, getattr(cls, name))  # restored after the hook
        config = config_from_gguf(selfcheck_gguf)
        h200 = selfcheck.selection(config)
        monkeypatch.setenv(hook.ENV, "12.0")
        monkeypatch.setenv(hook.SHARED_MEM_ENV, "101376")
        for name in ("DISABLE_MMA_V3", "DISABLE_MMA_V5"):
            monkeypatch.setenv(name, "")
            monkeypatch.delenv(name)
        from vllm import envs  # the hook registers its variables: restored after the test
        monkeypatch.setattr(envs, "environment_variables", dict(envs.environment_variables))
        hook.register()
        gpu = {k: v for k, v in selfcheck.gpu_report().items() if k not in ("name", "platform")}
        sm120 = selfcheck.selection(config)
        expect = sel.readme_cells(il, (12, 0))
    assert gpu == {"capability": "12.0", "shared_memory_per_block": 101376}
    assert h200["dtype"] == "bfloat16" and sm120["dtype"] == "float16"
    assert sm120["attention_backend"] == expect[sel.README_COLUMNS.index(("fp16", "auto"))]
    assert h200["attention_backend"] != sm120["attention_backend"]


def test_its_gguf_is_accepted(selfcheck_gguf):
    reader = open_gguf(selfcheck_gguf)
    assert reader.tensors
    config = config_from_gguf(selfcheck_gguf)
    assert (config.num_attention_heads, config.index_topk) == (64, 2048)
    assert config.num_hidden_layers == selfcheck.LAYERS
    tok = tokenizer_from_gguf(selfcheck_gguf)
    # the long prompt exceeds the indexer's top-k and fits the model length
    n = len(tok(selfcheck.PROMPTS[1])["input_ids"])
    assert config.index_topk < n < selfcheck.MAX_MODEL_LEN - 64


class FakeLLM:
    """vllm.LLM's surface the self-check uses; `fail` raises in generate."""

    fail: Exception | None = None

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        config = SimpleNamespace(model_config=SimpleNamespace(dtype="torch.bfloat16"),
                                 cache_config=SimpleNamespace(cache_dtype="auto"))
        self.llm_engine = SimpleNamespace(vllm_config=config)

    def generate(self, prompts, params, use_tqdm=False):
        if self.fail is not None:
            raise self.fail
        step = {7: SimpleNamespace(logprob=-0.5)}
        return [SimpleNamespace(prompt_token_ids=[1] * 10, outputs=[SimpleNamespace(
            token_ids=[7] * params.max_tokens, text="x", logprobs=[step] * params.max_tokens)])
            for _ in prompts]


@pytest.mark.parametrize("fail,stage_hint", [
    (None, None),
    (RuntimeError("DeepGEMM JIT: cannot build sm_120 kernels (nvcc not found)"),
     "VLLM_SPARSE_INDEXER_CACHE=16bit"),
    (RuntimeError("CUDA error: the provided PTX was compiled with an unsupported toolchain"),
     "update the driver"),
    # vLLM's own words when a neighbour on the GPU changed its memory during profiling
    (AssertionError("Error in memory profiling. Initial free memory 40.52 GiB, current free "
                    "memory 48.27 GiB. This happens when other processes sharing the same "
                    "container release GPU memory while vLLM is profiling"), "otherwise idle"),
    (ValueError("No available memory for the cache blocks. Try increasing "
                "`gpu_memory_utilization` when initializing the engine."),
     "raise --gpu-memory-utilization"),
    (KeyError("something else"), "traceback in the report"),
])
def test_verdict_and_exit_code(monkeypatch, capsys, tmp_path, fail, stage_hint):
    import vllm

    monkeypatch.setattr(FakeLLM, "fail", fail)
    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with as_gpu_host(monkeypatch, (9, 0)):
        code = selfcheck.main(["--json", str(tmp_path / "report.json"), "--dir", str(tmp_path)])
    out = capsys.readouterr()
    last = out.out.strip().splitlines()[-1]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["selection"]["attention_backend"] == "FLASH_ATTN_MLA_SPARSE"
    if fail is None:
        assert code == 0 and report["ok"]
        assert last.startswith("SELF-CHECK OK: FLASH_ATTN_MLA_SPARSE, indexer DeepGEMM, bfloat16")
        return
    assert code == 1 and not report["ok"]
    assert last.startswith(f"SELF-CHECK FAILED at engine: {type(fail).__name__}: ")
    assert stage_hint in last
    assert report["error"]["type"] == type(fail).__name__
    assert "Traceback" in out.err


@pytest.mark.gpu
@pytest.mark.parametrize("reported", [None, ("12.0", "101376"), ("8.9", "101376"),
                                      ("8.0", "166912")])
def test_selfcheck_on_this_gpu(tmp_path, reported):
    """The whole self-check, as itself and as on SM120, SM89 and SM80 (the capability
    hook, installed on the GPU host with `pip install --no-deps
    tests/plugins/vllm_report_capability`)."""
    import os
    from importlib.metadata import PackageNotFoundError, version

    env = dict(os.environ)
    if reported is not None:
        try:
            version("vllm_report_capability")
        except PackageNotFoundError:
            pytest.skip("the capability hook is not installed")
        env[hook.ENV], env[hook.SHARED_MEM_ENV] = reported
    res = subprocess.run([sys.executable, "-m", "vllm_gguf_plugin.selfcheck", "--json",
                          str(tmp_path / "report.json"), "--dir", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=600)
    report = json.loads((tmp_path / "report.json").read_text())
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert report["ok"] and res.stdout.strip().splitlines()[-1].startswith("SELF-CHECK OK")
    if reported is not None:
        assert report["gpu"]["capability"] == reported[0]
