# SPDX-License-Identifier: Apache-2.0
"""GLM-5.2/5.3 (IndexShare) from llama.cpp's glm-dsa GGUFs, on CPU.

The reference is a tiny GLM-5.2 made with transformers (glm5_tiny.make_tiny_glm52:
GLM-5 head dims, 2 dense and 4 MoE layers, the indexer schedule "FSFSSF", which is
neither llama.cpp's default nor all full, no indexer weights on the shared layers,
rope_theta 8e6, a 1M-token context, an MTP block), converted by llama.cpp's own
converter (bf16, q8_0) and quantized by its llama-quantize (Q4_K_M); and the same
model from a checkpoint whose shared layers carry copies of the full layer's
indexer weights before them, as some published GLM-5.2 GGUFs do.

- The converter writes the schedule (glm-dsa.attention.indexer.types) and no
  indexer tensors on shared layers; the config from the GGUF equals the HF config
  on every field vLLM and transformers read, the schedule included.
- The weights the loader yields equal the HF weights (exact for bf16); vLLM's own
  GlmMoeDsaForCausalLM, built on CPU and filled by the plugin's loader, has an
  indexer on the full layers only and every parameter filled, equal to the HF
  weights (exact for bf16). A copied-indexer file loads the same parameters; its
  copies are checked, left out and logged once.
- Every metadata key llama.cpp's glm-dsa loader treats as optional is optional
  here with llama.cpp's default (OPTIONAL_KEYS); the keys it requires are required.
- The indexer's RoPE layout: vLLM's Indexer.forward, with the GGUF's config and
  weights, selects transformers' GlmMoeDsaIndexer top-k on every full layer.
"""

import copy
import re
import tarfile
from types import SimpleNamespace
from unittest.mock import patch

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.models.glm5_tiny import GLM52_INDEXER_TYPES
from tests.models.quantization import gguf_reference as gr
from tests.models.quantization.test_gguf_glm_dsa import (CONFIG_FIELDS, REL_ERR,
                                                         assert_checkpoint_values, hf_view,
                                                         stack_name, stored_types, yielded)
from vllm_gguf_plugin import gguf_model as gg
from vllm_gguf_plugin.gguf_model import config as gguf_config
from vllm_gguf_plugin.weights_adapter import glm_dsa
from vllm_gguf_plugin.weights_adapter.glm_dsa import GlmDsaGGUF, runs_indexer

A = "glm-dsa"
N_LAYERS = len(GLM52_INDEXER_TYPES)
FULL = [i for i, t in enumerate(GLM52_INDEXER_TYPES) if t == "full"]  # 0, 2, 5
SHARED = [i for i, t in enumerate(GLM52_INDEXER_TYPES) if t == "shared"]  # 1, 3, 4
INDEXER = ("indexer.attn_k.weight", "indexer.attn_q_b.weight", "indexer.k_norm.weight",
           "indexer.k_norm.bias", "indexer.proj.weight")

# GLM-5.2/5.3 config fields vLLM 0.26 reads (models/deepseek_v2.py), with the value
# it takes where a config has none.
VLLM_FIELDS = {"index_topk_pattern": None, "index_topk_freq": 1, "index_skip_topk_offset": 2,
               "moe_router_dtype": None, "moe_layer_freq": 1,
               # read from the MTP draft's config by vLLM's MTP proposer
               # (v1/spec_decode/llm_base_proposer.py); a GGUF has no key for it and
               # the overlay sets it for an IndexShare schedule, as GLM-5.2 has it
               "index_share_for_mtp_iteration": False}
# derived by transformers' GlmMoeDsaConfig
TRANSFORMERS_FIELDS = ("layer_types", "head_dim", "qk_head_dim")


@pytest.fixture(scope="module")
def hf52(glm52_gguf):
    _, model, _ = glm52_gguf
    return {k: v.float() for k, v in load_file(model / "model.safetensors").items()}


def test_converter_writes_the_schedule_and_no_shared_indexer(glm52_gguf, glm52_ggufs):
    llama_cpp, _, bf16 = glm52_gguf
    gguf = gr.gguf_module(llama_cpp)
    fields = gguf.GGUFReader(bf16).fields
    assert fields[f"{A}.attention.indexer.types"].contents() == [
        t == "full" for t in GLM52_INDEXER_TYPES]
    assert fields[f"{A}.context_length"].contents() == 1048576
    assert fields[f"{A}.rope.freq_base"].contents() == 8e6
    assert fields[f"{A}.nextn_predict_layers"].contents() == 1
    for kind, layers in (("bf16", FULL), ("Q4_K_M", FULL), ("copies-bf16", range(N_LAYERS))):
        names = {t.name for t in gguf.GGUFReader(glm52_ggufs[kind]).tensors}
        # blk.6 is the MTP block, a copy of the last (full) layer
        assert {int(n.split(".")[1]) for n in names if ".indexer." in n} == {*layers, 6}, kind


