# SPDX-License-Identifier: Apache-2.0
"""The host calls the overlay cut from a step (issue 69), one call's cost after the cuts
and before them.

    python -m benchmarks.host_call_cost --json out.json --md out.md

Each figure is µs a call, the best of --repeats runs of --number calls:
- an NVML session (`nvmlInit` and `nvmlShutdown`, what vLLM 0.26.0's `with_nvml_context`
  opens around every `has_device_capability` call), before this process initializes CUDA
  and after;
- `has_device_capability` on vLLM's NVML platform, with CUDA initialized as in a worker:
  the overlay's (no session of its own) and inside a session, as 0.26.0's (before 2f1a54c);
- the launch records for a batch-1 GLM-5 step as on SM120 (`sparse_mla_launch`, the GGUF
  `dense_launch` and `moe_launch`): chosen once (the overlay's) and their rules run at
  every call (before ae67450).
A GPU host's benchmark: the sparse MLA rules need Triton, which vLLM swaps for a
placeholder where it finds no GPU driver (the CPU tests run them under Triton's
interpreter). Where vLLM's CUDA platform is not the NVML one, the NVML rows are left out
and the report says why. docs/kernels.md says how often a step asks each call.
"""

import argparse
import json
import timeit
from pathlib import Path

# GLM-5's attention for a batch-1 decode step: heads, key width (latent + rope), latent
# width, the indexer's top-k; an SM120 card's opt-in shared memory and SMs (RTX PRO 6000).
HEADS, HEAD_DIM, KV_LORA, TOPK = 64, 576, 512, 2048
SM120_SHARED_MEM, SM120_SMS = 101376, 188
DENSE_ROWS = 6144  # GLM-5's hidden size: the output rows of its o_proj


def per_call_us(fn, number: int, repeats: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeats)) / number * 1e6


def nvml_rows(number: int, nvml_number: int,
              repeats: int) -> tuple[list[dict], str | None]:
    """The NVML session's and `has_device_capability`'s rows, or none and the reason;
    what opens a session runs `nvml_number` calls a run."""
    from vllm.platforms import current_platform

    skipped = f"vLLM's platform is {type(current_platform).__name__}, not NvmlCudaPlatform"
    if not current_platform.is_cuda():
        return [], skipped
    from vllm.platforms import cuda

    if not isinstance(current_platform, cuda.NvmlCudaPlatform):
        return [], skipped

    def session():
        cuda.pynvml.nvmlInit()
        cuda.pynvml.nvmlShutdown()

    rows = [{"call": "an NVML session, CUDA not initialized", "after_us": None,
             "before_us": per_call_us(session, nvml_number, repeats)}]
    import torch

    torch.zeros(1, device="cuda")  # a worker's state: CUDA up, the capability read
    current_platform.get_device_capability()
    rows.append({"call": "an NVML session, CUDA initialized", "after_us": None,
                 "before_us": per_call_us(session, nvml_number, repeats)})
    platform = type(current_platform)
    as_before = cuda.with_nvml_context(platform.has_device_capability)
    rows.append({"call": "has_device_capability", "after_us": per_call_us(
        lambda: platform.has_device_capability(90), number, repeats),
        "before_us": per_call_us(lambda: as_before(90), nvml_number, repeats)})
    return rows, None


def launch_rows(number: int, repeats: int) -> list[dict]:
    import gguf
    import torch

    from vllm.v1.attention.ops import sparse_mla_launch as sml
    from vllm_gguf_plugin.quantization import gguf_kernels as gk

    sm120 = sml.SparseMLADevice(120, SM120_SHARED_MEM, SM120_SMS)
    attn = (sm120, 1, HEADS, HEAD_DIM, KV_LORA, TOPK, torch.bfloat16, torch.bfloat16)
    q4k, q6k = int(gguf.GGMLQuantizationType.Q4_K), int(gguf.GGMLQuantizationType.Q6_K)
    calls = {
        "sparse_mla_launch": (lambda: sml.sparse_mla_launch(*attn),
                              lambda: sml._cached_launch.__wrapped__(*attn, False)),
        "dense_launch": (lambda: gk.dense_launch(q4k, 1, DENSE_ROWS, batch_invariant=False),
                         lambda: gk.dense_launch.__wrapped__(q4k, 1, DENSE_ROWS,
                                                             batch_invariant=False)),
        "moe_launch": (lambda: gk.moe_launch(q4k, q6k, 1, batch_invariant=False),
                       lambda: gk.moe_launch.__wrapped__(q4k, q6k, 1, batch_invariant=False)),
    }
    rows = []
    for name, (after, before) in calls.items():
        assert after() == before(), name  # the cached record is the rules' own
        rows.append({"call": name, "after_us": per_call_us(after, number, repeats),
                     "before_us": per_call_us(before, number, repeats)})
    return rows


def markdown(report: dict) -> str:
    def cell(us):
        return "-" if us is None else f"{us:.3f}"

    lines = ["| µs a call | after the cuts | before |", "|---|---:|---:|"]
    lines += [f"| {r['call']} | {cell(r['after_us'])} | {cell(r['before_us'])} |"
              for r in report["rows"]]
    if report["nvml_skipped"]:
        lines.append(f"\nNVML rows left out: {report['nvml_skipped']}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--number", type=int, default=2000, help="calls a run")
    p.add_argument("--nvml-number", type=int, default=50,
                   help="calls a run of the NVML session rows (milliseconds each where "
                        "no other session is open)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json")
    p.add_argument("--md")
    args = p.parse_args(argv)
    if min(args.number, args.nvml_number, args.repeats) < 1:
        p.error("--number, --nvml-number and --repeats take 1 or more")
    rows, skipped = nvml_rows(args.number, args.nvml_number, args.repeats)
    report = {"args": vars(args), "rows": rows + launch_rows(args.number, args.repeats),
              "nvml_skipped": skipped}
    text = markdown(report)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.md:
        Path(args.md).write_text(text)
    return report


if __name__ == "__main__":
    main()
