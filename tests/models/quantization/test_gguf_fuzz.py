# SPDX-License-Identifier: Apache-2.0
"""Hostile and broken GGUF files: bounded, clear, never garbage.

Several hundred seeded variants of a small valid GGUF made by llama.cpp's converter
(`gguf_fuzz.py` makes the variants: truncations, bit flips in the header, edited
metadata, edited tensor tables) go through what vLLM does with a file, for two
architectures: a glm-dsa file through the overlay's glm-dsa path (the architecture
probe, the config, the tokenizer, the weights adapter's tensors), and a llama file
through the plugin's generic path (the probe, config format gguf with the
checkpoint's config.json next to the file, the default weights adapter's tensors).
Each must, within a time and a memory limit, either fail with a GGUFError that names
the file, or load exactly the weights of the original (a variant can be harmless: a
flipped bit in the model's name). A flipped bit in tensor data is not among them:
GGUF carries no checksum, such a file is a different model.
"""

import shutil
import signal
import time
import tracemalloc
from pathlib import Path

import pytest
import torch

from tests.models.glm5_tiny import make_tiny_glm5
from tests.models.quantization import gguf_fuzz
from tests.models.quantization import gguf_reference as gr

TIME_LIMIT_S = 20
MEMORY_LIMIT = 256 << 20  # bytes allocated at once through Python and numpy
SMALL = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
             num_hidden_layers=3, first_k_dense_replace=1,
             mlp_layer_types=["dense", "sparse", "sparse"], num_attention_heads=2,
             num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=64, qk_nope_head_dim=32,
             qk_rope_head_dim=32, qk_head_dim=64, v_head_dim=32, n_routed_experts=4,
             num_experts_per_tok=2, index_n_heads=2, index_head_dim=64, index_topk=128,
             indexer_types=["full"] * 3, layer_types=["deepseek_sparse_attention"] * 3)
SMALL_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, vocab_size=512,
                   max_position_embeddings=256)


