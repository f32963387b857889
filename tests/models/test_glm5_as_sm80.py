# SPDX-License-Identifier: Apache-2.0
"""GPU: the tiny GLM-5 as on an A100/A800 (SM80) or an RTX 3090/A6000 (SM86), whose
tensor cores have no fp8 dots, on an H200 that reports their compute capability and
shared memory per block (tests/plugins/vllm_report_capability, installed and enabled
by VLLM_TEST_REPORT_CAPABILITY / VLLM_TEST_REPORT_SHARED_MEM).

With no flags vLLM must pick TRITON_MLA_SPARSE (the SM80/86 launch-table tiles) and
the Triton indexer with 16-bit dots: q and k read as e4m3 bytes and converted to
fp16 in registers, and the q rope + quantization kernel storing e4m3 bytes (Triton
has no e4m3 type below SM89); everything else that asks the capability takes its
SM8x route too (FlashAttention 2 for the dense prefill, no SM90 router or QKV-A
GEMMs, the decode top-k that fits the reported shared memory). The kernels
themselves run on the H200's SM90, compiled for it.

Against transformers fp32 on the same weights, a run must be as close as the other
paths of the accuracy matrix (benchmarks/glm5_accuracy_matrix.py): mean |delta
logprob| at most 2x that of the upstream path (FLASHMLA_SPARSE + DeepGEMM on the
H200's own capability) for the same mode and dtype, plus 0.05 nats (the bf16 row
where upstream takes no fp16). A second test compares the two dot kinds on the GPUs
that differ in them alone, an RTX 3090 (SM86: 16-bit dots) and an RTX 4090 (SM89: fp8
dots), both 99 KiB of shared memory and mma.sync dots, with the same flags.

Run as a script (`python -m tests.models.test_glm5_as_sm80`), this file is
tests.models.glm5_generate counting the Triton indexer's kernel launches by dot kind and
(eager) the q quantization's stores by kind.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from tests.models.glm5_runs import _run, compare, generate, hf_reference, within_rerun
from tests.models.glm5_tiny import make_tiny_glm5
from tests.plugins.vllm_report_capability import vllm_report_capability as hook

# opt-in shared memory per block, as the test hook reports it (bytes)
SHARED_MEM = {"8.0": 163 * 1024, "8.6": 99 * 1024, "8.9": 99 * 1024}
UPSTREAM = dict(attention_backend="FLASHMLA_SPARSE", indexer="deepgemm")


def generate_counted(model, out, eager=True, env=None, **kw) -> dict:
    """glm5_runs.generate through this file: its JSON plus `launches`, the Triton
    indexer's launches by dot kind and the q quantization kernel's stores."""
    args = ["--model", str(model)] + (["--eager"] if eager else [])
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}", v]
    return _run(__name__, out, args, env=env)


def bound(ref_mean: float) -> float:
    """The accuracy matrix's bound on a row's mean |delta| against fp32."""
    return 2 * ref_mean + 0.05


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny GLM-5, its transformers fp32 reference, and the upstream path's runs
    (bf16, eager and CUDA graphs) on the H200's own capability."""
    pytest.importorskip("vllm.third_party.deep_gemm")
    out = tmp_path_factory.mktemp("glm5-sm80")
    model = make_tiny_glm5(out / "tiny-glm5")
    fp32 = hf_reference(model, out / "fp32.json")
    upstream = {eager: generate(model, out / f"upstream-{eager}.json", eager=eager, **UPSTREAM)
                for eager in (True, False)}
    return model, fp32, upstream


def report_env(capability: str) -> dict:
    if importlib.util.find_spec("vllm_report_capability") is None:
        pytest.skip("pip install --no-deps tests/plugins/vllm_report_capability first")
    env = dict(os.environ, VLLM_TEST_REPORT_CAPABILITY=capability,
               VLLM_TEST_REPORT_SHARED_MEM=str(SHARED_MEM[capability]))
    env.pop(hook.DEEP_GEMM_ENV, None)
    return env


def assert_16bit_path(run: dict, dtype: str, eager: bool = True):
    assert run["indexer_backend"] == "triton"
    launches = run["launches"]
    for kernel in ("prefill", "decode"):
        assert launches[kernel]["fp8"] == 0, launches
    # (with CUDA graphs, decode steps replay what was captured: launches are counted
    # where Python runs them)
    assert launches["prefill"]["16bit"] > 0, launches
    assert launches["decode"]["16bit"] > 0 or not eager, launches
    # bf16 queries take the fused q rope + quantization kernel, fp16 ones vLLM's
    # per-token-group quantization (a CUDA kernel); counted in eager mode only
    rope = launches["q_rope_quant"]
    if eager:
        assert rope["fp8"] == 0 and (rope["bytes"] > 0) == (dtype == "bfloat16"), launches


