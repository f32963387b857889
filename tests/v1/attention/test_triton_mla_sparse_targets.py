# SPDX-License-Identifier: Apache-2.0
"""The gather kernel's launch table fits every GPU generation it may run on, and
the portable indexer's kernels compile for the GPUs that run them.

Triton compiles `_sparse_mla_kernel` for a target without a GPU (the compiler and
ptxas ship with it). For each architecture this test compiles every binary the
launch table can pick (8-128 heads, few and many tokens, bf16 and fp8 KV) with
that architecture's opt-in shared memory per block, and checks the shared memory
the binary needs against the limit: a binary over it fails at its first launch
with `OutOfResources`. SM 8.6/8.9/12.x (RTX 30xx/40xx/50xx, RTX A6000, RTX PRO 6000)
have 99 KiB, less than half of Hopper's 227 KiB; SM80 (A100, A800) 163 KiB. It also
checks that every binary stages its KV rows through asynchronous copies: a
synchronous row load in the main loop leaves the kernel waiting on memory (an fp8
tile that both dots take through a conversion compiled to one: 2.6x the bf16 time
on an H200).

The portable indexer's kernels are compiled the same way, with fp8 dots (SM89 on)
and with the 16-bit dots of GPUs without them (SM80/86; every target, as forceable),
on the 16-bit key cache's bf16 and fp16 keys with its write and gather kernels, and so
is upstream's q rope + quantization kernel with the e4m3 stores as bytes that SM80/86
need (Triton has no e4m3 type there).

The compiles run in a subprocess: the test session runs Triton in interpreter
mode, which cannot compile.
"""

import itertools
import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

# opt-in shared memory per block (CUDA programming guide, compute capabilities)
SHARED_MEM = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024,
              100: 227 * 1024, 120: 99 * 1024}
KV_LORA, ROPE, TOPK, SMS = 512, 64, 2048, 132
# e4m3 is not a Triton type below SM 8.9 (and TRITON_MLA_SPARSE refuses an fp8 KV
# cache there)
FP8_FROM = 89


def table_binaries(arch: int) -> list[dict]:
    import torch

    from vllm.v1.attention.ops import sparse_mla_launch as sml

    found = {}
    for kv in ("bf16", "fp8") if arch >= FP8_FROM else ("bf16",):
        kv_dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
        # the Triton tiles the table gives with and without Hopper's Gluon tiles (which
        # take some shapes; where they cannot run, the launch without them)
        for heads, tokens, gluon in itertools.product((8, 16, 32, 64, 128), (1, 4096),
                                                      (True, False)):
            device = sml.SparseMLADevice(arch, SHARED_MEM[arch], SMS, gluon)
            launch = sml.sparse_mla_launch(device, tokens, heads, KV_LORA + ROPE, KV_LORA,
                                           TOPK, torch.bfloat16, kv_dtype)
            if launch.tile in sml.GLUON_TILES:
                continue  # compiled in test_gluon_sparse_mla.py and test_gluon_sparse_mla_fp8.py
            key = {"BLOCK_H": launch.block_h, "BLOCK_N": launch.block_n,
                   "num_warps": launch.num_warps, "num_stages": launch.num_stages,
                   "V_RELOAD": launch.tile is sml.SparseMLATile.TRITON_V_RELOAD,
                   "kv": kv, "PARTIAL": launch.splits > 1}
            found[json.dumps(key, sort_keys=True)] = key
    return list(found.values())


def real_triton():
    """Triton for compiling in a process without a GPU driver (run in a plain process)."""
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice

    from vllm import triton_utils

    # without a GPU driver vllm.triton_utils hands out a placeholder; the
    # compiler needs none
    triton_utils.HAS_TRITON = True
    triton_utils.triton, triton_utils.tl, triton_utils.tldevice = triton, tl, tldevice
    return triton


def specialization_counts(kernel, calls) -> dict:
    """Distinct specializations Triton's own binder gives over `calls` ((args, kwargs)
    each), for `kernel` as vLLM has it and for its function plainly jitted: what would
    compile one binary each at its first launch (run in a plain process)."""
    triton = real_triton()
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import create_function_from_signature

    found = {}
    for name, jitted in (("vllm", kernel), ("plain", triton.jit(kernel.fn))):
        bind = create_function_from_signature(jitted.signature, jitted.params, CUDABackend)
        found[name] = len({repr(bind(*args, **kwargs)[1]) for args, kwargs in calls})
    return found


