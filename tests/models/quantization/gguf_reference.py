# SPDX-License-Identifier: Apache-2.0
"""Reference GGUFs of the tiny GLM-5, made by llama.cpp's own converter.

llama.cpp's `convert_hf_to_gguf.py` (with its gguf-py) is vendored in the
llama-cpp-python sdist on the package index; the sdist is pinned here by sha256
and cached by build.py's fetch. The converter identifies BPE pre-tokenizers by a
hash of how they split a probe string; the test tokenizer (a small byte-level
BPE with GLM's special tokens) resolves to GLM-5's pre-tokenizer, "glm4", and
nothing else in the converter is changed.
"""

import json
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LLAMA_CPP_PYTHON = ("llama-cpp-python", "llama_cpp_python-0.3.36.tar.gz",
                    "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
GLM_SPECIAL_TOKENS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
                      "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]


def llama_cpp_dir(cache: Path) -> Path:
    """The vendored llama.cpp tree (converter + gguf-py), extracted once into `cache`."""
    sys.path.insert(0, str(ROOT))
    import build

    sdist = build.fetch(*LLAMA_CPP_PYTHON)
    dest = cache / sdist.name.removesuffix(".tar.gz")
    marker = dest / ".complete"
    if not marker.exists():
        prefix = f"{dest.name}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (
                m.name.startswith(prefix + "gguf-py/") or m.name.startswith(prefix + "conversion/")
                or m.name == prefix + "convert_hf_to_gguf.py")]
            tar.extractall(cache, members=members, filter="data")
        marker.touch()
    return dest / "vendor" / "llama.cpp"


def write_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A byte-level BPE trained on a fixed text, with GLM's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [f"GLM-5 sparse attention test sentence number {i}: the quick brown fox "
            f"jumps over {i * 7} lazy dogs; 你好, мир! " for i in range(200)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(GLM_SPECIAL_TOKENS),
                                  special_tokens=[], initial_alphabet=
                                  pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    tok.add_special_tokens(GLM_SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.save_pretrained(model_dir)


CONVERT = r'''
import sys
sys.path.insert(0, sys.argv[1])
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
import conversion.base as base
# The test tokenizer resolves to GLM-5's pre-tokenizer; nothing else changes.
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "glm4"
import convert_hf_to_gguf
convert_hf_to_gguf.main()
'''


def convert(llama_cpp: Path, model_dir: Path, out: Path, outtype: str, *extra: str) -> Path:
    res = subprocess.run([sys.executable, "-c", CONVERT, str(llama_cpp), str(model_dir),
                          "--outfile", str(out), "--outtype", outtype, *extra],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
    return out


def gguf_module(llama_cpp: Path):
    """gguf-py as vendored with the converter (the version that wrote the files)."""
    if str(llama_cpp / "gguf-py") not in sys.path:
        sys.path.insert(0, str(llama_cpp / "gguf-py"))
    import gguf

    return gguf


def config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())