@pytest.mark.parametrize("kind", ("bf16", "q8_0", "Q4_K_M", "copies-bf16"))
def test_config_from_gguf_equals_hf_config(glm52_gguf, glm52_ggufs, kind):
    from transformers import AutoConfig

    ref = AutoConfig.from_pretrained(glm52_gguf[1])
    config = gg.config_from_gguf(glm52_ggufs[kind])
    for f in CONFIG_FIELDS + TRANSFORMERS_FIELDS:
        assert getattr(config, f, None) == getattr(ref, f, None), f
    for f, default in VLLM_FIELDS.items():
        assert getattr(config, f, default) == getattr(ref, f, default), f
    assert config.indexer_types == GLM52_INDEXER_TYPES
    assert [runs_indexer(config, i) for i in range(N_LAYERS)] == [
        t == "full" for t in GLM52_INDEXER_TYPES]
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 8e6}
    assert config.max_position_embeddings == 1048576 and config.num_nextn_predict_layers == 1
    assert config.moe_router_dtype == "float32"


@pytest.mark.parametrize("kind", ("bf16", "q8_0", "Q4_K_M"))
def test_weights_equal_hf_weights(glm52_ggufs, hf52, kind):
    f = glm52_ggufs[kind]
    config = gg.config_from_gguf(f)
    out = yielded([f], config)
    reader = GlmDsaGGUF([f], config)
    main = {k for k in hf52 if not k.startswith(f"model.layers.{N_LAYERS}.")}
    # every HF tensor of the main model, and nothing else (stacked experts aside)
    stacked = {n for n, w in out.items() if ".experts.0." in n and w.dim() == 3}
    assert {stack_name(k) if stack_name(k) in stacked else k for k in main} == set(out)
    assert not [n for n in out if ".indexer." in n and int(n.split(".")[2]) in SHARED]
    stored = stored_types(reader)
    for name, w in out.items():
        ref = hf_view(hf52, name, config, stacked=w.dim() == 3 and ".experts.0." in name)
        assert w.shape == ref.shape, name
        assert_checkpoint_values(name, w, ref, stored[name if name in stored
                                                     else stack_name(name)])


VLLM_KINDS = ("bf16", "copies-bf16", "Q4_K_M", "copies-Q4_K_M")


@pytest.fixture(scope="module")
def vllm_models(run_without_gpu, glm52_gguf, glm52_ggufs) -> dict:
    """{kind: vLLM's model of that file, built on CPU and filled by the plugin's
    loader, summed up by glm5_vllm_cpu.py against the HF checkpoint}."""
    files = [glm52_ggufs[k] for k in VLLM_KINDS]
    got = run_without_gpu("tests.models.quantization.glm5_vllm_cpu", *files, "--hf",
                          glm52_gguf[1])
    return dict(zip(VLLM_KINDS, got))


@pytest.mark.parametrize("kind", ("bf16", "copies-bf16"))
def test_vllm_model_filled_exactly_from_bf16(vllm_models, kind):
    """vLLM builds an indexer on the full layers only; every parameter is filled,
    equal to the HF checkpoint's (in vLLM's fused layout), from the file with the
    schedule alone and from the one with copied indexers."""
    got = vllm_models[kind]
    assert got["indexer_layers"] == FULL
    assert set(got["errors"]) == set(got["params"])  # all held unquantized
    assert {n: e for n, e in got["errors"].items() if e != 0.0} == {}


def test_vllm_model_filled_from_q4_k_m(vllm_models):
    """Quantized: every parameter filled (the loader checks), the indexer on the full
    layers only, the parameters held unquantized within Q4_K's error; the file with
    copied indexers gives the same parameters."""
    plain = vllm_models["Q4_K_M"]
    assert plain["indexer_layers"] == FULL
    assert plain["errors"] and all(e is not None and e <= REL_ERR["Q4_K"]
                                   for e in plain["errors"].values()), plain["errors"]
    assert vllm_models["copies-Q4_K_M"] == plain


