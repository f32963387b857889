# SPDX-License-Identifier: Apache-2.0
"""How the GGUF path loads under tensor parallelism, on CPU.

- Each rank copies only its own bytes of each tensor: every rank of vLLM's
  GlmMoeDsaForCausalLM filled from the tiny GLM-5's q8_0 file by the plugin's
  loader at TP 2 and 4 (gloo processes, glm5_tp_reads_cpu) counts the bytes it
  copies out of the file's mapping. A row- or column-parallel tensor's ranks read
  disjoint shares of it, equal and adding up to the tensor; a replicated tensor
  is read whole by each rank; no byte is read twice by a rank; the MTP block the
  main model does not load is not read. The reference: the layers vLLM's
  DeepseekV2 builds (which are parallel, which replicated), not the loader's table.
  A rank's resident memory (the kernel's count for the file's mappings) holds one
  tensor's pages at a time, and none once loaded; the loader's memory check counts
  the bytes each rank reads.
- Every GLM-5-shaped tensor splits into whole quant blocks at TP 2, 4 and 8 under
  llama.cpp's Q4_K_M and IQ2_M types (tensor_parallel_shards, the function the
  glm-dsa adapter checks a file with), and a size that cuts a block is an error
  naming the tensor and --tensor-parallel-size.
- The load's progress line counts the tensors and bytes it loads.
"""

import socket
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.models.quantization import gguf_reference as gr
from vllm_gguf_plugin import gguf_model as gg
from vllm_gguf_plugin.weights_adapter import glm_dsa
from vllm_gguf_plugin.weights_adapter.glm_dsa import GlmDsaGGUF, tensor_parallel_shards

ROOT = Path(__file__).resolve().parents[3]
FAULT_AROUND = 64 << 10

# vLLM's DeepseekV2 layers (models/deepseek_v2.py) by GGUF tensor: split along
# their input (RowParallelLinear, the experts' w2), their output
# (ColumnParallelLinear, MergedColumnParallelLinear, the experts' w13, kv_b_proj
# by heads: attn_k_b/attn_v_b's first dimension), the vocabulary
# (VocabParallelEmbedding, ParallelLMHead); everything else is replicated
# (fused_qkv_a_proj, the indexer, the router, norms).
ROW = ("attn_output.weight", "ffn_down.weight", "ffn_down_shexp.weight", "ffn_down_exps.weight")
COLUMN = ("attn_q_b.weight", "attn_k_b.weight", "attn_v_b.weight", "ffn_gate.weight",
          "ffn_up.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight",
          "ffn_gate_exps.weight", "ffn_up_exps.weight", "token_embd.weight", "output.weight")


@pytest.fixture(scope="module")
def q8_0(glm5_gguf, tmp_path_factory):
    """The tiny GLM-5 as llama.cpp's converter writes it in q8_0 (blocks of 32:
    its 256-input down projections split up to TP 8)."""
    llama_cpp, model, _ = glm5_gguf
    return gr.convert(llama_cpp, model, tmp_path_factory.mktemp("tp") / "tiny-glm5-q8_0.gguf",
                      "q8_0")


