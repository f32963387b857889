# SPDX-License-Identifier: Apache-2.0
import pytest

from tests.models.glm5_tiny import copy_shared_indexers, make_tiny_glm5, make_tiny_glm52
from tests.models.quantization import gguf_reference as gr


@pytest.fixture(scope="session", autouse=True)
def gguf_plugin():
    """vLLM's GGUF support is the vllm-gguf-plugin (a general plugin since vLLM 0.24):
    register it as the engine does at start."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()


@pytest.fixture(scope="session")
def glm5_gguf(tmp_path_factory):
    """(llama.cpp tree, HF checkpoint dir, bf16 GGUF) of the tiny GLM-5, made once."""
    tmp = tmp_path_factory.mktemp("gguf")
    model = make_tiny_glm5(tmp / "tiny-glm5")
    gr.write_tokenizer(model, gr.config(model)["vocab_size"])
    llama_cpp = gr.llama_cpp_dir(tmp_path_factory.getbasetemp() / "llama-cpp")
    return llama_cpp, model, gr.convert(llama_cpp, model, tmp / "tiny-glm5-bf16.gguf", "bf16")


@pytest.fixture(scope="session")
def glm5_ggufs(glm5_gguf, tmp_path_factory):
    """The tiny GLM-5 as llama.cpp writes it: {"bf16", "f16", "q8_0"} from the
    converter, "Q4_K_M" from llama-quantize (on the bf16 file), "split" (bf16 in
    parts of at most 40 tensors: the first part's path)."""
    llama_cpp, model, bf16 = glm5_gguf
    tmp = tmp_path_factory.mktemp("ggufs")
    files = {"bf16": bf16}
    for outtype in ("f16", "q8_0"):
        files[outtype] = gr.convert(llama_cpp, model, tmp / f"tiny-glm5-{outtype}.gguf", outtype)
    files["Q4_K_M"] = gr.quantize(bf16, tmp / "tiny-glm5-Q4_K_M.gguf", "Q4_K_M")
    split = tmp / "split"
    split.mkdir()
    gr.convert(llama_cpp, model, split / "tiny-glm5-bf16.gguf", "bf16", "--split-max-tensors", "40")
    files["split"] = next(split.glob("*-00001-of-*.gguf"))
    return files


@pytest.fixture(scope="session")
def glm52_gguf(tmp_path_factory):
    """(llama.cpp tree, HF checkpoint dir, bf16 GGUF) of the tiny GLM-5.2 (IndexShare:
    no indexer weights on its shared layers), made once."""
    llama_cpp = gr.llama_cpp_dir(tmp_path_factory.getbasetemp() / "llama-cpp")
    tmp = tmp_path_factory.mktemp("gguf52")
    model = make_tiny_glm52(tmp / "tiny-glm52")
    gr.write_tokenizer(model, gr.config(model)["vocab_size"])
    return llama_cpp, model, gr.convert(llama_cpp, model, tmp / "tiny-glm52-bf16.gguf", "bf16")


@pytest.fixture(scope="session")
def glm52_ggufs(glm52_gguf, tmp_path_factory):
    """The tiny GLM-5.2 as llama.cpp writes it: {"bf16", "q8_0"} from the converter,
    "Q4_K_M" from llama-quantize; and "copies-bf16", "copies-Q4_K_M": the same model
    converted from a checkpoint whose shared layers carry indexer weights (copies of
    the full layer's before them), as some published GLM-5.2 GGUFs do."""
    llama_cpp, model, bf16 = glm52_gguf
    tmp = tmp_path_factory.mktemp("ggufs52")
    files = {"bf16": bf16}
    files["q8_0"] = gr.convert(llama_cpp, model, tmp / "tiny-glm52-q8_0.gguf", "q8_0")
    files["Q4_K_M"] = gr.quantize(bf16, tmp / "tiny-glm52-Q4_K_M.gguf", "Q4_K_M")
    copies = copy_shared_indexers(model, tmp / "tiny-glm52-copies")
    files["copies-bf16"] = gr.convert(llama_cpp, copies, tmp / "tiny-glm52-copies-bf16.gguf",
                                      "bf16")
    files["copies-Q4_K_M"] = gr.quantize(files["copies-bf16"],
                                         tmp / "tiny-glm52-copies-Q4_K_M.gguf", "Q4_K_M")
    return files


@pytest.fixture(scope="session")
def glm5_chat_gguf(tmp_path_factory):
    """(llama.cpp tree, HF checkpoint dir, {"bf16": GGUF, "split": its first part}) of
    the tiny GLM-5 with a GLM-5-shaped tokenizer, chat template and generation config
    (gguf_reference.write_glm5_tokenizer), made once."""
    llama_cpp = gr.llama_cpp_dir(tmp_path_factory.getbasetemp() / "llama-cpp")
    tmp = tmp_path_factory.mktemp("gguf-chat")
    model = make_tiny_glm5(tmp / "tiny-glm5-chat")
    gr.write_glm5_tokenizer(model, gr.GLM5_SAMPLING)
    files = {"bf16": gr.convert(llama_cpp, model, tmp / "tiny-glm5-chat-bf16.gguf", "bf16")}
    split = tmp / "split"
    split.mkdir()
    gr.convert(llama_cpp, model, split / "tiny-glm5-chat-bf16.gguf", "bf16",
               "--split-max-tensors", "40")
    files["split"] = next(split.glob("*-00001-of-*.gguf"))
    return llama_cpp, model, files
