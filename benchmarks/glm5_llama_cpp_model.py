# SPDX-License-Identifier: Apache-2.0
r"""A GLM-5-shaped GGUF made by llama.cpp's own tools, for benchmarks/glm5_vs_llama_cpp.py.

    python -m benchmarks.glm5_llama_cpp_model --out DIR [--layers 3] [--experts 256]
        [--quants Q4_K_M IQ2_M] [--intermediate bf16|q8_0] [--work-dir DIR] [--keep]
        [--llama-imatrix BIN] [--small] [--variant NAME:PATTERN=TYPE[,PATTERN=TYPE] ...]
        [--intermediate-dir DIR]

The model has GLM-5's per-layer dimensions (hidden 6144, 64 heads, q_lora 2048,
kv_lora 512, rope 64 + nope 192, v 256; 256 routed experts of 2048 with top-8 and
one shared expert; the DSA indexer 32 heads x 128 with top-k 2048; the first layer
dense with intermediate 12288; GLM-5's vocabulary size 154880) with few layers
(`--layers`, the first dense) and random weights from a fixed seed, initialized as
tests/models/glm5_tiny.py initializes the tiny model. Steps:
1. an HF checkpoint (config.json, sharded safetensors written one shard at a time, so
   that the 44 GB of a 3-layer model never sit in memory; names and shapes come from
   transformers' GlmMoeDsa on the meta device, saved as save_pretrained names them) and
   the tests' tokenizer (gguf_reference.write_tokenizer: a small byte-level BPE with
   GLM's split regex; llama.cpp's converter pads the vocabulary to vocab_size);
2. llama.cpp's convert_hf_to_gguf.py (gguf_reference.convert, the pinned sdist's
   converter) to a bf16 GGUF (`--intermediate q8_0` writes q8_0 instead, half the disk;
   llama-quantize then needs --allow-requantize, which is passed);
3. llama-quantize (gguf_reference.llama_quantize: built here from the same sdist, or
   VLLM_OVERLAY_LLAMA_QUANTIZE) to each of `--quants`.

IQ2_M needs an importance matrix (gguf_reference.NEEDS_IMATRIX: llama.cpp's
quantizer refuses IQ2_S tensors without one, and IQ2_S is IQ2_M's default type):
the script first runs llama.cpp's `llama-imatrix` on the intermediate GGUF over a
generated text (gguf_reference.make_imatrix: 16 chunks of 512 tokens, about 256
routed tokens per expert and layer, so every expert should get data) and passes its
output with `--imatrix`: a real importance matrix of this random model, no dummy.
The binary is `--llama-imatrix` (env LLAMA_IMATRIX; the CUDA one of
tools/gpu-host/build-llama-cpp-cuda.sh for the full-size model), else the CPU one
the tests build.

Disk (default 3 layers, 22.1B parameters): the checkpoint 44 GB, the bf16 GGUF 44 GB
(q8_0: 23 GB), Q4_K_M about 13 GB, IQ2_M about 8 GB. The checkpoint is deleted after
conversion and the intermediate GGUF after quantization unless `--keep`; on the
64 GiB H200 host put the checkpoint in memory (`--work-dir /dev/shm/glm5`) and use
`--intermediate q8_0` or fewer layers (`--intermediate-dir` moves the intermediate GGUF, e.g.
into memory beside the checkpoint). The script checks free space first.

`--variant NAME:PATTERN=TYPE` quantizes each of `--quants` once more from the same
intermediate with llama-quantize's `--tensor-type PATTERN=TYPE` overrides, to
DIR/...-QUANT-NAME.gguf: e.g. `q6down:blk\.1\.ffn_down=q6_k` gives a 3-layer Q4_K_M file's
layer 1 the Q6_K down projections that Q4_K_M gives its last layer (llama.cpp's
`use_more_bits` layers), so that it differs from the 2-layer file by one such layer.

`--small` makes a model of the same structure with small dimensions (hidden 256,
4 heads, 8 experts of 256, vocab 2048; GLM-5's MLA head dims) in seconds, for the
CPU test. Writes DIR/model.json: the config, the files and their sizes.
"""

import argparse
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path


from tests.models.glm5_tiny import TINY_GLM5
from tests.models.quantization import gguf_reference as gr

# GLM-5's per-layer dimensions (its config.json; transformers' GlmMoeDsaConfig defaults)
GLM5_DIMS = {
    "hidden_size": 6144, "num_attention_heads": 64, "num_key_value_heads": 64,
    "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 192,
    "qk_head_dim": 256, "v_head_dim": 256,
    "n_routed_experts": 256, "moe_intermediate_size": 2048, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "intermediate_size": 12288,
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048,
    "vocab_size": 154880, "max_position_embeddings": 202752,
}
SMALL_DIMS = {
    **GLM5_DIMS, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 128, "n_routed_experts": 8, "moe_intermediate_size": 256,
    "num_experts_per_tok": 2, "intermediate_size": 512, "index_n_heads": 4, "index_topk": 64,
    "vocab_size": 2048, "max_position_embeddings": 4096,
}
# bits per weight, for the disk estimate only
BPW = {"bf16": 16.0, "q8_0": 8.5, "Q4_K_M": 4.9, "IQ2_M": 2.9, "Q2_K": 3.0}
SHARD_BYTES = 2 << 30


