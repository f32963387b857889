# SPDX-License-Identifier: Apache-2.0
"""The transformers reference's fp8 indexer (tests/models/glm5_hf_reference.py
--indexer-fp8): without the rounding it is transformers' own indexer, token for token;
with it, every value is within e4m3's rounding of the float32 one and the selection
moves on the tiny random GLM-5. Its --fp16-residual-scale: the layers as vLLM runs
them in float16."""

import pytest
import torch

from tests.models import glm5_hf_reference as ref
from tests.models.glm5_tiny import TINY_GLM5


@pytest.fixture
def model():
    from transformers import AutoModelForCausalLM, GlmMoeDsaConfig

    cfg = {k: v for k, v in TINY_GLM5.items() if k not in ("architectures", "model_type")}
    cfg["num_nextn_predict_layers"] = 0
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(GlmMoeDsaConfig(**cfg), dtype=torch.float32).eval()


@pytest.fixture
def indexer_cls(monkeypatch):
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m

    monkeypatch.setattr(m.GlmMoeDsaIndexer, "forward", m.GlmMoeDsaIndexer.forward)
    return m.GlmMoeDsaIndexer


def selections(model, ids):
    """Each layer's top-k indices for the prompt."""
    got = []
    hooks = [layer.self_attn.indexer.register_forward_hook(lambda _m, _i, o: got.append(o))
             for layer in model.model.layers]
    with torch.no_grad():
        logits = model(ids).logits
    for h in hooks:
        h.remove()
    return logits, got


def test_e4m3_rows_rounding_bound():
    x = torch.randn(64, 128) * torch.logspace(-3, 3, 64).unsqueeze(1)
    y = ref.e4m3_rows(x)
    scale = x.abs().amax(-1, keepdim=True) / 448.0
    # 3 mantissa bits: half an ulp is 2^-4 of the value; e4m3's subnormal step is 2^-9
    assert ((y - x).abs() <= x.abs() * 2**-4 + scale * 2**-10).all()
    assert not torch.equal(x, y)
    assert torch.equal(ref.e4m3_rows(y), y)  # on the grid already


def test_fp8_indexer_is_transformers_indexer_without_rounding(model, indexer_cls, monkeypatch):
    ids = torch.randint(3, TINY_GLM5["vocab_size"], (1, 300), generator=torch.Generator().manual_seed(1))
    logits, picked = selections(model, ids)
    monkeypatch.setattr(ref, "e4m3_rows", lambda x: x)
    original = indexer_cls.forward
    ref.use_fp8_indexer()
    assert indexer_cls.forward is not original
    logits2, picked2 = selections(model, ids)
    assert all(torch.equal(a, b) for a, b in zip(picked, picked2))
    torch.testing.assert_close(logits2, logits, rtol=1e-5, atol=1e-5)


def test_fp8_indexer_moves_the_selection(model, indexer_cls):
    ids = torch.randint(3, TINY_GLM5["vocab_size"], (1, 300), generator=torch.Generator().manual_seed(1))
    _, picked = selections(model, ids)
    ref.use_fp8_indexer()
    _, picked2 = selections(model, ids)
    # top-k sets of the queries that see more than top-k tokens (order aside): some
    # differ, some are kept
    k = TINY_GLM5["index_topk"]
    same = [(torch.sort(a[:, k:], -1).values == torch.sort(b[:, k:], -1).values)
            .all(-1).float().mean() for a, b in zip(picked, picked2)]
    assert min(same) < 1.0 and max(same) > 0.0


@pytest.mark.parametrize("which", ["q", "k"])
def test_fp8_indexer_rounds_only_what_it_is_told(model, indexer_cls, monkeypatch, which):
    """`--indexer-fp8 q` / `k`: only the queries or only the keys go through e4m3."""
    seen = []

    def spy(x):
        seen.append(x.shape)
        return x
    monkeypatch.setattr(ref, "e4m3_rows", spy)
    ids = torch.randint(3, TINY_GLM5["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(2))
    ref.use_fp8_indexer(which)
    selections(model, ids)
    heads = TINY_GLM5["index_n_heads"]
    assert seen and all((len(s) == 4 and s[2] == heads) == (which == "q") for s in seen)
    seen.clear()
    ref.use_fp8_indexer("qk")
    selections(model, ids)
    dims = [len(s) for s in seen]
    assert dims.count(4) == dims.count(3) > 0  # each call rounds q and k


def vllm_fp16_layer_forward(self, hidden_states, attention_mask=None, position_ids=None,
                            past_key_values=None, use_cache=False, position_embeddings=None,
                            prev_topk_indices=None, **kwargs):
    """GlmMoeDsaDecoderLayer as vLLM's DeepseekV2DecoderLayer runs it in float16: the
    attention output, layer 0's residual and the MLP/MoE output divided by
    routed_scaling_factor, so the residual stream is carried divided by it."""
    s = self.self_attn.config.routed_scaling_factor
    residual = hidden_states
    h, _, topk = self.self_attn(
        hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
        position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache,
        position_embeddings=position_embeddings, prev_topk_indices=prev_topk_indices, **kwargs)
    if self.self_attn.layer_idx == 0:
        residual = residual / s
    hidden_states = residual + h / s
    return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states)) / s, topk


def test_fp16_residual_scale_is_vllms_scaled_stream(model, monkeypatch):
    """--fp16-residual-scale (eps x s^2 on the stream's norms) gives the logits of the
    layers run as vLLM runs them in float16 (the stream divided by s); dividing those
    norms' eps by s^2 there instead (the model's deepseek_fp16_residual_scale.py) gives the
    model's own; and on this model the scaled stream is not the model."""
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m

    ids = torch.randint(3, TINY_GLM5["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(3))
    s = model.config.routed_scaling_factor
    stream_norms = ([layer.post_attention_layernorm for layer in model.model.layers]
                    + [layer.input_layernorm for layer in model.model.layers[1:]]
                    + [model.model.norm])
    with torch.no_grad():
        plain = model(ids).logits
        monkeypatch.setattr(m.GlmMoeDsaDecoderLayer, "forward", vllm_fp16_layer_forward)
        scaled = model(ids).logits
        for norm in stream_norms:
            norm.variance_epsilon /= s**2
        matched = model(ids).logits
        for norm in stream_norms:
            norm.variance_epsilon *= s**2
        monkeypatch.undo()
        ref.use_fp16_residual_scale(model)
        flag = model(ids).logits
    torch.testing.assert_close(flag, scaled, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(matched, plain, rtol=1e-4, atol=1e-4)
    assert (scaled - plain).abs().max() > 1e-3  # 10x the tolerance above