def compile_kernel(fn, arch, sig, consts, aligned, options):
    """Compile a Triton function for `arch` as the JIT would for 16-byte aligned
    pointers and strides; returns the compiled kernel."""
    triton = real_triton()
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(sig, **{name: "constexpr" for name in consts})
    src = ASTSource(
        fn, sig,
        constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
        attrs={(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in aligned},
    )
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def sync_row_loads(ttgir: str) -> int:
    """Synchronous loads of 2-D KV tiles (bf16 or fp8) in the kernel's main loop."""
    loop = ttgir[ttgir.index("scf.for"):ttgir.rindex("scf.yield")]
    return len(re.findall(
        r"tt\.load %\S+, %\S+, %\S+ : tensor<\d+x\d+x!tt\.ptr<(?:f8E4M3FN|bf16)>", loop))


def compile_binary(arch: int, b: dict):
    """One of `table_binaries`' binaries compiled for `arch` (in a plain process)."""
    real_triton()
    from vllm.v1.attention.ops import triton_sparse_mla as tsm

    partial = b["PARTIAL"]
    sig = {"Q": "*bf16", "KV": "*fp8e4nv" if b["kv"] == "fp8" else "*bf16",
           "Slots": "*i32", "Counts": "*i32", "KScale": "*fp32",
           "O": "*fp32" if partial else "*bf16", "Lse": "*fp32", "sm_scale": "fp32"}
    ints = ["stride_qt", "stride_qh", "stride_kv", "stride_st", "stride_ot",
            "stride_oh", "stride_os", "stride_lt", "stride_lh", "num_heads", "split_len"]
    sig.update({name: "i32" for name in ints})
    consts = {"BLOCK_H": b["BLOCK_H"], "BLOCK_N": b["BLOCK_N"], "D_V": KV_LORA,
              "D_R": ROPE, "KV_FP8": b["kv"] == "fp8", "PARTIAL": partial,
              "V_RELOAD": b["V_RELOAD"]}
    # what the JIT sees at GLM-5 shapes: 16-byte aligned pointers and strides,
    # which lets it pipeline the row loads through shared memory (the most
    # shared memory a binary takes)
    aligned = ["Q", "KV", "Slots", "Counts", "KScale", "O", "Lse", "stride_qt",
               "stride_qh", "stride_kv", "stride_st", "stride_ot", "stride_oh",
               "stride_os", "split_len"]
    return compile_kernel(tsm._sparse_mla_kernel, arch, sig, consts, aligned,
                          {"num_warps": b["num_warps"], "num_stages": b["num_stages"]})


def compile_shared_bytes(arch: int, binaries: list[dict]) -> list[tuple[int, int]]:
    """Shared memory and synchronous row loads (`sync_row_loads`) of each binary
    compiled for `arch` (run in a plain process)."""
    kernels = [compile_binary(arch, b) for b in binaries]
    return [(k.metadata.shared, sync_row_loads(k.asm["ttgir"])) for k in kernels]


def resource_usage(cubin: bytes) -> dict:
    """Registers and local memory (spills) of a compiled kernel, from cuobjdump (the
    compiled kernel reports its registers only once loaded on a GPU)."""
    import subprocess
    import tempfile

    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    usage = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", out))
    return {"registers": int(usage["REG"]), "spills": int(usage["STACK"]) + int(usage["LOCAL"])}


def dot_operands(ttgir: str) -> list[str]:
    """Element types of the dots' operands (mma.sync, wgmma and tcgen05 dots)."""
    types = set()
    for line in re.findall(r"(?:tt\.dot|ttng\.warp_group_dot|ttng\.tc_gen5_mma) [^\n]*", ttgir):
        types.update(re.findall(r"(?:tensor|memdesc)<\d+x\d+x(\w+)", line.split("->")[0]))
    return sorted(types - {"f32", "i64"})


def aligned_args(sig: dict) -> list[str]:
    """The pointers and strides of a signature: 16-byte aligned at GLM-5's shapes."""
    return [k for k, v in sig.items() if v.startswith("*") or k.startswith("stride")]


def compile_indexer(arch: int) -> list[dict]:
    """The portable indexer's prefill and decode kernels for `arch`, as launched
    for GLM-5 (32 heads x 128, fp8 q and k; decode blocks of 64 tokens): with fp8
    dots where the target has them, and with 16-bit dots (q and k as e4m3 bytes,
    converted by inline PTX); on the 16-bit key cache (`dots` bf16 or fp16: q and k
    in that type) with its write and gather kernels; and upstream's q rope +
    quantization kernel storing fp8 or bytes."""
    real_triton()
    from vllm.model_executor.layers import sparse_attn_indexer as sai
    from vllm.v1.attention.ops import triton_indexer_logits as il

    out = []
    dot_kinds = ("fp8", "16bit") if arch >= FP8_FROM else ("16bit",)
    for dots in dot_kinds + ("bf16", "fp16"):
        keys16 = dots in ("bf16", "fp16")
        e4m3 = {"fp8": "*fp8e4nv", "16bit": "*u8"}.get(dots, f"*{dots}")
        ptrs = {"Q": e4m3, "W": "*fp32", "OUT": "*fp32"}
        scales = e4m3 if keys16 else "*fp32"  # (16-bit keys: unread)
        prefill = dict(ptrs, K=e4m3, KS=scales, CU_KS="*i32", CU_KE="*i32")
        prefill.update({n: "i32" for n in ("M", "N", "stride_qm", "stride_qh", "stride_km",
                                           "stride_wm", "stride_om")})
        decode = dict(ptrs, KV_VALUES=e4m3, KV_SCALES=scales, SEQ_LENS="*i32",
                      BLOCK_TABLE="*i32")
        decode.update({n: "i32" for n in ("max_model_len", "stride_qr", "stride_qh",
                                          "stride_wr", "stride_bt", "stride_block",
                                          "stride_or")})
        for name, fn, sig, consts, warps in (
            ("prefill", il._mqa_logits_kernel, prefill,
             {"H": 32, "D": 128, "BLOCK_M": 4, "BLOCK_N": 128}, 8),
            ("decode", il._paged_mqa_logits_kernel, decode,
             {"NEXT_N": 1, "H": 32, "D": 128, "BS": 64}, 4),
        ):
            consts = dict(consts, UPCAST=dots == "16bit", ASM=True, KEYS16=keys16)
            kernel = compile_kernel(fn, arch, sig, consts, aligned_args(sig),
                                    {"num_warps": warps})
            ttgir = kernel.asm["ttgir"]
            out.append({"kernel": name, "dots": dots, "shared": kernel.metadata.shared,
                        "e4m3_type": "f8E4M3FN" in ttgir, "dot_operands": dot_operands(ttgir),
                        **resource_usage(kernel.asm["cubin"])})
    write = {"K": "*bf16", "CACHE": "*bf16", "SLOTS": "*i64", "stride_k": "i32"}
    gather = {"CACHE": "*bf16", "OUT": "*bf16", "BLOCK_TABLE": "*i32", "CU_SEQ_LENS": "*i32",
              "batch_size": "i32", "num_tokens": "i32", "stride_bt": "i32",
              "stride_block": "i32", "stride_out": "i32"}
    for name, fn, sig, consts, warps in (
        ("write_k_cache_16bit", il._write_k_cache_16bit_kernel, write, {"D": 128}, 1),
        ("gather_k_cache_16bit", il._gather_k_cache_16bit_kernel, gather,
         {"BS": 64, "D": 128, "BLOCK_T": 32}, 4),
    ):
        kernel = compile_kernel(fn, arch, sig, consts, aligned_args(sig), {"num_warps": warps})
        out.append({"kernel": name, "shared": kernel.metadata.shared,
                    **resource_usage(kernel.asm["cubin"])})
    rope = {"positions": "*i64", "q": "*bf16", "q_s0": "i32", "q_s1": "i32",
            "cos_sin_cache": "*bf16", "cos_sin_s0": "i32", "q_fp8_s0": "i32",
            "q_fp8_s1": "i32", "weights": "*bf16", "weights_s0": "i32", "weights_s1": "i32",
            "weights_out": "*fp32", "weights_out_s0": "i32", "weights_out_s1": "i32",
            "softmax_scale": "fp32", "head_scale": "fp32"}
    for name, fn in (("q_rope_quant", sai._fused_indexer_q_rope_quant_kernel),
                     ("q_rope_quant_inductor", inductor_source(
                         sai._fused_indexer_q_rope_quant_kernel))):
        for store in ("*fp8e4nv", "*u8"):
            try:
                kernel = compile_kernel(fn, arch, dict(rope, q_fp8=store),
                                        {"fp8_min": -448.0, "fp8_max": 448.0, "is_neox": True},
                                        [], {"num_warps": 1})
            except Exception as e:  # noqa: BLE001 - Triton's refusal of e4m3 is the result
                out.append({"kernel": name, "store": store, "error": str(e)[-300:]})
                continue
            out.append({"kernel": name, "store": store, "shared": kernel.metadata.shared,
                        "e4m3_type": "f8E4M3FN" in kernel.asm["ttgir"],
                        **resource_usage(kernel.asm["cubin"])})
    return out


def inductor_source(kernel):
    """A user-defined Triton kernel as torch.compile (Inductor) regenerates it in the
    compiled model's code: its source and those of the JIT functions it calls by name,
    in a module of their own (only those names resolve there)."""
    import importlib.util
    import tempfile

    from torch._inductor.codegen.wrapper import (
        user_defined_triton_kernel_transitive_closure_source_code as closure)

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
                + closure(kernel))
    spec = importlib.util.spec_from_file_location("inductor_kernel", f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, kernel.__name__)


