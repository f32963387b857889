# SPDX-License-Identifier: Apache-2.0
"""The synthetic GLM-5-shaped GGUF (vllm_gguf_plugin/gguf_model/synthetic.py) against
llama.cpp's own files.

References:
- the tiny GLM-5 converted by llama.cpp's convert_hf_to_gguf.py and quantized to
  Q4_K_M by llama-quantize (tests' gguf_reference): the same tensor names, shapes,
  order and types, and the same metadata keys, value types, order and values
  (the tokenizer's aside: a vocabulary of its own);
- llama-quantize's own choice of types at GLM-5's real dimensions (10 layers and
  an MTP block, 256 experts): its --dry-run on a GGUF with the converter's bf16
  tensor table and no data (a sparse file), which decides each tensor's type as
  a real quantization does;
- gguf-py's reader and the plugin's checked reader
  accept the file, the loader's config parser reads TINY_GLM5's config from it,
  and gguf-py dequantizes every block to finite values of about the intended
  standard deviation.
"""

import math
import re
import subprocess

import numpy as np
import pytest

from tests.models.glm5_tiny import TINY_GLM5
from tests.models.quantization import gguf_reference as gr
from vllm_gguf_plugin.gguf_model import synthetic
from vllm_gguf_plugin.gguf_model.synthetic import plan, write_glm_dsa_gguf

