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
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_PYTHON = ("llama-cpp-python", "llama_cpp_python-0.3.36.tar.gz",
                    "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
# The split regex of GLM-4.5/GLM-5's tokenizer.json, as HF spells it.
GLM_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# A short chat template in GLM's shape ([gMASK]<sop>, role tokens), for the
# tokenizer.chat_template the converter copies into the GGUF.
GLM_CHAT_TEMPLATE = ("[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                     "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
GLM_SPECIAL_TOKENS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
                      "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]


SDIST_TOP = LLAMA_CPP_PYTHON[1].removesuffix(".tar.gz")  # the sdist's top folder


def extract_sdist(into: Path, *paths: str) -> Path:
    """The pinned llama-cpp-python sdist's members under `paths` (relative to its top
    folder), extracted once into `into`; returns into / its top folder."""
    from tools import upstream

    dest = into / SDIST_TOP
    if not (dest / ".complete").exists():
        sdist = upstream.fetch(*LLAMA_CPP_PYTHON)
        prefixes = tuple(f"{SDIST_TOP}/{p}" for p in paths)
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefixes)]
            tar.extractall(into, members=members, filter="data")
        (dest / ".complete").touch()
    return dest


def llama_cpp_dir(cache: Path) -> Path:
    """The vendored llama.cpp tree (converter + gguf-py), extracted once into `cache`
    (or the tree VLLM_OVERLAY_LLAMA_CPP names, e.g. on the offline GPU host)."""
    if os.environ.get("VLLM_OVERLAY_LLAMA_CPP"):
        return Path(os.environ["VLLM_OVERLAY_LLAMA_CPP"])
    llama = "vendor/llama.cpp/"
    return extract_sdist(cache, llama + "gguf-py/", llama + "conversion/",
                         llama + "convert_hf_to_gguf.py") / llama


# llama.cpp's tools the tests run, built together from the pinned sdist; `llama` is
# libllama.so, which benchmarks/llama_cpp_logits.py loads
LLAMA_TOOLS = ("llama-quantize", "llama-imatrix", "llama")
# llama-quantize types whose tensors need an importance matrix: llama-quant.cpp
# (tensor_requires_imatrix) refuses IQ2_XXS/IQ2_XS/IQ2_S/IQ1_* targets without one,
# and IQ2_M's default tensor type is IQ2_S
NEEDS_IMATRIX = {"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M", "IQ3_XXS", "Q2_K_S"}


def llama_tool(name: str) -> Path:
    """One of LLAMA_TOOLS, built once from the pinned sdist's vendored source (CPU
    only, shared libraries beside the tools, found through $ORIGIN so that the folder
    can move) into build.py's cache; a few minutes on 2 cores. For `llama`, the path
    of libllama.so. VLLM_OVERLAY_LLAMA_QUANTIZE / VLLM_OVERLAY_LLAMA_IMATRIX name
    prebuilt ones (the offline GPU host)."""
    env = "VLLM_OVERLAY_" + name.upper().replace("-", "_")
    if os.environ.get(env):
        return Path(os.environ[env])
    from tools import upstream

    home = upstream.cache_dir() / f"llama-tools-shared-{SDIST_TOP}"
    binary = home / "build" / "bin" / (f"lib{name}.so" if name == "llama" else name)
    if binary.exists():
        return binary
    if shutil.which("cmake") is None:
        raise RuntimeError("building llama.cpp's tools needs cmake (and a C++ compiler)")
    work = home.with_name(f"{home.name}.partial-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    src = extract_sdist(work, "vendor/llama.cpp/") / "vendor" / "llama.cpp"
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DBUILD_SHARED_LIBS=ON",
             "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
             "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
             "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]
    for cmd in (["cmake", "-S", str(src), "-B", str(work / "build"), *flags],
                ["cmake", "--build", str(work / "build"), "--target", *LLAMA_TOOLS,
                 "-j", str(os.cpu_count() or 2)]):
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:3])} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    shutil.rmtree(work / SDIST_TOP)  # keep only the build
    try:
        work.rename(home)
    except OSError:  # another session finished first
        shutil.rmtree(work)
    return binary


def llama_quantize() -> Path:
    return llama_tool("llama-quantize")