@pytest.fixture(scope="module")
def small_gguf(glm5_gguf, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    model = make_tiny_glm5(tmp / "small-glm5", **SMALL)
    gr.write_tokenizer(model, gr.config(model)["vocab_size"])
    return gr.convert(glm5_gguf[0], model, tmp / "small-glm5-q8_0.gguf", "q8_0")


@pytest.fixture(scope="module")
def small_llama_gguf(glm5_gguf, tmp_path_factory):
    """A random tiny LlamaForCausalLM (seeded, made here) as llama.cpp's converter
    writes it in q8_0, in its checkpoint's folder (whose config.json the plugin's
    generic path reads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tmp_path_factory.mktemp("fuzz-llama") / "small-llama"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMALL_LLAMA)).save_pretrained(model)
    gr.write_tokenizer(model, SMALL_LLAMA["vocab_size"])
    return gr.convert(glm5_gguf[0], model, model / "small-llama-q8_0.gguf", "q8_0")


def load_glm_dsa(path: Path) -> dict[str, torch.Tensor]:
    from vllm_gguf_plugin import gguf_model as gg
    from vllm_gguf_plugin.weights_adapter.glm_dsa import GlmDsaGGUF

    gg.is_glm_dsa_gguf(path)
    config = gg.config_from_gguf(path)
    gg.tokenizer_from_gguf(path)
    return {name: t.clone() for name, t in GlmDsaGGUF(gg.split_files(path), config).weights()}


def load_generic(path: Path) -> dict[str, torch.Tensor]:
    """What the plugin's loader takes from a GGUF of an architecture without an
    adapter of its own: config format gguf's config, the weights adapter's tensors."""
    from types import SimpleNamespace

    from vllm.transformers_utils.config import get_config_parser
    from vllm_gguf_plugin.weights_adapter import get_weights_adapter

    _, config = get_config_parser("gguf").parse(str(path), trust_remote_code=False)
    adapter = get_weights_adapter(config)
    adapter.prepare_loading(str(path), SimpleNamespace(hf_config=config,
                                                       trust_remote_code=False))
    return {name: t.clone() for name, t in adapter.prepare_weights(None)}


@pytest.fixture(params=["glm-dsa", "llama"])
def fuzzed(request):
    """(the GGUF, how vLLM loads it, the files a variant needs next to it)."""
    if request.param == "glm-dsa":
        return request.getfixturevalue("small_gguf"), load_glm_dsa, []
    path = request.getfixturevalue("small_llama_gguf")
    return path, load_generic, [path.parent / "config.json"]


class TimeLimit(Exception):
    pass


def run_bounded(fn, *args):
    """fn(*args) under the time limit; returns (result or exception, seconds, peak bytes)."""
    def expire(signum, frame):
        raise TimeLimit(f"over {TIME_LIMIT_S} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(TIME_LIMIT_S)
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        result = fn(*args)
    except Exception as e:  # noqa: BLE001 - every outcome is judged below
        result = e
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return result, time.monotonic() - t0, peak


def test_hostile_variants(fuzzed, tmp_path):
    from vllm_gguf_plugin.gguf_model import GGUFError

    path, load, beside = fuzzed
    for f in beside:
        shutil.copy(f, tmp_path)
    original = load(path)
    bad, counts = [], {}
    for i, (category, what, data) in enumerate(gguf_fuzz.variants(path, seed=0)):
        # a name of its own: nothing read from an earlier variant is taken for it
        variant = tmp_path / f"variant-{i}.gguf"
        variant.write_bytes(data)
        result, seconds, peak = run_bounded(load, variant)
        variant.unlink()
        counts[category] = counts.get(category, 0) + 1
        problem = None
        if isinstance(result, TimeLimit) or seconds > TIME_LIMIT_S:
            problem = f"took {seconds:.1f} s"
        elif peak > MEMORY_LIMIT:
            problem = f"allocated {peak >> 20} MiB"
        elif isinstance(result, GGUFError):
            if variant.name not in str(result):
                problem = f"error does not name the file: {result}"
        elif isinstance(result, BaseException):
            problem = f"{type(result).__name__}: {result}"[:300]
        elif result.keys() != original.keys() or any(
                not torch.equal(result[k], original[k]) for k in result):
            problem = "loaded other weights than the original's"
        if problem:
            bad.append(f"{category} / {what}: {problem}")
    assert sum(counts.values()) >= 300, counts
    assert not bad, f"{len(bad)} of {sum(counts.values())} variants:\n" + "\n".join(bad)


def test_broken_split_sets(fuzzed, tmp_path):
    """Split sets of the same file: whole ones load the original's weights from any
    part's name, broken ones fail with a GGUFError naming a file of the set."""
    from vllm_gguf_plugin.gguf_model import GGUFError

    path, load, beside = fuzzed
    original = load(path)
    bad, loaded = [], []
    for i, (what, files, name) in enumerate(gguf_fuzz.split_variants(path, "small")):
        folder = tmp_path / str(i)
        folder.mkdir()
        for f in beside:
            shutil.copy(f, folder)
        for file, data in files.items():
            (folder / file).write_bytes(data)
        result, seconds, peak = run_bounded(load, folder / name)
        if seconds > TIME_LIMIT_S or peak > MEMORY_LIMIT:
            bad.append(f"{what}: {seconds:.1f} s, {peak >> 20} MiB")
        elif isinstance(result, GGUFError):
            if not any(f.removesuffix(".gguf") in str(result) for f in files | {name: 0}):
                bad.append(f"{what}: error names no file of the set: {result}")
        elif isinstance(result, BaseException):
            bad.append(f"{what}: {type(result).__name__}: {result}"[:300])
        elif result.keys() != original.keys() or any(
                not torch.equal(result[k], original[k]) for k in result):
            bad.append(f"{what}: loaded other weights than the original's")
        else:
            loaded.append(what)
    assert not bad, "\n".join(bad)
    # the whole sets load, and only they
    assert loaded == ["2 parts", "3 parts, named by the last"]


@pytest.mark.parametrize("kind", ["small", "bf16", "Q4_K_M", "split", "llama"])
def test_reader_reads_what_gguf_py_reads(request, kind):
    """On valid files the checked reader gives gguf-py's GGUFReader's metadata and
    tensors: the same keys, types and values, tensor names, types, shapes, offsets
    and bytes."""
    import gguf
    import numpy as np

    from vllm_gguf_plugin.gguf_model import GGUFFile

    path = (request.getfixturevalue("small_gguf") if kind == "small" else
            request.getfixturevalue("small_llama_gguf") if kind == "llama" else
            request.getfixturevalue("glm5_ggufs")[kind])
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    # gguf-py also lists the header's counts as fields "GGUF.*"
    header = {k: f for k, f in ref.fields.items() if k.startswith("GGUF.")}
    assert [header[f"GGUF.{k}"].contents() for k in ("version", "tensor_count", "kv_count")] == [
        3, len(ours.tensors), len(ours.fields)]
    assert list(ours.fields) == [k for k in ref.fields if k not in header]
    for key, f in ref.fields.items():
        if key in header:
            continue
        assert ours.fields[key].types == f.types, key
        assert ours.fields[key].contents() == f.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.tensor_type, b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.shape.tolist() == b.shape.tolist() and a.data.shape == b.data.shape, a.name
        assert a.data.dtype == b.data.dtype and np.array_equal(
            a.data.view(np.uint8), b.data.view(np.uint8)), a.name
