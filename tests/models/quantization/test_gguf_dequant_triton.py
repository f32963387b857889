# SPDX-License-Identifier: Apache-2.0
"""Q4_K and Q6_K dequantization on Triton (vllm_gguf_plugin.quantization.dequant_triton).

CPU: the kernels (Triton interpreter) against gguf-py's float32 values of random blocks
(every bit of the codes and scales random), rounded to float16, bfloat16 and float32:
rows of 1 to 12 blocks (every tile size the launches give), rows further apart than
their bytes; the launches; the refusals. The kernels compiled for SM80, SM90 and SM120
(float16 and bfloat16): no register spills, no shared memory (the unpacking stays in
registers), each thread's 8 values one 16-byte store. GPU: the same values at GLM-5's
shapes, and the plugin's CUDA `ggml_dequantize` (float16 arithmetic) within its
rounding, on the whole output head too.
"""

import json
import os
import re

import pytest
import torch
from gguf import GGMLQuantizationType as T

from benchmarks.kernels import benchmark_gguf_ops as bench
from tests.models.quantization.test_gguf_moe_marlin import k_quant_blocks
from tests.models.quantization.test_gguf_moe_prefill import _gguf_dequantize

ARCHS = (80, 90, 120)
TYPES = (T.Q4_K, T.Q6_K)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def gguf_pys(blocks: torch.Tensor, qtype, rows: int, cols: int) -> torch.Tensor:
    """gguf-py's float32 values of [rows, cols / 256 * bytes] blocks."""
    return _gguf_dequantize(blocks, qtype, rows, cols, torch.float32)


