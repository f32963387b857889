# SPDX-License-Identifier: Apache-2.0
"""The throughput benchmark's model has GLM-5's per-layer shape, as the end-to-end
issue states it (hidden 6144, 64 heads, 32 indexer heads, top-k 2048, 256-dim v
heads) plus GLM-5's MLA ranks, and loads as a GlmMoeDsaConfig; its decode step
time comes from each request's token timestamps."""

from types import SimpleNamespace

from benchmarks import glm5_throughput as bench


def test_glm5_per_layer_shape():
    from transformers import GlmMoeDsaConfig

    d = bench.glm5_config(layers=4, experts=16, vocab=154880)
    expect = {"hidden_size": 6144, "num_attention_heads": 64, "index_n_heads": 32,
              "index_topk": 2048, "v_head_dim": 256, "kv_lora_rank": 512,
              "qk_rope_head_dim": 64, "qk_nope_head_dim": 192, "q_lora_rank": 2048,
              "index_head_dim": 128, "num_hidden_layers": 4, "n_routed_experts": 16}
    assert {k: d[k] for k in expect} == expect
    cfg = GlmMoeDsaConfig(**{k: v for k, v in d.items() if k != "architectures"})
    assert cfg.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    assert d["topk_method"] == "noaux_tc" and d["indexer_rope_interleave"] is True


def test_decode_step_from_token_timestamps():
    # three requests: 11 tokens over 1.0 s (0.1 s/step), 11 over 2.0 s, 5 over 0.8 s
    def out(first, last, n):
        return SimpleNamespace(metrics=SimpleNamespace(
            first_token_ts=first, last_token_ts=last, num_generation_tokens=n))

    outs = [out(10.0, 11.0, 11), out(10.5, 12.5, 11), out(10.2, 11.0, 5)]
    assert abs(bench.decode_step_s(outs) - 0.2) < 1e-12  # median of 0.1, 0.2, 0.2