def test_quantized_glm5_fills_vllm_model(run_without_gpu, glm5_gguf, glm5_ggufs):
    """The indexer's wq_b is a ReplicatedLinear, whose v1 weight_loader takes no GGUF
    blocks in vLLM 0.26 (it copies into the unquantized shape): the overlay's
    GGUFReplicatedLinearMethod stores them itself, so quantized GLM-5 files fill the model, wq_b
    keeping its q8_0 blocks."""
    got, = run_without_gpu("tests.models.quantization.glm5_vllm_cpu", glm5_ggufs["q8_0"],
                           "--hf", glm5_gguf[1])
    assert got["indexer_layers"] == [0, 1, 2, 3]
    assert got["params"]["model.layers.1.self_attn.indexer.wq_b.qweight"][0] == "torch.uint8"
    assert all(e is not None and e <= REL_ERR["Q8_0"] for e in got["errors"].values())


@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
def test_indexer_key_cache_16bit(run_without_gpu, monkeypatch, glm5_ggufs, dtype):
    """VLLM_SPARSE_INDEXER_CACHE=16bit: each indexer's key cache spec holds 128 values a
    token in the model's dtype (256 bytes) where the default holds 128 fp8 bytes and a
    float32 scale (132 bytes), on a Q4_K_M file."""
    monkeypatch.delenv("VLLM_SPARSE_INDEXER_CACHE", raising=False)
    fp8, = run_without_gpu("tests.models.quantization.glm5_vllm_cpu", glm5_ggufs["Q4_K_M"],
                           "--dtype", dtype)
    monkeypatch.setenv("VLLM_SPARSE_INDEXER_CACHE", "16bit")
    keys16, = run_without_gpu("tests.models.quantization.glm5_vllm_cpu",
                              glm5_ggufs["Q4_K_M"], "--dtype", dtype)
    names = [f"model.layers.{i}.self_attn.indexer.k_cache" for i in fp8["indexer_layers"]]
    assert sorted(fp8["indexer_caches"]) == sorted(keys16["indexer_caches"]) == sorted(names)
    for name in names:
        head, cache_dtype, page = fp8["indexer_caches"][name]
        assert [head, cache_dtype] == [132, "torch.uint8"]
        block_size = page // 132
        assert keys16["indexer_caches"][name] == [128, f"torch.{dtype}", block_size * 256]


@pytest.mark.parametrize("kind", ("bf16", "Q4_K_M"))
def test_copied_indexers_load_the_same_parameters(glm52_ggufs, kind):
    plain, copies = glm52_ggufs[kind], glm52_ggufs[f"copies-{kind}"]
    config = gg.config_from_gguf(plain)
    assert gg.config_from_gguf(copies).to_dict() == config.to_dict()
    with patch.object(glm_dsa.logger, "info") as info:
        a = dict(GlmDsaGGUF([plain], config).weights())
    assert not [c for c in info.call_args_list if "shared layers" in c.args[0]]
    with patch.object(glm_dsa.logger, "info") as info:
        b = dict(GlmDsaGGUF([copies], config).weights())
    lines = [c.args for c in info.call_args_list if "shared layers" in c.args[0]]
    assert lines == [(lines[0][0], len(SHARED) * len(INDEXER), ", ".join(map(str, SHARED)))]
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_copied_indexer_of_another_shape_is_refused(glm52_gguf, glm52_ggufs, tmp_path):
    """llama.cpp checks the shape of an optional tensor a file does carry."""
    gguf = gr.gguf_module(glm52_gguf[0])
    f = gr.rewrite(gguf, glm52_ggufs["copies-bf16"], tmp_path / "bad-copy.gguf",
                   replace={"blk.3.indexer.proj.weight": np.zeros((16, 1024), np.float32)})
    with pytest.raises(gg.GGUFError, match=r"bad-copy\.gguf: GGUF tensor 'blk\.3\.indexer\.proj"
                                           r"\.weight' has shape \[16, 1024\], the config "
                                           r"implies \[32, 1024\]"):
        GlmDsaGGUF([f], gg.config_from_gguf(f))