def run_compiles(run_without_gpu, arch: int, binaries: list[dict] | None) -> list:
    """compile_shared_bytes (binaries given) or compile_indexer (None), run as this
    module's script."""
    return run_without_gpu(__name__, arch, json.dumps(binaries), timeout=1200)


@pytest.fixture(scope="module")
def compiled(run_without_gpu):
    # two processes at a time (the CI machine has two cores)
    archs = sorted(SHARED_MEM)
    with ThreadPoolExecutor(2) as pool:
        tables = {arch: table_binaries(arch) for arch in archs}
        results = pool.map(lambda a: run_compiles(run_without_gpu, a, tables[a]), archs)
        return {arch: list(zip(tables[arch], shared))
                for arch, shared in zip(archs, results)}


@pytest.mark.parametrize("arch", sorted(SHARED_MEM))
def test_launch_table_fits_shared_memory(compiled, arch):
    over = [(b, s) for b, (s, _) in compiled[arch] if s > SHARED_MEM[arch]]
    assert not over, (
        f"sm_{arch} allows {SHARED_MEM[arch]} B of shared memory per block; "
        f"these launch configs need more: {over}"
    )
    # the check sees real binaries: each uses shared memory for its row tiles
    assert all(s >= b["BLOCK_N"] * (KV_LORA + ROPE) for b, (s, _) in compiled[arch])


