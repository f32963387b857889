# SPDX-License-Identifier: Apache-2.0
"""Which tensor group breaks a quantized GLM-5 GGUF in vLLM? (a debugging script)

    python -m tests.models.quantization.gguf_bisect OUT_DIR

Makes the tiny GLM-5, its bf16 and q8_0 GGUFs, and hybrids that take one group
of tensors from the q8_0 file and the rest from the bf16 file; runs each in vLLM
(TRITON_MLA_SPARSE, portable indexer, fp16) and prints the prompt-logprob
distance to the safetensors run. A group whose hybrid is far off is where the
quantized path goes wrong.
"""

import json
import os
import sys
from pathlib import Path

from tests.models.glm5_runs import compare, generate
from tests.models.glm5_tiny import make_tiny_glm5
from tests.models.quantization import gguf_reference as gr

GROUPS = {
    "experts": r"ffn_(gate|up|down)_exps",
    "shared": r"ffn_(gate|up|down)_shexp",
    "dense_mlp": r"blk\.0\.ffn_(gate|up|down)\.",
    "attn_qkv": r"(?<!indexer\.)attn_(q_a|q_b|kv_a_mqa)\.",
    "attn_out": r"attn_output",
    "indexer_q": r"indexer\.attn_q_b",
    "embed": r"token_embd",
    "lm_head": r"^output\.weight",
    "all": r".",
}


def hybrid(gguf, bf16: Path, q8: Path, out: Path, pattern: str) -> Path:
    return gr.rewrite(gguf, bf16, out, swap_from=(q8, pattern))


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    model = make_tiny_glm5(out / "tiny")
    gr.write_tokenizer(model, gr.config(model)["vocab_size"])
    llama_cpp = gr.llama_cpp_dir(out / "llama-cpp")
    gguf = gr.gguf_module(llama_cpp)
    bf16 = gr.convert(llama_cpp, model, out / "bf16.gguf", "bf16")
    q8 = gr.convert(llama_cpp, model, out / "q8_0.gguf", "q8_0")
    settings = {"attention_backend": "TRITON_MLA_SPARSE", "indexer": "triton",
                "dtype": "float16"}
    st = generate(model, out / "st.json", **settings)
    report = {}
    only = os.environ.get("GGUF_BISECT_GROUPS")
    for name, pattern in GROUPS.items():
        if only and name not in only.split(","):
            continue
        f = hybrid(gguf, bf16, q8, out / f"hybrid-{name}.gguf", pattern)
        try:
            report[name] = compare(st, generate(f, out / f"{name}.json", **settings))
        except AssertionError as e:
            report[name] = {"error": str(e)[-800:]}
        print(name, json.dumps(report[name]), flush=True)
        f.unlink()
    (out / "bisect.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