def test_file_schedule_and_model_config_must_agree(glm52_gguf, glm52_ggufs):
    """With --hf-config-path, vLLM builds the indexers its config schedules: a
    layer the file shares must not get one (from copies or from nothing)."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(glm52_gguf[1])  # index_topk_pattern "FSFSSF"
    GlmDsaGGUF([glm52_ggufs["copies-bf16"]], hf)
    # indexer_types alone: vLLM 0.26 reads index_topk_pattern or index_topk_freq
    unscheduled = copy.deepcopy(hf)
    del unscheduled.index_topk_pattern
    for kind in ("bf16", "copies-bf16"):
        with pytest.raises(gg.GGUFError, match=r"layer 1 is shared in the GGUF's indexer "
                                               r"schedule .* but full in the model config"):
            GlmDsaGGUF([glm52_ggufs[kind]], unscheduled)


def test_glm_5_2_default_schedule_is_llama_cpp_s():
    """_glm_5_2_default_full is llama.cpp's GLM_5_2_DEFAULT_INDEXER_TYPES (read from
    the pinned sdist's src/models/glm-dsa.cpp), and on GLM-5.2's 78 layers the
    schedule of its config (index_topk_freq 4, index_skip_topk_offset 3)."""
    from tools import upstream

    sdist = upstream.fetch(*gr.LLAMA_CPP_PYTHON)
    member = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/src/models/glm-dsa.cpp"
    with tarfile.open(sdist) as tar:
        source = tar.extractfile(member).read().decode()
    body = re.search(r"GLM_5_2_DEFAULT_INDEXER_TYPES = \{(.*?)\};", source, re.S)[1]
    values = [int(v) for v in re.findall(r"\d+", body)]
    values += [0] * (512 - len(values))  # std::array<uint32_t, LLAMA_MAX_LAYERS>
    assert values == [int(gguf_config._glm_5_2_default_full(i)) for i in range(512)]
    glm52 = SimpleNamespace(num_hidden_layers=78, index_topk_freq=4, index_skip_topk_offset=3)
    assert [gguf_config._glm_5_2_default_full(i) for i in range(78)] == [
        runs_indexer(glm52, i) for i in range(78)]
    assert sum(values[:78]) == 21


@pytest.fixture(scope="module")
def meta(glm52_gguf, glm52_ggufs, tmp_path_factory):
    """The Q4_K_M file's metadata with only output.weight of its tensors (config
    building reads the tensor list for it alone), and a rewriter of it."""
    gguf = gr.gguf_module(glm52_gguf[0])
    src = glm52_ggufs["Q4_K_M"]
    others = tuple(t.name for t in gguf.GGUFReader(src).tensors if t.name != "output.weight")
    tmp = tmp_path_factory.mktemp("meta52")
    base = gr.rewrite(gguf, src, tmp / "meta.gguf", drop=others)
    counter = iter(range(10**6))

    def rewrite(**kw):
        return gr.rewrite(gguf, base, tmp / f"meta-{next(counter)}.gguf", **kw)

    return SimpleNamespace(gguf=gguf, base=base, rewrite=rewrite)


def config_changes(meta, f) -> dict:
    base, got = gg.config_from_gguf(meta.base).to_dict(), gg.config_from_gguf(f).to_dict()
    return {k: got.get(k) for k in base.keys() | got.keys() if got.get(k) != base.get(k)}


# Every metadata key llama.cpp's glm-dsa loader reads as optional (get_key or
# get_key_or_arr with required false: src/llama-model.cpp llama_model_base::
# load_hparams, src/models/glm-dsa.cpp llama_model_glm_dsa::load_arch_hparams):
# {keys dropped: (llama.cpp's default, what the config from a file without them
# has that the file's own does not, or the GGUFError where llama.cpp refuses
# such a file too)}. Keys llama.cpp reads for nothing vLLM runs (general.name,
# embedding_length_out, attention.causal, pooling_type, rope.scaling.finetuned,
# rope.dimension_sections, rope.scaling.yarn_log_mul, which glm-dsa does not read)
# are not listed; a converted file has no rope.scaling.* (see test_rope_scaling).
ALL_SPARSE = ["sparse"] * N_LAYERS
OPTIONAL_KEYS = {
    # the main model then has 7 layers, so the schedule (6 entries) goes too
    ("nextn_predict_layers", "attention.indexer.types"): (
        "0", {"num_nextn_predict_layers": 0, "num_hidden_layers": 7,
              "index_topk_pattern": "FFFSSSF",
              "indexer_types": ["full"] * 3 + ["shared"] * 3 + ["full"],
              "mlp_layer_types": ["dense"] * 2 + ["sparse"] * 5,
              "layer_types": ["deepseek_sparse_attention"] * 7}),
    ("nextn_predict_layers",): (
        "0", r"'glm-dsa.attention.indexer.types' has 6 entries, llama.cpp expects one per "
             r"main-model layer \(7\)"),
    ("expert_count",): ("0", r"'glm-dsa.expert_count' is 0 .* n_expert must be > 0"),
    ("expert_used_count",): ("0", r"'glm-dsa.expert_count' is 8 with 0 used"),
    ("expert_group_count",): ("0 (no grouping)", {}),  # n_group 1
    ("expert_group_used_count",): ("0", {}),  # topk_group 1
    ("feed_forward_length",): ("0", {"intermediate_size": 0}),  # dense tensors then refused
    ("attention.head_count",): ("0", r"'glm-dsa.attention.head_count' is 0 or missing"),
    ("attention.head_count_kv",): ("head_count", {}),  # MLA: one latent head, not read
    ("rope.freq_base",): ("10000", {"rope_parameters": {"rope_type": "default",
                                                        "rope_theta": 10000.0}}),
    ("attention.key_length",): ("n_embd / n_head", {}),  # only rope.dimension_count's default
    ("attention.value_length",): ("n_embd / n_head", {}),
    # default key_length, here kv_lora_rank + rope dims (576)
    ("rope.dimension_count",): ("key_length", r"'glm-dsa.rope.dimension_count' is 576"),
    # then n_embd / n_head = 1024 / 16: the tiny model's 64 rope dims
    ("rope.dimension_count", "attention.key_length"): ("n_embd / n_head", {}),
    ("leading_dense_block_count",): ("0", {"first_k_dense_replace": 0,
                                           "mlp_layer_types": ALL_SPARSE}),
    ("expert_weights_scale",): ("0 (no scaling)", {"routed_scaling_factor": 1.0}),
    ("expert_weights_norm",): ("false", {"norm_topk_prob": False}),
    ("expert_gating_func",): ("none, which glm-dsa makes sigmoid", {}),
    ("attention.key_length_mla",): ("0: not MLA", r"requires MLA"),
    ("attention.value_length_mla",): ("0: not MLA", r"requires MLA"),
    # a 1M context: GLM-5.2's pattern (GLM_5_2_DEFAULT_INDEXER_TYPES)
    ("attention.indexer.types",): (
        "all full below a 1M context, else GLM-5.2's",
        {"index_topk_pattern": "FFFSSS", "indexer_types": ["full"] * 3 + ["shared"] * 3}),
    ("vocab_size",): ("none: the token list's length", {}),
}
# Keys llama.cpp's glm-dsa loader requires.
REQUIRED_KEYS = ("context_length", "embedding_length", "block_count",
                 "expert_feed_forward_length", "attention.layer_norm_rms_epsilon",
                 "expert_shared_count", "attention.q_lora_rank", "attention.kv_lora_rank",
                 "attention.indexer.head_count", "attention.indexer.key_length",
                 "attention.indexer.top_k")


@pytest.mark.parametrize("keys", OPTIONAL_KEYS, ids=["+".join(k) for k in OPTIONAL_KEYS])
def test_optional_keys_take_llama_cpp_defaults(meta, keys):
    _, expect = OPTIONAL_KEYS[keys]
    present = gg.open_gguf(meta.base).fields
    assert all(f"{A}.{k}" in present for k in keys)  # a converted file has them
    f = meta.rewrite(drop_keys=tuple(f"{A}.{k}" for k in keys))
    if isinstance(expect, str):
        with pytest.raises(gg.GGUFError, match=rf"{re.escape(f.name)}: .*{expect}"):
            gg.config_from_gguf(f)
    else:
        assert config_changes(meta, f) == expect


@pytest.mark.parametrize("key", REQUIRED_KEYS)
def test_required_keys(meta, key):
    f = meta.rewrite(drop_keys=(f"{A}.{key}",))
    with pytest.raises(gg.GGUFError, match=rf"{re.escape(str(f))}: metadata key "
                                           rf"'{A}.{re.escape(key)}' is missing"):
        gg.config_from_gguf(f)


def test_defaults_the_loader_acts_on(glm52_gguf, glm52_ggufs, tmp_path):
    """Defaults whose consequence is the loader's: without the schedule a 1M-context
    file is GLM-5.2's pattern, whose layer 1 is full, and this file has no indexer
    there; without feed_forward_length the dense layers have no width (llama.cpp
    refuses the tensors' shapes too); without routing biases or the indexer key
    norm's affine (optional tensors in llama.cpp, no-ops in its graph) the loader
    fills the values that compute the same."""
    gguf = gr.gguf_module(glm52_gguf[0])
    src = glm52_ggufs["bf16"]
    f = gr.rewrite(gguf, src, tmp_path / "no-schedule.gguf",
                   drop_keys=(f"{A}.attention.indexer.types",))
    # (its key norm is optional: 3 tensors)
    with pytest.raises(gg.GGUFError, match=r"missing 3 tensors .*blk\.1\.indexer\."):
        GlmDsaGGUF([f], gg.config_from_gguf(f))
    f = gr.rewrite(gguf, src, tmp_path / "no-ff.gguf", drop_keys=(f"{A}.feed_forward_length",))
    with pytest.raises(gg.GGUFError, match=r"'blk\.[01]\.ffn_(gate|up|down)\.weight' has shape"):
        GlmDsaGGUF([f], gg.config_from_gguf(f))
    optional = ("blk.2.exp_probs_b.bias", "blk.5.indexer.k_norm.weight",
                "blk.5.indexer.k_norm.bias")
    f = gr.rewrite(gguf, src, tmp_path / "no-optional.gguf", drop=optional)
    config = gg.config_from_gguf(f)
    with patch.object(glm_dsa.logger, "info") as info:
        got = dict(GlmDsaGGUF([f], config).weights())
    assert [c for c in info.call_args_list if "optional tensors" in c.args[0]]
    full = dict(GlmDsaGGUF([src], config).weights())
    assert got.keys() == full.keys()
    for name, value in (("model.layers.2.mlp.gate.e_score_correction_bias", 0.0),
                        ("model.layers.5.self_attn.indexer.k_norm.weight", 1.0),
                        ("model.layers.5.self_attn.indexer.k_norm.bias", 0.0)):
        assert torch.equal(got.pop(name), torch.full(full.pop(name).shape, value)), name
    for name in full:
        assert torch.equal(got[name], full[name]), name


def test_schedule_forms(meta):
    """llama.cpp's get_key_or_arr: the schedule is an array of one bool per
    main-model layer or a single value for all; below a 1M context an absent one
    is all full (GLM-5, GLM-5.1); layer 0 cannot share."""
    T = meta.gguf.GGUFValueType
    key = f"{A}.attention.indexer.types"
    f = meta.rewrite(drop_keys=(key,), metadata={f"{A}.context_length": 202752})
    assert gg.config_from_gguf(f).index_topk_pattern == "FFFFFF"
    f = meta.rewrite(drop_keys=(key,), add={key: (True, T.BOOL)})
    assert gg.config_from_gguf(f).index_topk_pattern == "FFFFFF"
    f = meta.rewrite(drop_keys=(key,), add={key: ([1, 0, 1, 1, 0, 1], T.ARRAY, T.INT32)})
    assert gg.config_from_gguf(f).index_topk_pattern == "FSFFSF"
    f = meta.rewrite(metadata={key: [True, False, True, False, False]})
    with pytest.raises(gg.GGUFError, match=r"has 5 entries, llama.cpp expects one per "
                                           r"main-model layer \(6\)"):
        gg.config_from_gguf(f)
    f = meta.rewrite(metadata={key: [False, True, True, False, False, True]})
    with pytest.raises(gg.GGUFError, match=r"makes layer 0 \"shared\""):
        gg.config_from_gguf(f)


def test_per_layer_keys(meta):
    """llama.cpp reads the FFN widths, head and expert counts per block, one value or
    an array of block_count; glm-dsa uses block 0's."""
    T = meta.gguf.GGUFValueType
    key = f"{A}.expert_feed_forward_length"
    f = meta.rewrite(drop_keys=(key,), add={key: ([256] * 7, T.ARRAY, T.UINT32)})
    assert config_changes(meta, f) == {}
    f = meta.rewrite(drop_keys=(key,), add={key: ([256] * 6, T.ARRAY, T.UINT32)})
    with pytest.raises(gg.GGUFError, match=r"'glm-dsa.expert_feed_forward_length' has 6 "
                                           r"entries, llama.cpp expects one per block \(7\)"):
        gg.config_from_gguf(f)


def test_gating_and_rope_scaling(meta):
    """Values llama.cpp accepts: softmax routing, which vLLM's grouped top-k runs too;
    RoPE scaling "none", "linear" with no factor (none), "yarn" (its original
    context defaults to the context length); what vLLM's DeepseekV2 cannot run is
    refused by name."""
    T = meta.gguf.GGUFValueType
    gating = f"{A}.expert_gating_func"
    f = meta.rewrite(metadata={gating: 1})
    assert config_changes(meta, f) == {"scoring_func": "softmax"}
    f = meta.rewrite(metadata={gating: 3})  # SOFTMAX_WEIGHT
    with pytest.raises(gg.GGUFError, match=r"'glm-dsa.expert_gating_func' is 3"):
        gg.config_from_gguf(f)
    kind = f"{A}.rope.scaling.type"
    for value in ("none", "linear"):
        assert config_changes(meta, meta.rewrite(add={kind: (value, T.STRING)})) == {}
    f = meta.rewrite(add={kind: ("yarn", T.STRING), f"{A}.rope.scaling.factor": (4.0, T.FLOAT32)})
    assert config_changes(meta, f) == {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 8e6, "factor": 4.0,
        "original_max_position_embeddings": 1048576}}
    for add, error in (({kind: ("linear", T.STRING), f"{A}.rope.scaling.factor": (2.0, T.FLOAT32)},
                        r"'glm-dsa.rope.scaling.type' is 'linear' with factor 2"),
                       ({kind: ("dynamic", T.STRING)}, r"which llama.cpp does not know"),
                       ({f"{A}.rope.scaling.attn_factor": (2.0, T.FLOAT32)},
                        r"'glm-dsa.rope.scaling.attn_factor' is not 1")):
        with pytest.raises(gg.GGUFError, match=error):
            gg.config_from_gguf(meta.rewrite(add=add))