@pytest.mark.parametrize("arch", sorted(SHARED_MEM))
def test_launch_table_pipelines_row_loads(compiled, arch):
    sync = [b for b, (_, loads) in compiled[arch] if loads]
    assert not sync, f"sm_{arch}: these launch configs load KV rows synchronously: {sync}"


def test_sync_row_load_check_sees_fp8_reuse(run_without_gpu):
    # the check itself: an fp8 tile shared by both dots through a conversion
    # (V_RELOAD off) compiles to a synchronous load on an mma.sync tile
    binary = {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 3,
              "kv": "fp8", "PARTIAL": False}
    reused, reloaded = run_compiles(run_without_gpu, 90, [dict(binary, V_RELOAD=False),
                                                          dict(binary, V_RELOAD=True)])
    assert reused[1] > 0 and reloaded[1] == 0


def test_key_blocks_by_shared_memory():
    import torch

    from vllm.v1.attention.ops import sparse_mla_launch as sml

    def launch(arch, tokens, heads, num_sms=SMS, gluon=True):
        device = sml.SparseMLADevice(arch, SHARED_MEM[arch], num_sms, gluon)
        return sml.sparse_mla_launch(device, tokens, heads, KV_LORA + ROPE, KV_LORA, TOPK,
                                     torch.bfloat16, torch.bfloat16)

    # (tokens that fill the GPU: with fewer, Hopper and SM100 run 32 heads as two
    # 16-head programs)
    for heads in (32, 64, 128):
        hopper = launch(90, 4096, heads, gluon=False)
        sm100, sm120 = launch(100, 4096, heads), launch(120, 4096, heads)
        assert (hopper.block_n, sm100.block_n) == (64, 32)
        assert sm120.block_n == (16 if heads > 32 else 32)
        assert hopper.block_h == sm100.block_h
        # 99 KiB: 32-head programs (two of them for 64 heads)
        assert sm120.block_h == 32
    # SM80's 163 KiB: 32-row key blocks at 32 heads, 64 rows from 64 heads on, as
    # 32-head programs, both in two stages; SM86's 99 KiB: 16 rows in 5 stages from 64
    # heads on, as 32-head programs
    for heads in (32, 64, 128):
        sm80, sm86 = launch(80, 4096, heads, 108), launch(86, 4096, heads, 84)
        assert (sm80.block_n, sm80.num_stages) == ((64, 2) if heads > 32 else (32, 2))
        assert (sm86.block_n, sm86.num_stages) == ((16, 5) if heads > 32 else (32, 2))
        assert sm80.block_h == sm86.block_h == 32
        assert sm80.tile is sm86.tile is sml.SparseMLATile.TRITON
    # 16-head tiles are the same everywhere
    assert len({launch(a, 1, 16) for a in SHARED_MEM}) == 1


