# SPDX-License-Identifier: Apache-2.0
import pytest

import gguf_reference as gr
from glm5_tiny import make_tiny_glm5


@pytest.fixture(scope="session")
def glm5_gguf(tmp_path_factory):
    """(llama.cpp tree, HF checkpoint dir, bf16 GGUF) of the tiny GLM-5, made once."""
    tmp = tmp_path_factory.mktemp("gguf")
    model = make_tiny_glm5(tmp / "tiny-glm5")
    gr.write_tokenizer(model, gr.config(model)["vocab_size"])
    llama_cpp = gr.llama_cpp_dir(tmp_path_factory.getbasetemp() / "llama-cpp")
    return llama_cpp, model, gr.convert(llama_cpp, model, tmp / "tiny-glm5-bf16.gguf", "bf16")