def test_token_types_are_optional(meta):
    """llama.cpp reads tokenizer.ggml.token_type if present (every token NORMAL
    otherwise): the tokenizer then has every token of the file (the converter's
    UNUSED [PAD<i>] placeholders too) and no added special tokens."""
    f = meta.rewrite(drop_keys=("tokenizer.ggml.token_type",))
    tok = gg.tokenizer_from_gguf(f)
    assert len(tok) == len(gg.field(gg.open_gguf(f), "tokenizer.ggml.tokens"))
    # but the eos and padding tokens the file names
    assert set(tok.all_special_tokens) == {t for t in (tok.eos_token, tok.pad_token) if t}
    assert tok.encode("<|user|>") != gg.tokenizer_from_gguf(meta.base).encode("<|user|>")


# -- the indexer's RoPE layout ------------------------------------------------------------

def vllm_index_scores(config, weights, layer, hidden, qr, keys16=False) -> torch.Tensor:
    """Index scores [T, T] (causal) of vLLM's Indexer.forward (models/deepseek_v2.py)
    with the rotary embedding DeepseekV2's attention builds for it
    (get_rope(..., is_neox_style=not config.indexer_rope_interleave)); its fp8
    quantization of q is left out and its top-k kernel replaced by the score
    the kernel takes the top-k of: sum over heads of relu(q.k) times the weights.
    keys16: the indexer of the 16-bit key cache, which must not quantize q at all."""
    import vllm.model_executor.models.deepseek_v2 as deepseek_v2
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    p = f"model.layers.{layer}.self_attn.indexer."
    w = {k[len(p):]: v.float() for k, v in weights.items() if k.startswith(p)}
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        rope = get_rope(config.qk_rope_head_dim, max_position=config.max_position_embeddings,
                        rope_parameters=config.rope_parameters,
                        is_neox_style=not getattr(config, "indexer_rope_interleave", False))
    k_norm = torch.nn.LayerNorm(config.index_head_dim, eps=1e-6)
    k_norm.load_state_dict({"weight": w["k_norm.weight"], "bias": w["k_norm.bias"]})
    wk_weights_proj = torch.cat([w["wk.weight"], w["weights_proj.weight"]])
    got = {}
    indexer = SimpleNamespace(
        wq_b=lambda x: (x @ w["wq_b.weight"].T, None),
        wk_weights_proj=lambda x: (x @ wk_weights_proj.T, None),
        k_norm=k_norm, n_head=config.index_n_heads, head_dim=config.index_head_dim,
        rope_dim=config.qk_rope_head_dim, is_inplace_rope=False, use_fused_indexer_q=False,
        keys16=keys16,
        quant_block_size=config.index_head_dim, scale_fmt=None,
        softmax_scale=config.index_head_dim ** -0.5, n_head_scale=config.index_n_heads ** -0.5,
        indexer_op=lambda hidden_states, q, k, weights: got.update(q=q, k=k, weights=weights))

    def no_fp8(q, block, **kwargs):
        assert not keys16, "the 16-bit key cache's q was quantized"
        return q, torch.ones(q.shape[0], q.shape[1] // block)

    T = hidden.shape[0]
    with patch.object(deepseek_v2, "per_token_group_quant_fp8", no_fp8), torch.no_grad():
        deepseek_v2.Indexer.forward(indexer, hidden, qr, torch.arange(T), rope)
    assert got["q"].shape == (T, config.index_n_heads, config.index_head_dim)
    assert got["weights"].dtype == torch.float32
    scores = torch.einsum("thd,ud->thu", got["q"], got["k"]).relu()
    scores = torch.einsum("thu,th->tu", scores, got["weights"])
    return scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))