def calibration_text(path: Path, sentences: int = 4000) -> Path:
    """A generated text for llama-imatrix (words, numbers, CJK and Cyrillic)."""
    path.write_text("".join(
        f"GLM-5 sparse attention test sentence number {i}: the quick brown fox jumps over "
        f"{i * 7} lazy dogs; 你好, мир! " for i in range(sentences)))
    return path


def make_imatrix(gguf_file: Path, out: Path, chunks: int = 16, ctx: int = 512,
                 binary: Path | None = None, extra: tuple[str, ...] = ()) -> Path:
    """llama.cpp's importance matrix of `gguf_file` over calibration_text: a real
    matrix of the model, no dummy."""
    text = calibration_text(out.with_suffix(".txt"))
    cmd = [str(binary or llama_tool("llama-imatrix")), "-m", str(gguf_file), "-f", str(text),
           "-o", str(out), "-c", str(ctx), "--chunks", str(chunks), "--no-ppl", *extra]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0 or not out.exists():
        raise RuntimeError(f"llama-imatrix failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    return out


# llama-imatrix runs the main model only, so it has no data for the MTP (nextn)
# block, and llama-quantize refuses the types of NEEDS_IMATRIX there; the block of
# such a file is quantized to this I-quant, which needs none
MTP_BLOCK_TYPE = "IQ4_XS"


def mtp_blocks(gguf_file: Path) -> list[int]:
    """The MTP (nextn) blocks of a GGUF: the last nextn_predict_layers of block_count."""
    gguf = gguf_module(llama_cpp_dir(Path(gguf_file).parent / "llama-cpp"))
    reader = gguf.GGUFReader(gguf_file)
    arch = reader.fields["general.architecture"].contents()
    n = reader.fields.get(f"{arch}.nextn_predict_layers")
    blocks = reader.fields[f"{arch}.block_count"].contents()
    n = n.contents() if n is not None else 0
    return list(range(blocks - n, blocks))


def quantize(src: Path, out: Path, qtype: str, imatrix: Path | None = None,
             extra: tuple[str, ...] = ()) -> Path:
    """llama-quantize `src` to `qtype`; the types of NEEDS_IMATRIX get an importance
    matrix of `src` (make_imatrix) unless one is given, and MTP_BLOCK_TYPE for the
    MTP block's tensors."""
    if qtype in NEEDS_IMATRIX:
        if imatrix is None:
            imatrix = make_imatrix(src, out.with_name(out.stem + ".imatrix.gguf"), chunks=8,
                                   ctx=128)
        for b in mtp_blocks(src):
            extra = (*extra, "--tensor-type", rf"blk\.{b}\.={MTP_BLOCK_TYPE.lower()}")
    cmd = [str(llama_quantize()), *extra, *(["--imatrix", str(imatrix)] if imatrix else []),
           str(src), str(out), qtype]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"llama-quantize failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return out


def rewrite(gguf, src: Path, out: Path, drop: tuple[str, ...] = (), metadata: dict | None = None,
            arch: str | None = None, drop_keys: tuple[str, ...] = (),
            swap_from: tuple[Path, str] | None = None, add: dict | None = None,
            replace: dict | None = None) -> Path:
    """A copy of a GGUF without the tensors in `drop` and the metadata keys in
    `drop_keys`, with metadata values replaced (same value types), keys added
    (`add`: {key: (value, GGUFValueType[, array element type])}), the tensors
    whose names match `swap_from`'s regex taken from its file and those in
    `replace` written as the given float32 arrays: altered files for the loader's
    error tests and hybrids for bisection."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(out, arch or reader.fields["general.architecture"].contents())
    metadata = metadata or {}
    for f in reader.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF.") or f.name in drop_keys:
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, metadata.get(f.name, f.contents()), f.types[0], sub_type=sub)
    for key, (value, vtype, *sub) in (add or {}).items():
        writer.add_key_value(key, value, vtype, sub_type=sub[0] if sub else None)
    kept = [t for t in reader.tensors if t.name not in drop]
    if swap_from is not None:
        other = {t.name: t for t in gguf.GGUFReader(swap_from[0]).tensors}
        kept = [other[t.name] if re.search(swap_from[1], t.name) else t for t in kept]
    replace = replace or {}
    for t in kept:
        if t.name in replace:
            a = replace[t.name]
            writer.add_tensor_info(t.name, a.shape, a.dtype, a.nbytes,
                                   gguf.GGMLQuantizationType.F32)
        else:
            writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes,
                                   t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(replace.get(t.name, t.data), tensor_endianess=reader.endianess)
    writer.close()
    return out


def glm_bpe():
    """An untrained byte-level BPE tokenizer with GLM's split regex (as llama.cpp's
    glm4/glm5 pre-tokenizer), ignore_merges as GLM's."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GLM_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def write_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A byte-level BPE trained on a fixed text, shaped like GLM-5's tokenizer.json:
    GLM's split regex, then byte-level without its own regex, BPE with
    ignore_merges, GLM's special tokens."""
    from tokenizers import pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = glm_bpe()
    text = [f"GLM-5 sparse attention test sentence number {i}: the quick brown fox "
            f"jumps over {i * 7} lazy dogs; 你好, мир! " for i in range(200)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(GLM_SPECIAL_TOKENS),
                                  special_tokens=[], initial_alphabet=
                                  pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    tok.add_special_tokens(GLM_SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = GLM_CHAT_TEMPLATE
    fast.save_pretrained(model_dir)
    # the checkpoint's own token ids for eos/pad, as in a real checkpoint
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if path.exists():
            data = json.loads(path.read_text())
            data.update(eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
            path.write_text(json.dumps(data, indent=2))


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


def dequantized_checkpoint(gguf, gguf_file: Path, hf_dir: Path, out: Path) -> Path:
    """An HF checkpoint (config, tokenizer, safetensors with the original names)
    holding the GGUF's weights dequantized by gguf-py, for transformers to run as
    the fp32 reference. Names come from gguf-py's own tensor-name map, and
    kv_b_proj from the layout test_gguf_reference checks against HF; the code
    under test (vLLM's loader) is not involved."""
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    reader = gguf.GGUFReader(gguf_file)
    tensors = {t.name: t for t in reader.tensors}
    cfg = config(hf_dir)
    n_layers = cfg["num_hidden_layers"]
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM_DSA,
                                    n_layers + cfg.get("num_nextn_predict_layers", 0))

    def deq(name):
        t = tensors[name]
        data = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(
            [int(d) for d in reversed(t.shape)])

    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name in load_file(hf_dir / "model.safetensors"):
        if name.startswith(f"model.layers.{n_layers}."):
            continue  # MTP block: not part of the reference forward pass
        base, suffix = name.rsplit(".", 1)
        if suffix == "e_score_correction_bias":
            base, suffix = f"{base}.e_score_correction", "bias"
        if base.endswith("kv_b_proj"):
            layer = name.split(".")[2]
            k_b, v_b = deq(f"blk.{layer}.attn_k_b.weight"), deq(f"blk.{layer}.attn_v_b.weight")
            state[name] = torch.cat([k_b.transpose(1, 2), v_b], 1).reshape(-1, k_b.shape[1])
        elif ".mlp.experts." in base:
            head, expert, proj = base.rsplit(".", 2)
            state[name] = deq(f"{tmap.get_name(head + '.' + proj)}.{suffix}")[int(expert)]
        else:
            state[name] = deq(f"{tmap.get_name(base)}.{suffix}")
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    for f in hf_dir.iterdir():
        if f.suffix == ".json" and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    return out


def hf_cache_repo(cache: Path, repo_id: str, files: dict[str, Path],
                  commit: str = "0" * 40) -> Path:
    """A Hugging Face hub cache (`cache`, as HF_HUB_CACHE) holding `repo_id` at `commit`
    with `files` (path in the repo -> local file, linked as the hub links its blobs):
    what `vllm serve org/repo:QUANT` finds offline after a download."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for rel, src in files.items():
        (snapshot / rel).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / rel).symlink_to(Path(src).resolve())
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


# GLM-5's added tokens in the order of its tokenizer (ids 154820-154855 there, here
# right after the BPE vocabulary), all listed as its special tokens
# (extra_special_tokens). The tags vLLM's GLM parsers read (and /nothink) are added
# as non-special tokens (kept by decode(skip_special_tokens=True)), the others as
# special ones: the two kinds of added token a GGUF carries (USER_DEFINED, CONTROL).
GLM5_NON_SPECIAL = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                    "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
                    "/nothink")
GLM5_ADDED_TOKENS = [
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
    "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>",
    "<|begin_of_video|>", "<|end_of_video|>", "<|begin_of_audio|>", "<|end_of_audio|>",
    "<|begin_of_transcription|>", "<|end_of_transcription|>", "<|code_prefix|>",
    "<|code_middle|>", "<|code_suffix|>", *GLM5_NON_SPECIAL,
    "<|begin_of_box|>", "<|end_of_box|>", "<|image|>", "<|video|>",
]
# A chat template in the shape of GLM-5's: [gMASK]<sop>, the tools in a system turn,
# role tokens, reasoning in <think></think> (an empty </think> without it), tool
# calls as <tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>,
# tool results in <|observation|><tool_response>...; the generation prompt opens
# <think>, or closes it when enable_thinking is false.
GLM5_CHAT_TEMPLATE = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each function call, output the function name and arguments in this format:
<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>...</tool_call>
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
<|system|>{{ m.content }}
{%- elif m.role == 'user' -%}
<|user|>{{ m.content }}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- if m.reasoning_content -%}<think>{{ m.reasoning_content }}</think>{%- else -%}</think>{%- endif -%}
{{- m.content if m.content else '' -}}
{%- for tc in m.tool_calls or [] -%}
{%- set f = tc.function if tc.function is defined else tc -%}
<tool_call>{{ f.name }}
{%- for k, v in f.arguments.items() -%}
<arg_key>{{ k }}</arg_key><arg_value>{{ v if v is string else v | tojson(ensure_ascii=False) }}</arg_value>
{%- endfor -%}
</tool_call>
{%- endfor -%}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|observation|>{%- endif -%}
<tool_response>{{ m.content }}</tool_response>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|assistant|>{{ '</think>' if enable_thinking is defined and not enable_thinking else '<think>' }}
{%- endif -%}"""
# Sampling defaults for the tiny checkpoint's generation_config.json, each one
# llama.cpp's converter stores (as general.sampling.*) and vLLM reads
GLM5_SAMPLING = {"temperature": 0.7, "top_p": 0.95, "top_k": 40, "min_p": 0.05,
                 "repetition_penalty": 1.05}


def write_glm5_tokenizer(model_dir: Path, sampling: dict | None = None) -> None:
    """A tokenizer shaped like GLM-5's (byte-level BPE as write_tokenizer's, GLM-5's
    added tokens in its order, eos and pad <|endoftext|>, no bos, model_max_length
    the context length, GLM5_CHAT_TEMPLATE), and config.json/generation_config.json
    naming GLM-5's end-of-turn tokens as its checkpoint does: eos_token_id
    [<|endoftext|>, <|user|>, <|observation|>], with `sampling` defaults."""
    from tokenizers import AddedToken, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    cfg = config(model_dir)
    tok = glm_bpe()
    text = [f"GLM-5 sparse attention test sentence number {i}: the quick brown fox "
            f"jumps over {i * 7} lazy dogs; 你好, мир! Looking it up. Hello there! "
            f"get_weather city Paris date today: sunny, {i % 30} degrees. " for i in range(200)]
    trainer = trainers.BpeTrainer(vocab_size=cfg["vocab_size"] - len(GLM5_ADDED_TOKENS),
                                  special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    tok.add_tokens([AddedToken(t, special=t not in GLM5_NON_SPECIAL, normalized=False)
                    for t in GLM5_ADDED_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        extra_special_tokens=GLM5_ADDED_TOKENS, clean_up_tokenization_spaces=False,
        model_max_length=cfg["max_position_embeddings"], padding_side="left")
    fast.chat_template = GLM5_CHAT_TEMPLATE
    fast.save_pretrained(model_dir)
    ids = fast.convert_tokens_to_ids(["<|endoftext|>", "<|user|>", "<|observation|>"])
    cfg = {k: v for k, v in cfg.items() if k != "bos_token_id"}
    cfg.update(eos_token_id=ids, pad_token_id=ids[0])
    (Path(model_dir) / "config.json").write_text(json.dumps(cfg, indent=1))
    generation = {"eos_token_id": ids, "pad_token_id": ids[0], **(sampling or {})}
    (Path(model_dir) / "generation_config.json").write_text(json.dumps(generation, indent=2))