def rounded(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 values in dtype as the kernel rounds them: to nearest even. The Triton
    interpreter's float32 to bfloat16 cast truncates (it drops the rounding mode), so
    there the values are chopped."""
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return (ref.view(torch.int32) & -0x10000).view(torch.float32).to(dtype)
    return ref.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows,cols", [
    (3, 256),  # one block a row: programs of one block
    (2, 768),  # three: still one
    (3, 1536),  # six: two
    (2, 3072),  # twelve: four
    (2, 2048),  # eight: eight, the largest
])
def test_values_are_gguf_pys(qtype, dtype, rows, cols):
    from vllm_gguf_plugin.quantization import dequant_triton

    blocks = k_quant_blocks(qtype, rows, cols, rows + cols)
    out = dequant_triton.dequantize(blocks, int(qtype), rows, cols, dtype)
    assert out.shape == (rows, cols) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, rounded(gguf_pys(blocks, qtype, rows, cols), dtype))


@pytest.mark.parametrize("qtype", TYPES)
def test_rows_further_apart(qtype):
    """Rows that lie further apart than their bytes (a slice of a wider tensor, from a
    byte past its start) read their own blocks and none between."""
    from vllm_gguf_plugin.quantization import dequant_triton

    rows, cols = 3, 1024
    blocks = k_quant_blocks(qtype, rows, cols, 5)
    wide = torch.full((rows, blocks.shape[1] + 38), 0x7F, dtype=torch.uint8)
    wide[:, 2:2 + blocks.shape[1]] = blocks
    view = wide[:, 2:2 + blocks.shape[1]]
    assert view.stride(0) != view.shape[1]
    out = dequant_triton.dequantize(view, int(qtype), rows, cols, torch.float16)
    assert torch.equal(out, rounded(gguf_pys(blocks, qtype, rows, cols), torch.float16))


@pytest.mark.parametrize("row_blocks,blocks", [(1, 1), (3, 1), (6, 2), (12, 4), (8, 8),
                                               (24, 8), (64, 8), (28, 4), (154880, 8)])
def test_launch_divides_the_row(row_blocks, blocks):
    """As many blocks a program as divide the row's (no masks), up to MAX_BLOCKS, a
    warp each."""
    from vllm_gguf_plugin.quantization.dequant_triton import MAX_BLOCKS, launch

    config = launch(row_blocks)
    assert (config.blocks, config.num_warps) == (blocks, blocks)
    assert row_blocks % blocks == 0 and blocks <= MAX_BLOCKS


def test_refuses_other_types_and_shapes():
    from vllm_gguf_plugin.quantization import dequant_triton

    blocks = k_quant_blocks(T.Q4_K, 2, 512, 0)  # [2, 288]
    with pytest.raises(ValueError, match="not type"):
        dequant_triton.dequantize(blocks, int(T.Q8_0), 2, 512, torch.float16)
    with pytest.raises(ValueError, match="not a multiple of 256"):
        dequant_triton.dequantize(blocks, int(T.Q4_K), 2, 500, torch.float16)
    with pytest.raises(ValueError, match=r"\[2, 420\] bytes"):  # Q4_K bytes as Q6_K
        dequant_triton.dequantize(blocks, int(T.Q6_K), 2, 512, torch.float16)
    with pytest.raises(ValueError, match=r"\[2, 432\] bytes"):  # 768 values a row
        dequant_triton.dequantize(blocks, int(T.Q4_K), 2, 768, torch.float16)


def compile_kernels() -> list[dict]:
    """Both kernels, float16 and bfloat16 outputs, programs of MAX_BLOCKS blocks, compiled
    for each of ARCHS (in a plain process): spills, shared memory, global stores."""
    from tests.v1.attention.test_triton_mla_sparse_targets import (
        compile_kernel,
        real_triton,
        resource_usage,
    )

    real_triton()
    from vllm_gguf_plugin.quantization import dequant_triton as dt

    config = dt.launch(dt.MAX_BLOCKS)
    out = []
    for arch in ARCHS:
        for name, fn in (("Q4_K", dt._q4_k_kernel), ("Q6_K", dt._q6_k_kernel)):
            for dtype in ("fp16", "bf16"):
                sig = {"w_ptr": "*u8", "y_ptr": f"*{dtype}", "stride_w": "i32",
                       "row_blocks": "i32"}
                kernel = compile_kernel(fn, arch, sig, {"BLOCKS": config.blocks},
                                        ["w_ptr", "y_ptr", "stride_w"],
                                        {"num_warps": config.num_warps})
                out.append({"arch": arch, "type": name, "dtype": dtype,
                            "shared": kernel.metadata.shared,
                            "stores": re.findall(r"st\.global\S*", kernel.asm["ptx"]),
                            **resource_usage(kernel.asm["cubin"])})
    return out


def test_kernels_compile_to_one_wide_store_without_spills(run_without_gpu):
    """A warp a block, 8 values a thread: each thread's values leave in one 16-byte
    store (st.global.v4.b32), the widest, with nothing spilled to local memory and no
    shared-memory shuffle between the loads' layout and the store's, for each GPU
    generation that runs them."""
    compiled = run_without_gpu(__name__, timeout=600)
    assert len(compiled) == len(ARCHS) * 4  # Q4_K and Q6_K, float16 and bfloat16
    assert [c for c in compiled
            if c["spills"] or c["shared"] or c["stores"] != ["st.global.v4.b32"]] == []


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows,cols", [(6144, 16384), (4096, 6144)])
def test_gpu_values_are_gguf_pys_and_near_the_plugins(qtype, dtype, rows, cols):
    """GLM-5's o_proj and the output head's first rows: gguf-py's values exactly;
    the plugin's (which rounds d * scale, dmin * min, the product and the difference
    to float16: a few float16 steps of the largest value; then bfloat16) nearly."""
    from vllm_gguf_plugin import ops
    from vllm_gguf_plugin.quantization import dequant_triton

    blocks = k_quant_blocks(qtype, rows, cols, rows)
    out = dequant_triton.dequantize(blocks.cuda(), int(qtype), rows, cols, dtype)
    ref = gguf_pys(blocks, qtype, rows, cols)
    assert torch.equal(out.cpu(), ref.to(dtype))
    plugin = ops.ggml_dequantize(blocks.cuda(), int(qtype), rows, cols, dtype)
    assert bench.rel_error(plugin.cpu(), ref) < (4e-3 if dtype == torch.float16 else 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES)
def test_gpu_output_head_is_the_plugins(qtype):
    """The whole output head (154880 rows of 6144, too large for gguf-py): the plugin's
    values within its rounding, every row decoded."""
    from vllm_gguf_plugin import ops
    from vllm_gguf_plugin.quantization import dequant_triton

    rows, cols = 154880, 6144
    blocks = k_quant_blocks(qtype, rows, cols, 1).cuda()
    out = dequant_triton.dequantize(blocks, int(qtype), rows, cols, torch.float16)
    plugin = ops.ggml_dequantize(blocks, int(qtype), rows, cols, torch.float16)
    assert bench.rel_error(out, plugin.float()) < 4e-3


if __name__ == "__main__":
    print(json.dumps(compile_kernels()))