def selects(scores: torch.Tensor, topk: torch.Tensor, k: int) -> torch.Tensor:
    """Per query with more than k candidates: is `topk` the top-k of `scores` (its
    worst pick scores no lower than the best token it left out, up to rounding)?"""
    picked = torch.zeros_like(scores, dtype=torch.bool).scatter(1, topk.long(), True)
    finite = scores.isfinite()
    worst = scores.masked_fill(~picked, float("inf")).amin(1)
    best_left = scores.masked_fill(picked | ~finite, float("-inf")).amax(1)
    scale = scores.masked_fill(~finite, 0).abs().amax(1)
    return (worst >= best_left - 1e-5 * scale)[finite.sum(1) > k]


@pytest.fixture(scope="module")
def indexer_case(glm52_gguf, glm52_ggufs):
    from transformers import AutoModelForCausalLM

    f = glm52_ggufs["bf16"]
    config = gg.config_from_gguf(f)
    weights = dict(GlmDsaGGUF([f], config).weights())
    hf = AutoModelForCausalLM.from_pretrained(glm52_gguf[1], dtype=torch.float32)
    torch.manual_seed(0)
    T = 2 * config.index_topk
    hidden = torch.randn(1, T, config.hidden_size)
    positions = torch.arange(T)[None]
    return SimpleNamespace(config=config, weights=weights, hf=hf, hidden=hidden,
                           positions=positions, cos_sin=hf.model.rotary_emb(hidden, positions),
                           mask=torch.ones(1, T, T, dtype=torch.bool).tril())


