# SPDX-License-Identifier: Apache-2.0
"""Greedy output of the trained tiny GLM-5's 8 corpus prompts (glm5_mtp_generate.py's)
generated in one batch against each prompt alone, in one engine, with or without MTP:
whether batch composition alone changes a file's greedy output.

    python -m tests.models.glm5_batch_alone FILE.gguf N

N = 0: no speculative decoding, else MTP with N draft tokens. TRITON_MLA_SPARSE for
target and draft, the portable indexer, float16, eager. Prints "DIAG N [step of the
first difference per prompt, or null]" and the attention layer names; writes
$OUT/diag-N.json (both outputs).
"""

import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from tests.models.glm5_trained import prompts
from tests.plugins.vllm_report_capability import vllm_report_capability as hook
hook.use_indexer("triton")  # the platform reports no DeepGEMM (the test hook, here)
from vllm import LLM, SamplingParams
f, n = sys.argv[1], int(sys.argv[2])
spec = {"method": "mtp", "num_speculative_tokens": n, "attention_backend": "TRITON_MLA_SPARSE"}
llm = LLM(model=f, skip_tokenizer_init=True, dtype="float16", max_model_len=2048, block_size=64,
          max_num_seqs=8, enforce_eager=True, seed=0, gpu_memory_utilization=0.1,
          kv_cache_memory_bytes=1 << 30, attention_config={"backend": "TRITON_MLA_SPARSE"},
          speculative_config=spec if n else None)
from vllm.config import get_layers_from_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
print("LAYERS", sorted(get_layers_from_vllm_config(llm.llm_engine.vllm_config, AttentionLayerBase)))
P = [{"prompt_token_ids": ids} for ids in prompts((40, 64, 96, 128, 160, 200, 256, 320))]
sp = SamplingParams(temperature=0, max_tokens=64, logprobs=2, detokenize=False, ignore_eos=True)
batch = [list(o.outputs[0].token_ids) for o in llm.generate(P, sp, use_tqdm=False)]
alone = [list(llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids) for p in P]
print("DIAG", n, json.dumps([next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), None)
                             for x, y in zip(batch, alone)]))
json.dump({"batch": batch, "alone": alone}, open(os.path.join(os.environ.get("OUT", "."), f"diag-{n}.json"), "w"))