def glm5_config(layers: int, small: bool = False, **overrides) -> dict:
    """The checkpoint's config.json: the tiny GLM-5's (glm5_tiny.TINY_GLM5: router,
    rope, indexer settings) with GLM-5's dimensions (or SMALL_DIMS) and `layers`
    layers, the first dense; no MTP block."""
    if layers < 2:
        raise ValueError("--layers counts the dense first layer: at least 2")
    cfg = {**TINY_GLM5, **(SMALL_DIMS if small else GLM5_DIMS), **overrides}
    cfg.update({
        "num_hidden_layers": layers, "first_k_dense_replace": 1,
        "mlp_layer_types": ["dense"] + ["sparse"] * (layers - 1),
        "indexer_types": ["full"] * layers,
        "layer_types": ["deepseek_sparse_attention"] * layers,
        "num_nextn_predict_layers": 0,
    })
    return cfg


def checkpoint_tensors(cfg: dict) -> dict:
    """{name: shape} of the checkpoint as save_pretrained writes it (per-expert names),
    from transformers' GlmMoeDsa built on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM, GlmMoeDsaConfig
    from transformers.core_model_loading import revert_weight_conversion

    config = GlmMoeDsaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = revert_weight_conversion(model, dict(model.state_dict()))
    return {name: tuple(t.shape) for name, t in sorted(state.items())}


def init_tensor(name: str, shape: tuple, gen):
    """glm5_tiny's initialization: norms 1, lm_head N(0, 4/sqrt(in)) (peaked
    distributions), other matrices N(0, 0.5/sqrt(in)), vectors 0; bf16, generated in
    row blocks so that a 154880 x 6144 matrix needs no fp32 copy."""
    import torch

    if "norm" in name and name.endswith("weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if len(shape) < 2:
        return torch.zeros(shape, dtype=torch.bfloat16)
    std = (4.0 if name == "lm_head.weight" else 0.5) / shape[-1] ** 0.5
    out = torch.empty(shape, dtype=torch.bfloat16)
    rows = max(1, (64 << 20) // (4 * shape[-1]))
    flat = out.view(-1, shape[-1])
    for i in range(0, flat.shape[0], rows):
        block = torch.randn((min(rows, flat.shape[0] - i), shape[-1]), generator=gen)
        flat[i:i + rows] = (block * std).to(torch.bfloat16)
    return out


def write_checkpoint(cfg: dict, path: Path, seed: int = 0, shapes: dict | None = None) -> Path:
    """config.json, safetensors shards (+ index) and the tests' tokenizer in `path`."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    shapes = shapes or checkpoint_tensors(cfg)
    gen = torch.Generator().manual_seed(seed)
    shards: list[list[str]] = []
    current, size = {}, 0

    def flush():
        save_file(current, path / f"shard-{len(shards) + 1}.tmp", metadata={"format": "pt"})
        shards.append(list(current))
        current.clear()

    for name, shape in shapes.items():
        current[name] = init_tensor(name, shape, gen)
        size += current[name].numel() * 2
        if size >= SHARD_BYTES:
            flush()
            size = 0
    if current:
        flush()
    weight_map = {}
    for i, names in enumerate(shards, 1):
        final = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        (path / f"shard-{i}.tmp").rename(path / final)
        weight_map.update(dict.fromkeys(names, final))
    total = 2 * sum(math.prod(s) for s in shapes.values())
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    gr.write_tokenizer(path, cfg["vocab_size"])
    return path


def disk_plan(params: int, intermediate: str, quants: list[str],
              variants: tuple[str, ...] = ()) -> dict:
    """Estimated bytes of each file the script writes."""
    plan = {"checkpoint": 2 * params, intermediate: int(params * BPW[intermediate] / 8)}
    for q in quants:
        for name in ("", *variants):
            plan[f"{q}-{name}" if name else q] = int(params * BPW.get(q, 4.0) / 8)
    return plan


def parse_variant(text: str) -> tuple[str, tuple[str, ...]]:
    """NAME:PATTERN=TYPE[,PATTERN=TYPE] -> (NAME, llama-quantize's --tensor-type args)."""
    name, _, overrides = text.partition(":")
    pairs = [o for o in overrides.split(",") if o]
    if not re.fullmatch(r"[A-Za-z0-9_]+", name) or not pairs or not all(
            re.fullmatch(r"[^=]+=[A-Za-z0-9_]+", o) for o in pairs):
        raise argparse.ArgumentTypeError(
            f"--variant {text!r}: want NAME:PATTERN=TYPE[,PATTERN=TYPE], NAME of letters, "
            "digits and _")
    return name, tuple(a for o in pairs for a in ("--tensor-type", o))