def test_indexer_rope_layout_follows_transformers(indexer_case):
    """transformers' GlmMoeDsaIndexer (our reference: implementations disagree)
    rotates interleaved pairs over the first qk_rope_head_dim dims of each indexer
    head with the model's rope_theta. The GGUF's config gives vLLM's indexer that
    layout (indexer_rope_interleave, rope_parameters, vLLM's [rope | nope] split):
    on every full layer vLLM's scores select transformers' top-k for every query.
    The alternatives, each selecting almost never the same top-k, show the test
    tells them apart: NeoX (half-split) pairs as DeepSeek-V3.2's indexer, RoPE on
    the last dims of the head, and the default rope_theta 10000."""
    c = indexer_case
    config = c.config
    assert [i for i, layer in enumerate(c.hf.model.layers)
            if layer.self_attn.indexer is not None] == FULL
    neox = copy.deepcopy(config)
    neox.indexer_rope_interleave = False
    theta = copy.deepcopy(config)
    theta.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    r, d = config.qk_rope_head_dim, config.index_head_dim
    last = torch.cat([torch.arange(d - r, d), torch.arange(d - r)])  # rope on the last dims
    for layer in FULL:
        attn = c.hf.model.layers[layer].self_attn
        with torch.no_grad():
            qr = attn.q_a_layernorm(attn.q_a_proj(c.hidden))
            topk = attn.indexer(c.hidden, qr, c.cos_sin, c.mask, c.positions)[0]
        args = (layer, c.hidden[0], qr[0])
        ok = selects(vllm_index_scores(config, c.weights, *args), topk, config.index_topk)
        assert ok.all(), (layer, ok.float().mean())
        rope_last = dict(c.weights)
        p = f"model.layers.{layer}.self_attn.indexer."
        rope_last[p + "wq_b.weight"] = c.weights[p + "wq_b.weight"].view(
            config.index_n_heads, d, -1)[:, last].reshape(config.index_n_heads * d, -1)
        for name in ("wk.weight", "k_norm.weight", "k_norm.bias"):
            rope_last[p + name] = c.weights[p + name][last]
        for other, weights in ((neox, c.weights), (theta, c.weights), (config, rope_last)):
            wrong = selects(vllm_index_scores(other, weights, *args), topk, config.index_topk)
            assert wrong.float().mean() < 0.05, (layer, wrong.float().mean())


def test_indexer_16bit_keys_select_as_transformers(indexer_case):
    """With the 16-bit key cache (VLLM_SPARSE_INDEXER_CACHE=16bit) vLLM's
    Indexer.forward hands the op q as computed (no fp8 quantization) and the head
    weights scaled by the softmax and head scales alone: on every full layer the
    scores still select transformers' top-k for every query."""
    c = indexer_case
    for layer in FULL:
        attn = c.hf.model.layers[layer].self_attn
        with torch.no_grad():
            qr = attn.q_a_layernorm(attn.q_a_proj(c.hidden))
            topk = attn.indexer(c.hidden, qr, c.cos_sin, c.mask, c.positions)[0]
        scores = vllm_index_scores(c.config, c.weights, layer, c.hidden[0], qr[0], keys16=True)
        ok = selects(scores, topk, c.config.index_topk)
        assert ok.all(), (layer, ok.float().mean())