def load_ranks(gguf_file: Path, tp: int, out: Path) -> list[dict]:
    """Each rank's reads (glm5_tp_reads_cpu), the ranks run side by side."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "tests.models.quantization.glm5_tp_reads_cpu", str(gguf_file),
         "--tp", str(tp), "--rank", str(r), "--port", str(port),
         "--out", str(out / f"rank{r}.pt")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(tp)]
    for r, p in enumerate(procs):
        log, _ = p.communicate(timeout=900)
        assert p.returncode == 0, f"rank {r}:\n{log[-5000:]}"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(tp)]


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_reads_its_own_bytes(q8_0, tp, tmp_path):
    ranks = load_ranks(q8_0, tp, tmp_path)
    resident = []
    for r in ranks:
        assert r.pop("__copies__") == [], "tensors yielded as copies, not views of the file"
        resident.append(r.pop("__resident__"))
    reader = gg.open_gguf(q8_0)
    config = gg.config_from_gguf(q8_0)
    L = config.num_hidden_layers
    quantized = 0
    for t in reader.tensors:
        name, size = t.name, int(t.n_bytes)
        counts = [r[name][0] for r in ranks]
        masks = [np.unpackbits(r[name][1])[:size].astype(bool) for r in ranks]
        what = f"{name} ({t.tensor_type.name}, {size} bytes) at TP {tp}: read {counts}"
        # a rank reads no byte twice
        assert counts == [int(m.sum()) for m in masks], what
        layer, rest = ((int(name.split(".")[1]), name.split(".", 2)[2])
                       if name.startswith("blk.") else (None, name))
        if layer is not None and layer >= L:  # the MTP block: the draft's, not loaded
            assert counts == [0] * tp, what
            continue
        if rest in ROW + COLUMN:
            assert counts == [size // tp] * tp, what
            assert (np.sum(masks, axis=0) == 1).all(), what + ": not disjoint shares of it"
            # in rank order, along the split dimension
            first = [int(np.argmax(m)) for m in masks]
            assert first == sorted(first), what
            quantized += t.tensor_type.name == "Q8_0"
        else:
            assert counts == [size] * tp and all(m.all() for m in masks), what
    assert quantized >= 7 * L  # the file's split tensors are q8_0
    # a rank's resident memory holds the file's pages of one tensor at a time: each
    # is unmapped once loaded (a row-parallel tensor's rank reads every page of it)
    # (plus the neighbours' pages Linux maps around each fault: 64 KiB by default)
    largest = max(int(t.n_bytes) for t in reader.tensors)
    for rank, res in enumerate(resident):
        for n, loaded in enumerate(res["loaded"]):
            assert loaded - res["before"] <= largest + (n + 1) * FAULT_AROUND, (rank, n, res)
        assert res["end"] <= res["before"], (rank, res)
    # far below what a rank reads: the bound holds only where the pages are dropped
    assert largest + len(res["loaded"]) * FAULT_AROUND < Path(q8_0).stat().st_size / 4
    # the loader's memory check counts each rank's weights as the bytes it reads
    model = GlmDsaGGUF([q8_0], config, tp_size=tp)
    for rank, r in enumerate(ranks):
        assert model.rank_bytes(rank) == sum(v[0] for v in r.values()), rank


# llama.cpp's llama-quantize types (src/llama-quant.cpp, llama_tensor_get_type) of
# Q4_K_M and IQ2_M: the preset's default type and every type it raises or lowers
# a tensor to; a tensor gets one of them, or its fallback where its row length is
# not a multiple of the type's block (tensor_type_fallback).
Q = gguf.GGMLQuantizationType
PRESETS = {
    "Q4_K_M": (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0),
    "IQ2_M": (Q.IQ2_S, Q.IQ2_XXS, Q.IQ3_XXS, Q.IQ3_S, Q.IQ4_XS, Q.Q2_K, Q.Q4_K, Q.Q5_K,
              Q.Q6_K, Q.Q8_0),
}
FALLBACK = {Q.IQ2_XXS: Q.IQ4_NL, Q.IQ2_S: Q.IQ4_NL, Q.IQ3_XXS: Q.IQ4_NL, Q.IQ3_S: Q.IQ4_NL,
            Q.IQ4_XS: Q.IQ4_NL, Q.Q2_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def glm5_config():
    """GLM-5's config (its per-layer dimensions, benchmarks/glm5_llama_cpp_model.py):
    a dense layer, two MoE layers, and the MTP block."""
    from transformers import GlmMoeDsaConfig

    from benchmarks.glm5_llama_cpp_model import glm5_config as shaped

    cfg = shaped(3)
    cfg["num_nextn_predict_layers"] = 1
    return GlmMoeDsaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})


def hf_names(config, names) -> dict[str, str]:
    """{GGUF name: vLLM name} as the glm-dsa adapter maps them for `config`."""
    model = GlmDsaGGUF.__new__(GlmDsaGGUF)
    model.config = config
    return {g: model._hf_name(g) for g in names}


def glm5_tensors(config, kind):
    """({GGUF name: (type, shape)} of the matrices a GLM-5 file's model and its MTP
    draft load, each of type `kind` where its rows are whole blocks of it, else
    of kind's fallback; {GGUF name: vLLM name})."""
    draft = config.__class__(**config.to_dict())
    draft.model_type = "deepseek_mtp"  # vLLM's MTP draft config (glm_dsa.is_mtp_draft)
    tensors, hf = {}, {}
    for cfg in (config, draft):
        loaded, _ = glm_dsa._layout(cfg)
        matrices = {g: shape for g, shape in loaded.items() if len(shape) >= 2}  # not norms
        for g, shape in matrices.items():
            fits = shape[-1] % gguf.GGML_QUANT_SIZES[kind][0] == 0
            tensors[g] = (kind if fits else FALLBACK[kind], shape)
        hf.update(hf_names(cfg, matrices))
    return tensors, hf


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_glm5_splits_into_whole_quant_blocks(preset, tp):
    config = glm5_config()
    assert (config.hidden_size, config.num_attention_heads, config.moe_intermediate_size,
            config.intermediate_size, config.vocab_size) == (6144, 64, 2048, 12288, 154880)
    row_parallel = set()
    for kind in PRESETS[preset]:
        tensors, hf = glm5_tensors(config, kind)
        shards = tensor_parallel_shards(tensors, hf, tp, tp)
        for g, (t, shape) in tensors.items():
            block, type_size = gguf.GGML_QUANT_SIZES[t]
            stored = (*shape[:-1], shape[-1] // block * type_size)  # [..., rows, bytes]
            if shards[g] is None:  # replicated: every rank loads the whole tensor
                assert not hf[g].endswith(("o_proj.weight", "down_proj.weight", "q_b_proj.weight",
                                           "gate_proj.weight", "up_proj.weight")), g
                continue
            dims = {d for d, _, _ in shards[g]}
            assert len(dims) == 1, (g, shards[g])
            dim = dims.pop()
            # the ranks' shares tile the dimension in rank order
            ends = [0] + [s + n for _, s, n in shards[g]]
            assert [s for _, s, _ in shards[g]] == ends[:-1] and ends[-1] == stored[dim], (
                g, t.name, shards[g])
            if dim == len(shape) - 1:  # the input dimension, packed in blocks
                row_parallel.add(g)
                assert all(n % type_size == 0 and n // type_size * block == shape[-1] // tp
                           for _, _, n in shards[g]), (g, t.name, shards[g])
    # o_proj, the dense and shared down projections, the routed experts' (and the MTP block's)
    assert {g.split(".", 2)[-1] for g in row_parallel} == {
        "attn_output.weight", "ffn_down.weight", "ffn_down_shexp.weight",
        "ffn_down_exps.weight"}


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_split_that_cuts_a_block_names_the_tensor_and_setting(expert_parallel):
    """TP 16 leaves a rank 128 of a routed expert's 2048 inputs: half a K-quant block
    (under expert parallelism the shared expert's down projection is the first
    refused)."""
    config = glm5_config()
    tensors, hf = glm5_tensors(config, Q.Q4_K)
    with pytest.raises(gg.GGUFError) as e:
        tensor_parallel_shards(tensors, hf, 16, 1 if expert_parallel else 16)
    message = e.value.args[0]
    assert "--tensor-parallel-size" in message and "tensor parallel size 16" in message
    assert "a rank would hold 128 inputs, not a whole number of Q4_K blocks of 256" in message
    name = message.split("'")[1]
    assert name in tensors and name.endswith("_shexp.weight" if expert_parallel else "_exps.weight")
    assert ("--enable-expert-parallel" in message) == (not expert_parallel)
    # uneven rows: TP 3 cannot split the vocabulary, nor 64 heads' q_b_proj
    with pytest.raises(gg.GGUFError, match=r"'token_embd\.weight' \(Q4_K, a vocabulary of 154880, "
                                           r"padded to 154880\) cannot be split over tensor "
                                           r"parallel size 3; set --tensor-parallel-size"):
        tensor_parallel_shards(tensors, hf, 3, 3)
    q_b = {g: v for g, v in tensors.items() if g.endswith("attn_q_b.weight")}
    with pytest.raises(gg.GGUFError, match=r"'blk\.0\.attn_q_b\.weight' \(Q4_K, 16384 outputs\) "
                                           r"cannot be split over tensor parallel size 3.*"
                                           r"--tensor-parallel-size to a divisor of 16384"):
        tensor_parallel_shards(q_b, hf, 3, 3)


def progress_lines(text: str) -> list[str]:
    return [line for line in text.replace("\r", "\n").splitlines()
            if line.startswith("Loading GGUF tensors")]


def test_load_progress(glm5_gguf, capsys):
    """The glm-dsa adapter's and the plugin's iterator's progress line: every tensor
    loaded and the bytes of the file's tensors (tqdm's units)."""
    from tqdm import tqdm

    from vllm_gguf_plugin.gguf_model.tensors import LoadProgress
    from vllm_gguf_plugin.weight_utils import gguf_quant_weights_iterator_multi

    bf16 = glm5_gguf[2]
    config = gg.config_from_gguf(bf16)
    model = GlmDsaGGUF([bf16], config)
    sources = dict.fromkeys(g for g, _ in model._sources())  # k_b/v_b: one kv_b_proj
    n_bytes = sum(int(model.tensors[g].n_bytes) for g in sources)
    capsys.readouterr()
    for _ in model.weights():
        pass
    last = progress_lines(capsys.readouterr().err)[-1]
    assert last.startswith(f"Loading GGUF tensors: 100%, {len(sources)}/{len(sources)} tensors, "
                           f"{tqdm.format_sizeof(n_bytes, divisor=1000)}B/"
                           f"{tqdm.format_sizeof(n_bytes, divisor=1000)}B ["), last
    assert last.endswith("B/s]"), last

    reader = gg.open_gguf(bf16)
    for _ in gguf_quant_weights_iterator_multi([str(bf16)]):
        pass
    total = sum(int(t.n_bytes) for t in reader.tensors)
    last = progress_lines(capsys.readouterr().err)[-1]
    n = len(reader.tensors)
    assert f"100%, {n}/{n} tensors, {tqdm.format_sizeof(total, divisor=1000)}B/" in last, last
    # off where vLLM's rule says (use_tqdm_on_load, or not rank 0)
    progress = LoadProgress(3, 10, enable=False)
    progress.close()
    assert progress_lines(capsys.readouterr().err) == []