def check_space(plan: dict, work: Path, out: Path, intermediate: str, keep: bool,
                inter_dir: Path | None = None) -> None:
    """Fail early when a peak (checkpoint + intermediate GGUF, then the intermediate
    GGUF + the quants) does not fit the free space of the filesystems that hold them
    (work: the checkpoint; inter_dir, default out: the intermediate; out: the quants)."""
    inter_dir = inter_dir or out
    for d in (work, out, inter_dir):
        d.mkdir(parents=True, exist_ok=True)
    quants = sum(v for k, v in plan.items() if k not in ("checkpoint", intermediate))
    peaks = [[(work, plan["checkpoint"]), (inter_dir, plan[intermediate])],
             [(inter_dir, plan[intermediate]), (out, quants),
              (work, plan["checkpoint"] if keep else 0)]]
    for peak in peaks:
        need: dict[int, tuple[Path, int]] = {}
        for where, n in peak:
            dev = os.stat(where).st_dev
            first, total = need.get(dev, (where, 0))
            need[dev] = (first, total + n)
        for where, n in need.values():
            free = shutil.disk_usage(where).free
            if n > free:
                sizes = ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in plan.items())
                sys.exit(f"needs about {n / 2**30:.1f} GiB free on {where}'s filesystem, has "
                         f"{free / 2**30:.1f} GiB ({sizes}); try --work-dir /dev/shm/..., "
                         "--intermediate q8_0, --intermediate-dir or fewer --layers")


def find_imatrix(explicit: str | None) -> Path:
    """llama-imatrix: --llama-imatrix or LLAMA_IMATRIX (the CUDA build, for the
    full-size model), else the tests' CPU build (gguf_reference.llama_tool)."""
    cand = explicit or os.environ.get("LLAMA_IMATRIX")
    if cand and not Path(cand).exists():
        sys.exit(f"no llama-imatrix at {cand}")
    return Path(cand) if cand else gr.llama_tool("llama-imatrix")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=3, help="layers, the first dense (default 3)")
    p.add_argument("--experts", type=int, default=None, help="routed experts (default 256)")
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--quants", nargs="*", default=["Q4_K_M", "IQ2_M"])
    p.add_argument("--intermediate", choices=["bf16", "q8_0"], default="bf16")
    p.add_argument("--intermediate-dir", type=Path, default=None,
                   help="where the intermediate GGUF goes (default --out)")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="for the checkpoint and the llama.cpp tree (default OUT/work)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint and intermediate")
    p.add_argument("--llama-imatrix", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--small", action="store_true", help="small dimensions (CPU test)")
    p.add_argument("--no-space-check", action="store_true")
    p.add_argument("--variant", type=parse_variant, action="append", default=[],
                   metavar="NAME:PATTERN=TYPE[,PATTERN=TYPE]",
                   help="each quant once more with llama-quantize's --tensor-type overrides")
    args = p.parse_args(argv)
    overrides = {k: v for k, v in (("n_routed_experts", args.experts),
                                   ("vocab_size", args.vocab)) if v is not None}
    cfg = glm5_config(args.layers, args.small, **overrides)
    out = args.out.resolve()
    work = (args.work_dir or out / "work").resolve()
    shapes = checkpoint_tensors(cfg)
    params = sum(math.prod(s) for s in shapes.values())
    variants = dict(args.variant)
    plan = disk_plan(params, args.intermediate, args.quants, tuple(variants))
    if not args.no_space_check:
        check_space(plan, work, out, args.intermediate, args.keep, args.intermediate_dir)
    imatrix_bin = (find_imatrix(args.llama_imatrix)
                   if any(q in gr.NEEDS_IMATRIX for q in args.quants) else None)
    stem = f"glm5-shaped-{'small-' if args.small else ''}{args.layers}L"
    ckpt = write_checkpoint(cfg, work / f"{stem}-hf", args.seed, shapes)
    llama_cpp = gr.llama_cpp_dir(work)
    inter_dir = (args.intermediate_dir or out).resolve()
    inter_dir.mkdir(parents=True, exist_ok=True)
    inter = gr.convert(llama_cpp, ckpt, inter_dir / f"{stem}-{args.intermediate}.gguf",
                       args.intermediate)
    if not args.keep:
        shutil.rmtree(ckpt)
    files = {args.intermediate: inter}
    imatrix = (gr.make_imatrix(inter, work / "imatrix.gguf", binary=imatrix_bin,
                               extra=("-ngl", "999")) if imatrix_bin else None)
    requant = ("--allow-requantize",) if args.intermediate != "bf16" else ()
    for q in args.quants:
        for name, overrides in (("", ()), *variants.items()):
            key = f"{q}-{name}" if name else q
            dst = out / f"{stem}-{key}.gguf"
            gr.quantize(inter, dst, q, imatrix if q in gr.NEEDS_IMATRIX else None,
                        extra=(*requant, *overrides))
            files[key] = dst
    if not args.keep and args.quants:
        inter.unlink()
        del files[args.intermediate]
    report = {"config": cfg, "params": params,
              "imatrix": str(imatrix) if imatrix else None,
              "files": {k: {"path": str(v), "bytes": v.stat().st_size} for k, v in files.items()}}
    (out / "model.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v["path"] for k, v in report["files"].items()}))
    return report


if __name__ == "__main__":
    main()
