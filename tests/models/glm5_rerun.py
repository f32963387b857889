# SPDX-License-Identifier: Apache-2.0
"""How far apart two identical vLLM runs of the tiny GLM-5 are, per path.

    python -m tests.models.glm5_rerun --out DIR [--mem 0.05] [--json REPORT]

Each path (attention backend x indexer) runs twice on the same checkpoint with the
same settings (eager; bf16, plus fp16 for TRITON_MLA_SPARSE + portable indexer, as
FlashMLA takes no fp16), all runs as parallel processes; the report gives, per path,
the prompt-logprob difference and greedy agreement between its two runs
(glm5_runs.compare). A deterministic path
gives mean 0. Used to locate run-to-run variation, not to bound it.
"""

import argparse
import concurrent.futures
import json
from pathlib import Path

from tests.models.glm5_runs import compare, generate
from tests.models.glm5_tiny import make_tiny_glm5

PATHS = {
    "flashmla+deepgemm": {"attention_backend": "FLASHMLA_SPARSE", "indexer": "deepgemm",
                          "dtype": "bfloat16"},
    "flashmla+portable": {"attention_backend": "FLASHMLA_SPARSE", "indexer": "triton",
                          "dtype": "bfloat16"},
    "triton+deepgemm": {"attention_backend": "TRITON_MLA_SPARSE", "indexer": "deepgemm",
                        "dtype": "bfloat16"},
    "triton+portable": {"attention_backend": "TRITON_MLA_SPARSE", "indexer": "triton",
                        "dtype": "bfloat16"},
    "triton+portable fp16": {"attention_backend": "TRITON_MLA_SPARSE", "indexer": "triton",
                             "dtype": "float16"},
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--mem", default="0.05", help="GPU memory fraction of each run")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    out = Path(args.out)
    model = make_tiny_glm5(out / "tiny-glm5")
    jobs = [(name, i) for name in PATHS for i in (0, 1)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futs = {job: pool.submit(generate, model, out / f"{job[0]}-{job[1]}.json".replace(" ", "_"),
                                 gpu_memory_utilization=args.mem, **PATHS[job[0]])
                for job in jobs}
        runs = {}
        for job, fut in futs.items():
            try:
                runs[job] = fut.result()
            except AssertionError as e:
                runs[job] = {"error": str(e)[-400:]}
    report = {}
    for name in PATHS:
        a, b = runs[(name, 0)], runs[(name, 1)]
        report[name] = ({"error": a.get("error") or b.get("error")} if "error" in a or "error" in b
                        else compare(a, b))
        print(f"{name}: {json.dumps(report[name])}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