# metadata that names the file or its tokenizer, not the model
OWN_VALUES = {"general.name", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
              "tokenizer.ggml.merges", "tokenizer.chat_template"}


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """gguf-py (the plugin's requirement, else as vendored with llama.cpp's converter)."""
    return gr.gguf_module(gr.llama_cpp_dir(tmp_path_factory.getbasetemp() / "llama-cpp"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny GLM-5's shape (4 layers and an MTP block, as TINY_GLM5), synthetic."""
    path = tmp_path_factory.mktemp("synthetic") / "tiny-Q4_K_M.gguf"
    return write_glm_dsa_gguf(path, "tiny", layers=4, nextn=1)


def table(reader):
    return [(t.name, [int(d) for d in t.shape], t.tensor_type.name) for t in reader.tensors]


def metadata(reader):
    return {f.name: ([t.name for t in f.types], f.contents()) for f in reader.fields.values()}


def test_same_as_llama_cpp_q4_k_m(gguf, tiny, glm5_gguf, tmp_path):
    """Tensor by tensor and key by key as llama.cpp's Q4_K_M of the tiny GLM-5."""
    _, _, bf16 = glm5_gguf
    ref = gguf.GGUFReader(gr.quantize(bf16, tmp_path / "tiny-glm5-Q4_K_M.gguf", "Q4_K_M"))
    ours = gguf.GGUFReader(tiny)
    assert table(ours) == table(ref)
    theirs, mine = metadata(ref), metadata(ours)
    assert list(mine) == list(theirs)
    for key, (types, value) in theirs.items():
        assert mine[key][0] == types, key
        if key not in OWN_VALUES and not key.startswith("tokenizer.ggml.") or key in (
                "tokenizer.ggml.model", "tokenizer.ggml.pre"):
            assert mine[key][1] == value, key
    # the special tokens are GLM's, as _set_vocab_glm names them
    tokens = mine["tokenizer.ggml.tokens"][1]
    for key, token in (("eos", "<|endoftext|>"), ("bos", "[gMASK]"), ("eot", "<|user|>"),
                       ("eom", "<|observation|>")):
        assert tokens[mine[f"tokenizer.ggml.{key}_token_id"][1]] == token


def sparse_bf16_table(gguf, tensors, path):
    """A GGUF with the converter's bf16 tensor table for `tensors` (float32 where
    llama-quantize does not quantize: what the converter keeps in float32) and no
    data: the file is extended, not written, to the size the table needs."""
    T = gguf.GGMLQuantizationType
    writer = gguf.GGUFWriter(path, "glm-dsa")
    synthetic.add_metadata(writer, synthetic.SHAPES["glm5"], 10, 1, "Q4_K_M", "sparse")
    end = 0
    for t in tensors:
        f32 = len(t.shape) == 1 or t.name.endswith(("ffn_gate_inp.weight", "indexer.proj.weight"))
        nbytes = math.prod(t.shape) * (4 if f32 else 2)
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32 if f32 else np.float16),
                               nbytes, T.F32 if f32 else T.BF16)
        end += -(-nbytes // writer.data_alignment) * writer.data_alignment
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    start = -(-fout.tell() // writer.data_alignment) * writer.data_alignment
    fout.truncate(start + end)
    fout.close()
    return path


def test_types_as_llama_quantize_at_glm5_size(gguf, tmp_path):
    """GLM-5's dimensions (256 experts: none of llama.cpp's 8-expert rules), 10
    layers and an MTP block: llama-quantize --dry-run's type for every tensor."""
    tensors = plan("glm5", layers=10, nextn=1)
    src = sparse_bf16_table(gguf, tensors, tmp_path / "glm5-10L-bf16-table.gguf")
    res = subprocess.run([str(gr.llama_quantize()), "--dry-run", str(src),
                          str(tmp_path / "unused.gguf"), "Q4_K_M"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    log = res.stdout + res.stderr
    theirs = {}
    for t in tensors:
        m = re.search(re.escape(t.name) + r" .*?(?:\((\w+)\)|size = +[\d.]+ MiB)\n", log)
        assert m, t.name
        theirs[t.name] = (m.group(1) or "f32").upper()
    assert {t.name: t.qtype.name for t in tensors} == theirs
    # use_more_bits of 11 blocks (i < 11/8, i >= 77/8, (i - 1) % 3 == 2): ffn_down in Q6_K
    q6 = sorted({int(n.split(".")[1]) for n, q in theirs.items() if "ffn_down" in n and q == "Q6_K"})
    assert q6 == [0, 3, 6, 9, 10]


def test_readers_config_and_blocks(gguf, tiny):
    from vllm_gguf_plugin.gguf_model import config_from_gguf, open_gguf, tokenizer_from_gguf

    ours = open_gguf(tiny)  # the plugin's checked reader
    assert len(ours.tensors) == len(plan("tiny", 4, 1))
    config = config_from_gguf(tiny)
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
                "n_shared_experts", "first_k_dense_replace", "routed_scaling_factor",
                "index_topk", "index_n_heads", "index_head_dim", "num_nextn_predict_layers",
                "max_position_embeddings", "rms_norm_eps", "vocab_size", "norm_topk_prob",
                "indexer_types", "scoring_func"):
        assert getattr(config, key) == TINY_GLM5[key], key
    tok = tokenizer_from_gguf(tiny)
    ids = tok("the quick brown fox, 你好")["input_ids"]
    assert tok.decode(ids) == "the quick brown fox, 你好"
    reader = gguf.GGUFReader(tiny)
    for t in reader.tensors:
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        assert np.isfinite(values).all(), t.name
        if t.tensor_type.name != "F32":
            # about 0.5 / sqrt(fan-in) (the output heads 4 / sqrt(fan-in))
            fan_in = int(t.shape[0])
            std = (4.0 if "head" in t.name or t.name == "output.weight" else 0.5) / fan_in ** 0.5
            if t.name == "token_embd.weight":
                std = 1.0 / fan_in ** 0.5
            assert 0.5 * std < values.std() < 2.0 * std, (t.name, values.std(), std)
            assert abs(values.mean()) < 0.2 * std, t.name


def test_writes_in_chunks(tmp_path, monkeypatch):
    """The data is made and written a chunk at a time: a tensor of many chunks is
    never one array."""
    from gguf import GGML_QUANT_SIZES

    sizes = []
    make = synthetic._random_blocks

    def spy(rng, qtype, n_blocks, d):
        sizes.append(n_blocks * GGML_QUANT_SIZES[qtype][1])
        return make(rng, qtype, n_blocks, d)

    monkeypatch.setattr(synthetic, "_random_blocks", spy)
    monkeypatch.setattr(synthetic._Chunks, "CHUNK_BYTES", 1 << 16)
    write_glm_dsa_gguf(tmp_path / "t.gguf", "tiny", layers=2)
    assert len(sizes) > 100 and max(sizes) <= 1 << 16


def test_cli_dry_run(capsys):
    assert synthetic.main(["/nonexistent/x.gguf", "--layers", "10", "--dry-run"]) == 0
    out = capsys.readouterr().out
    # 10 GLM-5 layers of Q4_K_M: about 51 GiB
    assert re.search(r"228 tensors, 5\d\.\d\d GiB", out), out