@pytest.fixture(scope="module")
def indexer_compiled(run_without_gpu):
    archs = sorted(SHARED_MEM)
    with ThreadPoolExecutor(2) as pool:
        results = pool.map(lambda a: run_compiles(run_without_gpu, a, None), archs)
        compiled = dict(zip(archs, results))
    # (shared memory, registers and spills of each kernel, in the test log)
    for arch, kernels in compiled.items():
        for k in kernels:
            print(f"sm_{arch} {k}")
    return compiled


@pytest.mark.parametrize("arch", [89, 90, 100, 120])
def test_indexer_kernels_compile_with_fp8_dots(indexer_compiled, arch):
    # GPUs with fp8 tensor cores: within the shared memory, nothing spilled; on the
    # GPUs the portable indexer is for (SM89; SM120 without DeepGEMM) fp8 dots
    # (Hopper's mma.sync has none: its decode tile converts to fp16)
    kernels = [k for k in indexer_compiled[arch] if k.get("dots") == "fp8"]
    assert [k["kernel"] for k in kernels] == ["prefill", "decode"]
    for k in kernels:
        if arch in (89, 120):
            assert k["dot_operands"] == ["f8E4M3FN"], k
        assert 0 < k["shared"] <= SHARED_MEM[arch], k
        assert k["spills"] == 0, k


@pytest.mark.parametrize("arch", sorted(SHARED_MEM))
def test_indexer_kernels_compile_with_16bit_dots(indexer_compiled, arch):
    # SM80/86 (no fp8 dots, no e4m3 type in Triton) and, forced, every other target:
    # fp16 dots on the e4m3 bytes, no e4m3 anywhere in the kernel, within the shared
    # memory, nothing spilled
    kernels = [k for k in indexer_compiled[arch] if k.get("dots") == "16bit"]
    assert [k["kernel"] for k in kernels] == ["prefill", "decode"]
    for k in kernels:
        assert not k["e4m3_type"] and k["dot_operands"] == ["f16"], k
        assert 0 < k["shared"] <= SHARED_MEM[arch], k
        assert k["spills"] == 0, k


@pytest.mark.parametrize("arch", sorted(SHARED_MEM))
def test_indexer_kernels_compile_for_16bit_keys(indexer_compiled, arch):
    # the 16-bit key cache (VLLM_SPARSE_INDEXER_CACHE=16bit) on every target: dots on
    # the keys' own type, within the shared memory, nothing spilled; its cache write
    # and gather kernels likewise
    for dots, operand in (("bf16", "bf16"), ("fp16", "f16")):
        kernels = [k for k in indexer_compiled[arch] if k.get("dots") == dots]
        assert [k["kernel"] for k in kernels] == ["prefill", "decode"]
        for k in kernels:
            assert not k["e4m3_type"] and k["dot_operands"] == [operand], k
            assert 0 < k["shared"] <= SHARED_MEM[arch], k
            assert k["spills"] == 0, k
    cache = {k["kernel"]: k for k in indexer_compiled[arch]
             if k["kernel"].endswith("k_cache_16bit")}
    assert sorted(cache) == ["gather_k_cache_16bit", "write_k_cache_16bit"]
    for k in cache.values():
        assert k["shared"] <= SHARED_MEM[arch] and k["spills"] == 0, k


@pytest.mark.parametrize("kernel", ["q_rope_quant", "q_rope_quant_inductor"])
@pytest.mark.parametrize("arch", sorted(SHARED_MEM))
def test_q_rope_quant_compiles_with_e4m3_bytes(indexer_compiled, arch, kernel):
    # upstream's fused q rope + fp8 quantization: its fp8 stores do not compile below
    # SM89 (Triton has no e4m3 type there), its byte stores compile everywhere; also
    # as torch.compile regenerates it in the compiled model (the byte conversion it
    # calls must come along)
    rope = {k["store"]: k for k in indexer_compiled[arch] if k["kernel"] == kernel}
    assert "error" not in rope["*u8"] and not rope["*u8"]["e4m3_type"], rope
    assert rope["*u8"]["spills"] == 0, rope
    if arch >= FP8_FROM:
        assert "error" not in rope["*fp8e4nv"], rope
    else:
        assert "type fp8e4nv not supported in this architecture" in rope["*fp8e4nv"]["error"]


if __name__ == "__main__":
    arch_, binaries_ = int(sys.argv[1]), json.loads(sys.argv[2])
    result = (compile_indexer(arch_) if binaries_ is None
              else compile_shared_bytes(arch_, binaries_))
    print(json.dumps(result))
