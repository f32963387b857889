# SPDX-License-Identifier: Apache-2.0
"""Sparse MLA attention: TRITON_MLA_SPARSE's kernel path vs FlashMLA sparse.

    python -m benchmarks.kernels.benchmark_triton_mla_sparse [--json out.json]

For every (tokens T, heads H, KV dtype) it times one call (GPU time, from
CUDA-graph replays; also eager, with Python launch overhead) of the backend's
attention step on global top-k slots (`triton_sparse_mla.sparse_mla_attention`, the
"gather" kernel) and, for bf16 KV on SM90/SM100, FlashMLA's
`flash_mla_sparse_fwd` on the same inputs (heads padded to 64/128 as
FLASHMLA_SPARSE does). `--sweep` also times alternative launch parameters of the
gather kernel and reports each candidate and the best per shape (to tune
`sparse_mla_launch.TRITON_TILES`; the candidates are Triton tiles). Where the gather step runs one
of Hopper's Gluon tiles (SM90: the warp-specialized tile at 64 and 128 heads, 32
heads from 8 tokens and an fp8 e4m3 cache's 33-63; the rows-in-M fp8 tile of 8
or 16 heads for an fp8 e4m3 cache's 1-32 heads, 17-32 as two programs), the row
also times the Triton tile the table gives where those cannot run.
Each gather row also reports what Triton compiled for its Triton tile:
registers and spills per thread, shared memory, and counts of TTGIR ops (async
copies into shared memory, register-to-shared stores, wgmma dots) that show
whether the KV loads were pipelined. `--ops-file PATH` takes the gather kernel
from a copy of `triton_sparse_mla.py` (to try a kernel change on the GPU host
without building a wheel). `--q-dtype fp16` runs fp16 queries (what a GGUF model
runs on SM >= 10.0, SM120 included; FlashMLA is bf16 only and is left out then).
`--as-gpu sm80|sm86|sm89|sm120` times the launches the table gives that GPU (its
capability and shared memory, this GPU's SMs, as `vllm_report_capability` reports
them to the engine), with Triton's dots as mma.sync (`DISABLE_MMA_V3=1`: that GPU has
no wgmma) and without FlashMLA; a sweep candidate over that GPU's shared memory is
reported as not fitting.
Bytes counted: T x topk x 576 x bytes per element of the KV cache,
i.e. each selected latent row read once. The device's copy bandwidth
(read + write) is measured in the same run. Index sets rotate so that repeated
calls do not find their rows in L2.
"""

import argparse
import concurrent.futures
import dataclasses
import importlib.util
import itertools
import json
import math
import multiprocessing
import os
import re

import torch
from triton.testing import do_bench

from vllm.platforms import current_platform
from vllm.v1.attention.ops import sparse_mla_launch as sml
from vllm.v1.attention.ops import triton_sparse_mla

from benchmarks.kernels.cuda_graph_timing import graph_us

KV_LORA, HEAD = 512, 576
Q_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# --as-gpu: capability (major * 10 + minor) and opt-in shared memory per block
AS_GPUS = {"sm80": (80, 163 * 1024), "sm86": (86, 99 * 1024), "sm89": (89, 99 * 1024),
           "sm120": (120, 99 * 1024)}


def bench_device(as_gpu: str | None = None) -> sml.SparseMLADevice:
    """The GPU whose launches run: this one, or `as_gpu`'s limits with this one's SMs."""
    device = sml.sparse_mla_device(torch.device("cuda"))
    if as_gpu is None:
        return device
    capability, shared_mem = AS_GPUS[as_gpu]
    return dataclasses.replace(device, capability=capability, shared_mem=shared_mem)


def copy_bandwidth(gib: float = 2.0) -> float:
    n = int(gib * 2**30) // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3)