@pytest.mark.gpu
@pytest.mark.parametrize("capability,dtype,eager", [
    ("8.0", "bfloat16", True), ("8.0", "bfloat16", False), ("8.0", "float16", True),
    ("8.6", "bfloat16", True)])
def test_glm5_as_on_sm8x(tiny, tmp_path, capability, dtype, eager):
    model, fp32, upstream = tiny
    run = generate_counted(model, tmp_path / "sm8x.json", eager=eager,
                           env=report_env(capability), dtype=dtype)
    assert run["attention_backend"] == "TRITON_MLA_SPARSE"
    assert run["dtype"] == f"torch.{dtype}" and run["kv_cache_dtype"] == "auto"
    assert run["ws_sparse_mla_calls"] == 0 and run["rows_sparse_mla_calls"] == 0
    assert_16bit_path(run, dtype, eager)
    got, ref = compare(fp32, run), compare(fp32, upstream[eager])
    print("SM8X_REPORT", {"capability": capability, "dtype": dtype, "eager": eager,
                          "vs_fp32": got, "upstream_vs_fp32": ref, "bound": bound(ref["mean"])})
    assert got["mean"] <= bound(ref["mean"]), (got, ref)


@pytest.mark.gpu
def test_16bit_dots_against_fp8_dots(tiny, tmp_path):
    model, fp32, upstream = tiny
    flags = dict(attention_backend="TRITON_MLA_SPARSE", indexer="triton")
    sm86 = generate_counted(model, tmp_path / "16bit.json", env=report_env("8.6"), **flags)
    assert_16bit_path(sm86, "bfloat16")
    fp8 = [generate_counted(model, tmp_path / f"fp8-{i}.json", env=report_env("8.9"), **flags)
           for i in range(2)]
    for run in fp8:
        assert run["launches"]["decode"]["fp8"] > 0 and run["launches"]["decode"]["16bit"] == 0
    got, ref = compare(fp32, sm86), compare(fp32, upstream[True])
    same, rerun = compare(fp8[0], sm86), compare(fp8[0], fp8[1])
    print("SM86_SM89_DOTS_REPORT", {"vs_fp32": got, "upstream_vs_fp32": ref,
                                    "vs_fp8_dots": same, "fp8_dots_rerun": rerun})
    assert got["mean"] <= bound(ref["mean"]), (got, ref)
    # the same sums (fp8 values exact in fp16, fp32 accumulation): the two dot kinds
    # differ no more than two runs of one do
    assert within_rerun(same, rerun), (same, rerun)


def _count_launches(rope: bool) -> dict:
    """Count, in this (engine) process, the Triton indexer's kernel launches by dot
    kind and (`rope`) the q rope + quantization kernel's launches by store kind. The
    indexer's kernels launch from a custom op, which torch.compile does not trace;
    the q kernel launches from the model's forward, which it compiles (count it in
    eager mode only)."""
    import torch

    from vllm.model_executor.layers import sparse_attn_indexer as sai
    from vllm.v1.attention.ops import triton_indexer_logits as il

    counts = {"prefill": {"16bit": 0, "fp8": 0}, "decode": {"16bit": 0, "fp8": 0},
              "q_rope_quant": {"bytes": 0, "fp8": 0}}

    class Counted:
        def __init__(self, kernel, kind):
            self.kernel, self.kind = kernel, kind

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def run(*args, **kwargs):
                if self.kind == "q_rope_quant":  # q_fp8 is its 7th argument
                    counts[self.kind]["bytes" if args[6].dtype == torch.uint8 else "fp8"] += 1
                else:
                    counts[self.kind]["16bit" if kwargs["UPCAST"] else "fp8"] += 1
                return launch(*args, **kwargs)

            return run

    il._mqa_logits_kernel = Counted(il._mqa_logits_kernel, "prefill")
    il._paged_mqa_logits_kernel = Counted(il._paged_mqa_logits_kernel, "decode")
    if rope:
        sai._fused_indexer_q_rope_quant_kernel = Counted(
            sai._fused_indexer_q_rope_quant_kernel, "q_rope_quant")
    return counts


if __name__ == "__main__":
    from tests.models import glm5_generate

    launches = _count_launches(rope="--eager" in sys.argv)
    glm5_generate.main()
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    result = json.loads(out.read_text())
    result["launches"] = launches
    out.write_text(json.dumps(result))
