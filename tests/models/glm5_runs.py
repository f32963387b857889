# SPDX-License-Identifier: Apache-2.0
"""Run tests.models.glm5_generate (vLLM) and tests.models.glm5_hf_reference
(transformers fp32) in subprocesses and compare their JSON outputs."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(module, out, args, env=None):
    """`python -m module --out OUT ARGS...` from the repository root; its JSON."""
    cmd = [sys.executable, "-m", module, "--out", str(out), *args]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    # the error lines first: a failed engine start ends with teardown warnings
    errors = [line for line in res.stderr.splitlines() if re.search(r"\w(Error|Exception): ", line)]
    assert res.returncode == 0, ("\n".join(errors[-3:]) + "\n---\n" + res.stdout[-3000:]
                                 + res.stderr[-5000:])
    return json.loads(Path(out).read_text())


def generate(model, out, eager=True, env=None, **kw):
    """vLLM on `model` (checkpoint dir or .gguf); kw become --flags."""
    args = ["--model", str(model)] + (["--eager"] if eager else [])
    for k, v in kw.items():  # a value of "" is a bare flag
        args += [f"--{k.replace('_', '-')}"] + ([v] if v != "" else [])
    return _run("tests.models.glm5_generate", out, args, env=env)


def hf_reference(model_dir, out, *, device="cuda", dtype="float32", max_tokens=32,
                 indexer_fp8=False):
    """transformers (fp32 unless `dtype`) on the checkpoint dir."""
    return _run("tests.models.glm5_hf_reference", out,
                ["--model", str(model_dir), "--device", device, "--dtype", dtype,
                 "--max-tokens", str(max_tokens), *(["--indexer-fp8"] if indexer_fp8 else [])])


def compare(a, b, split_at=None):
    """Mean/max |delta| of prompt-token logprobs (over the tokens both top-5 lists
    hold, the prompt token included); greedy agreement up to the first parting,
    and whether every parting was at a near-tie (each run's token in the other's
    top-5). With `split_at` (a model's index_topk) also the mean over the prompt
    positions that see at most that many tokens (`mean_short_context`: the sparse
    top-k selects all of them) and over the others (`mean_long_context`)."""
    deltas, agree, total, ties_ok = [], 0, 0, True
    short = []
    for oa, ob in zip(a["outputs"], b["outputs"]):
        pairs = zip(oa["prompt_logprobs"][1:], ob["prompt_logprobs"][1:])
        for context, (pa, pb) in enumerate(pairs, start=1):
            d = [abs(pa[t] - pb[t]) for t in set(pa) & set(pb)]
            deltas += d
            short += d if split_at is not None and context <= split_at else []
        for i, (ta, tb) in enumerate(zip(oa["tokens"], ob["tokens"])):
            total += 1
            if ta != tb:
                ties_ok &= str(tb) in oa["logprobs"][i] and str(ta) in ob["logprobs"][i]
                break
            agree += 1
    out = {"mean": sum(deltas) / len(deltas), "max": max(deltas),
           "greedy_agreement": agree / total, "parted_at_near_tie": ties_ok}
    if split_at is not None:
        long = len(deltas) - len(short)
        out["mean_short_context"] = sum(short) / len(short) if short else None
        out["mean_long_context"] = (sum(deltas) - sum(short)) / long if long else None
    return out


def within_rerun(got: dict, rerun: dict) -> bool:
    """Two runs that should compute the same thing (compare() results) differ no
    more than 2x what two identical runs differ (vLLM is not bitwise
    reproducible run to run), plus 0.02 nats."""
    return got["mean"] <= 2 * rerun["mean"] + 0.02