def slot_sets(num_sets, num_tokens, topk, pool, device):
    # Random distinct slots per token, all valid (a decode past topk tokens).
    return [
        torch.argsort(torch.rand(num_tokens, pool, device=device), dim=1)[:, :topk]
        .to(torch.int32)
        .contiguous()
        if num_tokens * pool <= 2**28
        else torch.randint(0, pool, (num_tokens, topk), device=device, dtype=torch.int32)
        for _ in range(num_sets)
    ]


def load_ops(path: str | None):
    """The gather kernel's module: the installed one, or a copy at `path`."""
    if path is None:
        return triton_sparse_mla
    spec = importlib.util.spec_from_file_location("triton_sparse_mla_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_key(launch: sml.SparseMLALaunch, kv: str, q_dtype: str = "bf16") -> tuple:
    # the kernel, constexprs, launch options and dtypes that make a distinct binary
    return (launch.tile, launch.block_h, launch.block_n, launch.splits > 1, launch.num_warps,
            launch.num_stages, kv, q_dtype)


def as_json(launch: sml.SparseMLALaunch) -> dict:
    return {**dataclasses.asdict(launch), "tile": launch.tile.value}


def table_launches(num_tokens: int, num_heads: int, topk: int, kv: str, q_dtype: str,
                   device: sml.SparseMLADevice):
    """The table's launch on `device`, and its launch without the Gluon tiles (the
    Triton tile that runs where those cannot)."""
    kv_dtype = torch.float8_e4m3fn if kv == "fp8" else Q_DTYPES[q_dtype]
    return [sml.sparse_mla_launch(d, num_tokens, num_heads, HEAD, KV_LORA, topk,
                                  Q_DTYPES[q_dtype], kv_dtype)
            for d in (device, dataclasses.replace(device, gluon=False))]


class CompiledStats:
    """Registers, spills, shared memory and TTGIR op counts of each gather binary."""

    TTGIR_OPS = {  # noqa: RUF012 (read only)
        "async_copies": r"ttg\.async_copy_global_to_local",
        "local_stores": r"ttg\.local_(?:store|alloc) %",
        "wgmma": r"ttng\.warp_group_dot ",
    }

    def __init__(self, jit_fn):
        self.jit_fn = jit_fn
        self.by_key = {}

    def _cached(self) -> dict:
        found = {}
        for caches in self.jit_fn.device_caches.values():
            found.update(caches[0])  # Triton 3.x: (kernel_cache, ...) per device
        return found

    def record(self, key: tuple, run) -> None:
        """Run `run` (which launches the kernel) and note the binary it compiled."""
        before = set(self._cached())
        run()
        if key in self.by_key:
            return
        new = [k for name, k in self._cached().items() if name not in before]
        if len(new) != 1:  # already compiled under another key, or not a Triton 3.x cache
            return
        kernel = new[0]
        kernel._init_handles()
        ttgir = kernel.asm.get("ttgir", "")
        stats = {"n_regs": kernel.n_regs, "n_spills": kernel.n_spills,
                 "shared_bytes": kernel.metadata.shared}
        for name, pattern in self.TTGIR_OPS.items():
            stats[f"ttgir_{name}"] = len(re.findall(pattern, ttgir))
        # copy groups the main loop leaves in flight when it waits for a tile (0: the
        # tile it waits for is the only one)
        loop = ttgir[ttgir.find("scf.for"):]
        wait = re.search(r"ttg\.async_wait[^{]*\{num = (\d+)", loop)
        stats["ttgir_loop_wait_pending"] = int(wait.group(1)) if wait else None
        self.by_key[key] = stats

    def get(self, key: tuple) -> dict:
        return self.by_key.get(key, {})


# Sweep candidates per head block: (BLOCK_N, num_warps, num_stages, variant), picked
# from what Triton 3.6 compiles for sm_90 (registers, spills, shared memory and how
# far ahead the rows are copied). The loop pipeliner gives a load whose address
# comes from another load (the rows, through the slot ids) (num_stages - 1) // 2
# iterations of lead: 2 stages load the rows synchronously, 3 copy the next tile
# after this one's dots (one buffer; on mma.sync tiles nothing else overlaps it),
# 5 and 7 keep one and two tiles in flight during the dots. Variants: "" (16-bit
# cache, or fp8 converted once with the scale on the scores), "reload" (V_RELOAD).
SWEEP_TILES = {
    ("bf16", 16): [(64, 4, 2, ""), (32, 4, 5, ""), (32, 8, 5, ""), (16, 4, 5, ""),
                   (16, 4, 7, ""), (32, 4, 7, "")],
    ("bf16", 32): [(64, 4, 2, ""), (32, 4, 5, ""), (32, 8, 5, ""), (16, 4, 5, ""),
                   (16, 4, 7, "")],
    ("bf16", 64): [(64, 8, 3, ""), (32, 8, 5, ""), (16, 8, 5, ""), (16, 8, 7, "")],
    ("fp8", 16): [(32, 4, 2, "reload"), (16, 4, 5, "reload"), (16, 4, 7, "reload"),
                  (32, 4, 5, "reload"), (16, 8, 7, "reload")],
    ("fp8", 32): [(32, 4, 2, "reload"), (16, 4, 5, "reload"), (16, 4, 7, "reload"),
                  (32, 4, 5, "reload")],
    ("fp8", 64): [(64, 8, 3, ""), (32, 8, 5, ""), (16, 8, 7, ""), (32, 8, 5, "reload")],
}


def sweep_configs(base: sml.SparseMLALaunch, kv="bf16"):
    """Alternatives to the table's Triton launch `base` (Hopper tiles: elsewhere a
    candidate over the device's shared memory fails and is reported as such)."""
    # fewer splits too: at 64+ heads the fp32 partial rows (T x H x splits x 2 KiB,
    # written and read back) outweigh the KV rows themselves beyond ~8 splits
    sp = base.splits
    splits = sorted({max(1, sp // 4), max(1, sp // 2), sp, 2 * sp} if sp > 1 else {1})
    # smaller head blocks trade re-reading rows (from L2) for fewer registers per program
    block_hs = sorted({base.block_h, max(16, base.block_h // 2)})
    family = "fp8" if kv == "fp8" else "bf16"
    for block_h in block_hs:
        for (block_n, nw, stages, variant), n_splits in itertools.product(
                SWEEP_TILES[(family, block_h)], splits):
            tile = sml.SparseMLATile.TRITON_V_RELOAD if variant else sml.SparseMLATile.TRITON
            yield dataclasses.replace(base, tile=tile, block_h=block_h, block_n=block_n,
                                      num_warps=nw, num_stages=stages, splits=n_splits)


def _compile_jobs(ops_file: str | None, jobs: list) -> int:
    """Launch each (config, kv, heads) once on empty inputs: fills Triton's disk cache."""
    ops = load_ops(ops_file)
    done = 0
    for cfg, kv, heads, topk, q_dtype in jobs:
        kv_dtype = torch.float8_e4m3fn if kv == "fp8" else Q_DTYPES[q_dtype]
        q = torch.zeros(2, heads, HEAD, device="cuda", dtype=Q_DTYPES[q_dtype])
        cache = torch.zeros(1, 64, HEAD, device="cuda").to(kv_dtype)
        slots = torch.zeros(2, topk, device="cuda", dtype=torch.int32)
        counts = torch.zeros(2, device="cuda", dtype=torch.int32)
        try:
            ops.sparse_mla_attention(q, cache, slots, counts, KV_LORA, 1.0,
                                     torch.ones(1, device="cuda"), launch=cfg)
            done += 1
        except Exception:  # noqa: BLE001, S110 (the timed run reports it)
            pass
    torch.cuda.synchronize()
    return done


def warm_compile_cache(cases, topk, sweep, ops_file, workers: int, q_dtype: str,
                       device: sml.SparseMLADevice) -> None:
    """Compile every binary the run will time in `workers` processes at once (Triton
    compiles one kernel at a time per process; the sweep needs dozens)."""
    jobs = {}
    for t, h, kv in cases:
        # a Gluon tile's row also times the Triton tile it falls back to
        cfg, triton_cfg = table_launches(t, h, topk, kv, q_dtype, device)
        for c in [cfg, triton_cfg, *(sweep_configs(triton_cfg, kv) if sweep else [])]:
            jobs.setdefault(compile_key(c, kv, q_dtype), (c, kv, h, topk, q_dtype))
    jobs = list(jobs.values())
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        done = sum(pool.map(_compile_jobs, [ops_file] * workers,
                            [jobs[i::workers] for i in range(workers)]))
    print(f"compiled {done} of {len(jobs)} binaries in {workers} processes", flush=True)


def bench_case(num_tokens, num_heads, kv, topk, pool, l2_bytes, flashmla, sweep, ops,
               compiled, q_dtype, device: sml.SparseMLADevice):
    dev = "cuda"
    # a 16-bit cache has the queries' dtype, as in the engine
    kv_dtype = torch.float8_e4m3fn if kv == "fp8" else Q_DTYPES[q_dtype]
    cache = (torch.randn(pool // 64, 64, HEAD, device=dev) * 0.5).to(kv_dtype)
    q = torch.randn(num_tokens, num_heads, HEAD, device=dev, dtype=Q_DTYPES[q_dtype])
    elem = 1 if kv == "fp8" else 2
    bytes_read = num_tokens * topk * HEAD * elem
    sets = slot_sets(max(1, min(64, math.ceil(4 * l2_bytes / bytes_read))),
                     num_tokens, topk, pool, dev)
    valid = torch.full((num_tokens,), topk, dtype=torch.int32, device=dev)
    scale = 1.0 / math.sqrt(256)
    k_scale = torch.ones(1, device=dev)

    def gather(s, launch=None):
        return lambda: ops.sparse_mla_attention(q, cache, s, valid, KV_LORA, scale, k_scale,
                                                launch=launch)

    # Hopper's Gluon tiles (warp-specialized; 8/16-head fp8), and the Triton tile (the
    # table's launch where they cannot run) timed next to them
    cfg, triton_cfg = table_launches(num_tokens, num_heads, topk, kv, q_dtype, device)
    key = compile_key(triton_cfg, kv, q_dtype)
    compiled.record(key, gather(sets[0], triton_cfg))
    t_gather = graph_us([gather(s, cfg) for s in sets])
    gluon = cfg.tile in sml.GLUON_TILES
    t_triton = graph_us([gather(s, triton_cfg) for s in sets]) if gluon else None
    it = {"i": 0}

    def eager():
        gather(sets[it["i"] % len(sets)], cfg)()
        it["i"] += 1

    t_eager = do_bench(eager, warmup=10, rep=100, return_mode="median") * 1e3
    row = {
        "tokens": num_tokens, "heads": num_heads, "kv": "fp8" if kv == "fp8" else q_dtype,
        "q": q_dtype, "topk": topk,
        "gather_config": as_json(cfg),
        "gather_kernel": cfg.tile.value,
        "gather_compiled": compiled.get(key),  # the Triton tile's binary
        "gather_us": t_gather, "gather_eager_us": t_eager, "triton_tile_us": t_triton,
        "gather_TBps": bytes_read / (t_gather * 1e-6) / 1e12,
        "bytes": bytes_read, "index_sets": len(sets),
        # the table's Triton tile within the shared memory of the GPU it is for
        "fits_shared_mem": compiled.get(key).get("shared_bytes", 0) <= device.shared_mem,
    }
    if sweep:
        best = (t_gather, cfg)
        tried = []
        for alt in sweep_configs(triton_cfg, kv):
            alt_key = compile_key(alt, kv, q_dtype)
            try:
                compiled.record(alt_key, gather(sets[0], alt))
                shared = compiled.get(alt_key).get("shared_bytes", 0)
                if shared > device.shared_mem:  # runs here, not on the GPU run as
                    raise RuntimeError(f"needs {shared} B of shared memory, "
                                       f"the GPU has {device.shared_mem}")
                t = graph_us([gather(s, alt) for s in sets[:8]])
            except Exception as e:  # e.g. out of shared memory for a combination
                tried.append({"config": as_json(alt),
                              "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            tried.append({"config": as_json(alt), "us": t, **compiled.get(alt_key)})
            if t < best[0]:
                best = (t, alt)
        row.update(sweep_best_us=best[0], sweep_best_config=as_json(best[1]), sweep=tried)
    if flashmla is not None and kv == "bf16" and q_dtype == "bf16":
        padded = 64 if num_heads <= 64 else 128
        if current_platform.is_device_capability_family(100):
            padded = 128
        qp = torch.zeros(num_tokens, padded, HEAD, device=dev, dtype=torch.bfloat16)
        qp[:, :num_heads] = q
        kv_view = cache.view(-1, 1, HEAD)

        def theirs(s):
            idx = s.view(num_tokens, 1, topk)
            return lambda: flashmla.flash_mla_sparse_fwd(qp, kv_view, idx, scale)

        t_fm = graph_us([theirs(s) for s in sets])
        row.update(flashmla_us=t_fm, flashmla_TBps=bytes_read / (t_fm * 1e-6) / 1e12,
                   gather_vs_flashmla=t_gather / t_fm)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 8, 64, 256, 4096])
    parser.add_argument("--heads", type=int, nargs="*", default=[8, 16, 32, 64, 128])
    parser.add_argument("--kv", nargs="*", default=["bf16", "fp8"])
    parser.add_argument("--q-dtype", choices=sorted(Q_DTYPES), default="bf16",
                        help="query (and 16-bit cache) dtype")
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--pool", type=int, default=262144, help="KV pool tokens")
    parser.add_argument("--sweep", action="store_true",
                        help="also time alternative gather launch parameters")
    parser.add_argument("--compile-workers", type=int, default=0,
                        help="compile all binaries first in this many processes")
    parser.add_argument("--ops-file", default=None,
                        help="take the gather kernel from this copy of triton_sparse_mla.py")
    parser.add_argument("--as-gpu", choices=sorted(AS_GPUS), default=None,
                        help="time the launches of this GPU, dots as mma.sync")
    args = parser.parse_args()
    if args.as_gpu:
        # before the first compile (the compile workers inherit it); Triton keys its cache on it
        os.environ["DISABLE_MMA_V3"] = "1"
    device = bench_device(args.as_gpu)
    ops = load_ops(args.ops_file)
    compiled = CompiledStats(ops._sparse_mla_kernel)

    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    l2 = getattr(props, "L2_cache_size", 50 * 2**20)
    try:
        from vllm.v1.attention.ops import flashmla

        ok, reason = flashmla.is_flashmla_sparse_supported()
        flashmla = flashmla if ok else None
    except ImportError as e:
        flashmla, reason = None, str(e)
    if args.as_gpu:
        flashmla, reason = None, f"left out as on {args.as_gpu}"
    if args.compile_workers:
        cases = [(t, h, kv) for kv in args.kv for h in args.heads for t in args.tokens]
        try:
            warm_compile_cache(cases, args.topk, args.sweep, args.ops_file,
                               args.compile_workers, args.q_dtype, device)
        except Exception as e:  # noqa: BLE001 (only slower: each run then compiles)
            print(f"compile warm-up failed ({type(e).__name__}: {e}); compiling as the "
                  "rows run", flush=True)
    bw = copy_bandwidth()
    rows = []
    for kv in args.kv:
        for h in args.heads:
            for t in args.tokens:
                rows.append(bench_case(t, h, kv, args.topk, args.pool, l2, flashmla,
                                       args.sweep, ops, compiled, args.q_dtype, device))
                torch.cuda.empty_cache()
    wide = {(r["tokens"], r["heads"]): r for r in rows if r["kv"] != "fp8"}  # 16-bit caches
    for r in rows:
        r["gather_fraction_of_copy_bw"] = r["gather_TBps"] * 1e12 / bw
        if r["kv"] == "fp8" and (r["tokens"], r["heads"]) in wide:
            r["fp8_time_vs_16bit"] = r["gather_us"] / wide[(r["tokens"], r["heads"])]["gather_us"]

    if args.as_gpu:
        print(f"launches as on {args.as_gpu}: capability {device.capability}, "
              f"{device.shared_mem} B shared memory ({device.kind.value}), dots as mma.sync")
    print(f"device: {props.name} ({sms} SMs), copy bandwidth {bw / 1e12:.2f} TB/s "
          f"(read+write), FlashMLA sparse: {'yes' if flashmla else reason}")
    print(f"topk {args.topk}, KV pool {args.pool} tokens, {args.q_dtype} queries, "
          "bytes = T x topk x 576 x elem")
    print("GPU time per call from CUDA-graph replay; eager_us adds Python launch overhead")
    print("gather kernel: ws = warp-specialized Gluon tile, rows = 8/16-head fp8 Gluon tile "
          "(triton_us: the Triton tile at the same shape), tri = Triton tile")
    print("|    T |   H | kv   | kernel | gather_us | TB/s | % copy bw | eager_us | triton_us "
          "| flashmla_us | gather/flashmla | fp8/16-bit |"
          + (" sweep best |" if args.sweep else ""))
    print("|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
          + ("---:|" if args.sweep else ""))
    for r in rows:
        fm = (f"{r['flashmla_us']:11.1f} | {r['gather_vs_flashmla']:15.2f}"
              if "flashmla_us" in r else f"{'-':>11} | {'-':>15}")
        f8 = f"{r['fp8_time_vs_16bit']:8.2f}" if "fp8_time_vs_16bit" in r else f"{'-':>8}"
        sw = f" {r['sweep_best_us']:9.1f} |" if "sweep_best_us" in r else ""
        kernel = {"gluon_warp_specialized": "ws", "gluon_fp8_rows": "rows"}.get(
            r["gather_kernel"], "tri")
        tri = f"{r['triton_tile_us']:9.1f}" if kernel != "tri" else f"{'-':>9}"
        print(f"| {r['tokens']:4d} | {r['heads']:3d} | {r['kv']:4} | {kernel:6} "
              f"| {r['gather_us']:9.1f} "
              f"| {r['gather_TBps']:4.2f} | {100 * r['gather_fraction_of_copy_bw']:8.1f}% "
              f"| {r['gather_eager_us']:8.1f} | {tri} | {fm} | {f8} |{sw}")
    print("compiled Triton gather tiles (table configs): regs/thread, spills, shared bytes, "
          "TTGIR async copies / local stores / wgmma / copy groups in flight at the loop's wait")
    for r in rows:
        c = r["gather_compiled"]
        if c:
            print(f"  T={r['tokens']} H={r['heads']} {r['kv']}: {c['n_regs']} regs, "
                  f"{c['n_spills']} spills, {c['shared_bytes']} B shared, "
                  f"{c['ttgir_async_copies']}/{c['ttgir_local_stores']}/{c['ttgir_wgmma']}"
                  f"/{c.get('ttgir_loop_wait_pending')}")
    if args.sweep:
        for r in rows:
            if r.get("sweep_best_config") != r["gather_config"]:
                print(f"T={r['tokens']} H={r['heads']} {r['kv']}: best {r['sweep_best_config']} "
                      f"{r['sweep_best_us']:.1f} us (table {r['gather_us']:.1f} us)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": props.name, "sms": sms, "copy_bw_Bps": bw,
                       "as_gpu": args.as_gpu and {
                           "name": args.as_gpu, "capability": device.capability,
                           "shared_mem": device.shared_mem, "kind": device.kind.value,
                           "DISABLE_MMA_V3": os.environ.get("DISABLE_MMA_V3")},
                       "q_dtype": args.q_dtype,
                       "topk": args.topk, "pool_tokens": args.pool,
                       "ops_file": args.ops_file or ops.__file__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
