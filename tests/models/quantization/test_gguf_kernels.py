# SPDX-License-Identifier: Apache-2.0
"""Which kernel each GGUF product runs (vllm_gguf_plugin.quantization.gguf_kernels).

Three statements of the choice, checked against each other over a grid of every type the
plugin runs (K-quants, legacy quants, I-quants; the unquantized ones in dense layers),
token counts 1 to 16384 (each count where a threshold changes, its neighbours, and a
spread), dense and MoE (each pair of gate_up and down types), batch invariance off and
on, SM75/80/89/90/120, and the Marlin MoE switch off and on:

- the module's records (`dense_launch`, `moe_launch`, after `moe_marlin` at load);
- what linear.py and fused_moe.py call, run on the CPU with meta tensors and every kernel
  replaced by a recorder (`Engine`): the layers run the record and nothing else;
- EXPECTED_*: the choice written out by hand, for every type (dense) and GLM-5's type
  pairs and one of each kind (MoE); the reference a changed threshold fails against.

The whole grid's choices also hash to GRID_SHA256, recorded from the branches of
linear.py and fused_moe.py before gguf_kernels.py decided for them (commit 3fdd12d), then
with the dense Marlin switch removed: its "off" choice at every grid point (with the
switch on, the dense lines had Q4_K layers on `marlin`).
docs/gguf.md's kernel table is checked against the module's kernel_table().
"""

import hashlib
import itertools
from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType as T

from vllm_gguf_plugin.quantization.utils import (
    DEQUANT_TYPES,
    IMATRIX_QUANT_TYPES,
    UNQUANTIZED_TYPES,
)

QUANT_TYPES = sorted(int(t) for t in DEQUANT_TYPES)
DENSE_TYPES = QUANT_TYPES + sorted(int(t) for t in UNQUANTIZED_TYPES)
CAPABILITIES = (75, 80, 89, 90, 120)
ROWS = (4096, 6144)  # the plugin's MMVQ bound moves past 5120 output rows

# -- the choice written out: runs of (first token count, kernel) --------------------
MMVQ, MMQ, DEQ, BI = "mmvq", "mmq", "dequant", "batch_invariant"
LEGACY_AND_K = (T.Q2_K, T.Q3_K, T.Q5_K, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q8_1)
# dense, by type: (runs up to 5120 output rows, runs past them)
EXPECTED_DENSE = {
    **{int(t): (((1, MMVQ), (7, MMQ), (256, DEQ)), ((1, MMVQ), (3, MMQ), (256, DEQ)))
       for t in LEGACY_AND_K},
    **{int(t): (((1, MMVQ), (7, MMQ), (16, DEQ)), ((1, MMVQ), (3, MMQ), (16, DEQ)))
       for t in (T.Q4_K, T.Q6_K)},
    **{int(t): (((1, MMVQ), (17, DEQ)), ((1, MMVQ), (9, DEQ))) for t in IMATRIX_QUANT_TYPES},
    **{int(t): (((1, "plain"),), ((1, "plain"),)) for t in UNQUANTIZED_TYPES},
}
TM32, TM64 = "triton_moe:32", "triton_moe:64"
# MoE, by (gate_up, down): runs of (first token count, gate_up's kernel, down's)
EXPECTED_MOE = {
    (T.Q4_K, T.Q4_K): ((1, MMVQ, MMVQ), (32, MMQ, MMQ), (384, TM32, TM32),
                       (768, TM64, TM64), (6144, DEQ, DEQ)),
    (T.Q4_K, T.Q6_K): ((1, MMVQ, MMVQ), (32, MMQ, MMQ), (384, TM32, MMQ),
                       (768, TM64, TM64), (3072, DEQ, DEQ)),
    (T.Q4_K, T.Q5_K): ((1, MMVQ, MMVQ), (65, MMQ, MMQ), (384, TM32, MMQ),
                       (768, TM64, MMQ), (1024, DEQ, DEQ)),
    (T.Q6_K, T.Q6_K): ((1, MMVQ, MMVQ), (16, MMQ, MMQ), (768, TM64, TM64),
                       (3072, DEQ, DEQ)),
    (T.Q5_K, T.Q6_K): ((1, MMVQ, MMVQ), (65, MMQ, MMQ), (768, MMQ, TM64), (1024, DEQ, DEQ)),
    (T.Q8_0, T.Q8_0): ((1, MMVQ, MMVQ), (32, MMQ, MMQ), (1024, DEQ, DEQ)),
    (T.Q3_K, T.Q3_K): ((1, MMVQ, MMVQ), (65, MMQ, MMQ), (1024, DEQ, DEQ)),
    (T.Q4_0, T.Q4_0): ((1, MMVQ, MMVQ), (65, MMQ, MMQ), (1024, DEQ, DEQ)),
    (T.IQ2_XXS, T.IQ2_XXS): ((1, MMVQ, MMVQ), (1024, DEQ, DEQ)),
    (T.Q4_K, T.IQ4_XS): ((1, MMVQ, MMVQ), (1024, DEQ, DEQ)),
}
# a layer of Q4_K gate_up experts on Marlin (SM80 on, the switch on): its down product
EXPECTED_MARLIN_DOWN = {
    T.Q4_K: ((1, "marlin"),),
    T.Q6_K: ((1, MMVQ), (16, MMQ), (768, TM64), (3072, DEQ)),
    T.Q5_K: ((1, MMVQ), (65, MMQ), (1024, DEQ)),
    T.IQ4_XS: ((1, MMVQ), (1024, DEQ)),
}
FIRSTS = {f for runs in EXPECTED_DENSE.values() for r in runs for f, _ in r} | {
    r[0] for runs in (*EXPECTED_MOE.values(), *EXPECTED_MARLIN_DOWN.values()) for r in runs}
# each count where the choice changes, the counts either side, and a spread to 16384
TOKENS = sorted({t for f in FIRSTS for t in (f - 1, f, f + 1) if t > 0}
                | {4, 12, 24, 48, 100, 128, 200, 512, 2048, 4096, 5000, 8192, 12000, 16384})
# sha256 of every grid point's choice (`grid_lines`) from the branches before the module
# (0cd40af3...), each dense line then the dense Marlin switch's off choice (20aefb1e...)
GRID_SHA256 = "20aefb1ef4fb4d319559bad1112653f0035dd111b6aec0defe8198bf8f9603e9"


def _at(runs, tokens):
    return [r for r in runs if r[0] <= tokens][-1][1:]


def expected_dense(qtype, tokens, rows, bi):
    if bi and qtype not in UNQUANTIZED_TYPES:
        return BI
    return _at(EXPECTED_DENSE[qtype][rows > 5120], tokens)[0]


def expected_moe(types, tokens, bi, cap, moe_marlin):
    gate_up, down = types
    if moe_marlin and not bi and cap >= 80 and gate_up == T.Q4_K:
        return ("marlin", _at(EXPECTED_MARLIN_DOWN[down], tokens)[0])
    if bi:
        return (BI, BI)
    return _at(EXPECTED_MOE[types], tokens)


# -- the layers, run with recorders --------------------------------------------------
class _Ran(Exception):
    pass


def _record(calls, name):
    def kernel(*args, **kwargs):
        calls.append(name)
        raise _Ran(name)
    return kernel


class Engine:
    """linear.py's and fused_moe.py's choice for a product: their load-time conversion
    (with a stand-in layer) and their forward (meta tensors), every kernel a recorder."""

    def __init__(self, monkeypatch):
        import vllm.envs as envs
        from vllm.model_executor.layers.fused_moe import fused_moe as vllm_fused_moe
        from vllm.platforms import current_platform
        from vllm.platforms.interface import DeviceCapability

        from vllm_gguf_plugin import ops, quantization
        from vllm_gguf_plugin.quantization import (
            batch_invariant,
            fused_moe,
            linear,
            moe_marlin,
            moe_prefill,
            moe_triton_tiles,
        )

        self.envs, self.monkeypatch = envs, monkeypatch
        self.cap = 90
        self.calls = []
        calls = self.calls
        meta = torch.device("meta")
        mp = monkeypatch
        mp.setattr(current_platform, "is_cuda", lambda: True)
        mp.setattr(current_platform, "has_device_capability",
                   lambda c, device_id=0: self.cap >= (c if isinstance(c, int)
                                                       else c[0] * 10 + c[1]))
        mp.setattr(current_platform, "get_device_capability",
                   lambda device_id=0: DeviceCapability(self.cap // 10, self.cap % 10))
        mp.setattr("vllm.envs.VLLM_BATCH_INVARIANT", False, raising=False)
        mp.delenv("VLLM_GGUF_MOE_MARLIN", raising=False)
        # dense kernels
        mp.setattr(ops, "ggml_mul_mat_vec_a8", _record(calls, MMVQ))
        mp.setattr(ops, "ggml_mul_mat_a8", _record(calls, MMQ))
        mp.setattr(linear, "dequantize", _record(calls, DEQ))
        mp.setattr(batch_invariant, "mul_mat", _record(calls, BI))
        mp.setattr(moe_marlin, "marlin_experts", lambda w, dtype: "marlin")
        mp.setattr(quantization, "fused_mul_mat_gguf", _record(calls, "per_token"))

        # MoE kernels: record and return the product's shape
        def rows_out(name, n_at, top_k_at, tokens_at):
            def kernel(*args, **kwargs):
                calls.append(name)
                return torch.empty(args[tokens_at] * args[top_k_at], args[n_at],
                                   device=meta, dtype=torch.float16)
            return kernel

        def grouped(kernel, x, w, *args):  # moe_by_expert_group(kernel, ..., topk_ids, *args)
            calls.append(MMQ)
            _, n, top_k, tokens = args[-4:]
            return torch.empty(tokens * top_k, n, device=meta, dtype=torch.float16)

        def triton(x, w, qweight_type, tile, topk_ids, n, top_k, tokens):
            calls.append(f"triton_moe:{getattr(tile, 'block_m', tile)}")
            return torch.empty(tokens * top_k, n, device=meta, dtype=torch.float16)

        def both(name):
            def kernel(x, *args, **kwargs):
                calls.extend((name, name))
                return torch.empty_like(x)
            return kernel

        def dequant_down(x, w, qweight_type, topk_ids):
            calls.append(DEQ)
            return torch.empty(x.shape[0], w.shape[1], device=meta, dtype=x.dtype)

        mp.setattr(ops, "ggml_moe_a8_vec", rows_out(MMVQ, 5, 3, 6))
        mp.setattr(ops, "ggml_moe_get_block_size", lambda t: 16)
        mp.setattr(ops, "moe_sum", lambda out, hidden: None)
        mp.setattr(fused_moe, "moe_by_expert_group", grouped)
        mp.setattr(fused_moe, "apply_moe_activation", lambda act, out, inp: None)
        mp.setattr(moe_triton_tiles, "triton_moe_product", triton)
        mp.setattr(moe_prefill, "dequant_fused_moe", both(DEQ))
        mp.setattr(moe_prefill, "dequant_moe_product", dequant_down)
        mp.setattr(batch_invariant, "fused_moe", both(BI))
        mp.setattr(vllm_fused_moe, "moe_align_block_size", lambda *args: (None,) * 3)

        def marlin(x, w13, w2, topk_weights, topk_ids, activation, down):
            calls.append("marlin")
            if down is None:
                calls.append("marlin")
            else:
                down(torch.empty(topk_ids.numel(), w2_inter, device=meta, dtype=x.dtype))
            return x

        w2_inter = 128
        mp.setattr(moe_marlin, "fused_moe", marlin)
        self.linear = linear
        self.fused_moe, self.moe_marlin = fused_moe, moe_marlin

    def set(self, bi, cap, moe_marlin):
        self.envs.VLLM_BATCH_INVARIANT = bi
        self.cap = cap
        self.monkeypatch.setenv("VLLM_GGUF_MOE_MARLIN", "1" if moe_marlin else "0")

    def dense(self, qtype, tokens, rows):
        self.calls.clear()
        meta = torch.device("meta")
        x = torch.empty(tokens, 256, device=meta, dtype=torch.float16)
        if qtype in UNQUANTIZED_TYPES:
            w = torch.empty(rows, 256, device=meta, dtype=torch.float16)
        else:
            w = torch.empty(rows, 144, device=meta, dtype=torch.uint8)
        try:
            self.linear._fused_mul_mat_gguf(x, w, qtype)
        except _Ran:
            pass
        except NotImplementedError:
            return "unsupported"
        assert len(self.calls) <= 1, self.calls
        return self.calls[0] if self.calls else "plain"

    def converts(self, types):
        layer = SimpleNamespace(
            w13_qweight_type=SimpleNamespace(weight_type=types[0]),
            w2_qweight_type=SimpleNamespace(weight_type=types[1]),
            w13_qweight=SimpleNamespace(data=None, dtype=torch.uint8, device="meta"),
            w2_qweight=SimpleNamespace(data=None, dtype=torch.uint8, device="meta"))
        return self.moe_marlin.convert_layer(layer, torch.float16)

    def moe(self, types, tokens, marlin):
        self.calls.clear()
        meta = torch.device("meta")
        experts, hidden, inter, top_k = 4, 256, 128, 2
        x = torch.empty(tokens, hidden, device=meta, dtype=torch.float16)
        w1 = torch.empty(experts, 2 * inter, 144, device=meta, dtype=torch.uint8)
        w2 = torch.empty(experts, hidden, 72, device=meta, dtype=torch.uint8)
        weights = torch.empty(tokens, top_k, device=meta, dtype=torch.float32)
        ids = torch.empty(tokens, top_k, device=meta, dtype=torch.int32)
        try:
            if marlin is not None:
                from vllm.model_executor.layers.fused_moe.activation import MoEActivation

                self.fused_moe.marlin_fused_moe(x, marlin, w2, types[1], weights, ids,
                                                MoEActivation.SILU)
            else:
                self.fused_moe._fused_moe_gguf(x, w1, w2, weights, ids, *types, "silu")
        except _Ran as ran:
            assert str(ran) == "per_token", ran
            return ("per_token", "per_token")
        assert len(self.calls) == 2, self.calls
        return tuple(self.calls)


@pytest.fixture
def engine(monkeypatch):
    return Engine(monkeypatch)


def _name(launch):
    return launch.kernel.value + (f":{launch.block_m}" if launch.block_m else "")


def module_dense(qtype, tokens, rows, bi):
    from vllm_gguf_plugin.quantization import gguf_kernels as gk

    return _name(gk.dense_launch(qtype, tokens, rows, batch_invariant=bi))


def module_moe(types, tokens, bi, cap):
    from vllm_gguf_plugin.quantization import gguf_kernels as gk

    marlin = gk.moe_marlin(*types, capability=cap, batch_invariant=bi)
    launch = gk.moe_launch(*types, tokens, batch_invariant=bi, marlin=marlin)
    return _name(launch.gate_up), _name(launch.down)


SETTINGS = list(itertools.product((False, True), CAPABILITIES, (False, True)))


def grid_lines(dense, moe):
    """Every grid point's choice, a line each: dense(qtype, tokens, rows) and
    moe(types, tokens), under each setting (batch invariance, capability, the Marlin MoE
    switch; a dense line's choice does not depend on it)."""
    lines = []
    for bi, cap, switch in SETTINGS:
        for qtype, rows, tokens in itertools.product(DENSE_TYPES, ROWS, TOKENS):
            lines.append(f"dense {bi} {cap} {switch} {qtype} {rows} {tokens} "
                         f"{dense(bi, cap, switch, qtype, tokens, rows)}")
        for types, tokens in itertools.product(
                itertools.product(QUANT_TYPES, QUANT_TYPES), TOKENS):
            lines.append(f"moe {bi} {cap} {switch} {types} {tokens} "
                         f"{' '.join(moe(bi, cap, switch, types, tokens))}")
    return lines


def _module_dense(bi, cap, switch, qtype, tokens, rows):
    return module_dense(qtype, tokens, rows, bi)


def _module_moe(bi, cap, switch, types, tokens):
    return module_moe(types, tokens, bi, cap)


def test_layers_run_the_modules_choice(engine):
    """Over the whole grid, linear.py and fused_moe.py call the kernel the module names
    (the switch on and off)."""
    cache = {}

    def dense(bi, cap, switch, qtype, tokens, rows):
        engine.set(bi, cap, switch)
        got = engine.dense(qtype, tokens, rows)
        assert got == module_dense(qtype, tokens, rows, bi), (qtype, tokens, rows)
        return got

    def moe(bi, cap, switch, types, tokens):
        engine.set(bi, cap, switch)
        marlin = engine.converts(types)
        key = (types, tokens, bi, None if marlin is None else tuple(m is None for m in marlin))
        if key not in cache:
            cache[key] = engine.moe(types, tokens, marlin)
        assert cache[key] == module_moe(types, tokens, bi, cap), (types, tokens, bi, cap)
        return cache[key]

    lines = grid_lines(dense, moe)
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    print(len(lines), "grid points, sha256", digest)
    assert digest == GRID_SHA256


def test_module_matches_the_written_choice(monkeypatch):
    """The module's records against EXPECTED_*: every dense type, the MoE pairs listed."""
    monkeypatch.setattr("vllm.envs.VLLM_BATCH_INVARIANT", False, raising=False)
    for (bi, cap, switch), tokens in itertools.product(SETTINGS, TOKENS):
        monkeypatch.setenv("VLLM_GGUF_MOE_MARLIN", "1" if switch else "0")
        for qtype, rows in itertools.product(DENSE_TYPES, ROWS):
            want = expected_dense(qtype, tokens, rows, bi)
            assert module_dense(qtype, tokens, rows, bi) == want, (qtype, tokens, rows,
                                                                   bi, cap, switch)
        for types in EXPECTED_MOE:
            types = tuple(map(int, types))
            want = expected_moe(types, tokens, bi, cap, switch)
            assert module_moe(types, tokens, bi, cap) == want, (types, tokens, bi, cap,
                                                                switch)


def test_docs_table_is_the_modules():
    """docs/gguf.md's kernel table (between its `kernels` markers) is kernel_table()'s:
    regenerate it with `python -m vllm_gguf_plugin.quantization.gguf_kernels`."""
    from pathlib import Path

    from vllm_gguf_plugin.quantization import gguf_kernels

    text = (Path(__file__).parents[3] / "docs" / "gguf.md").read_text()
    table = text.split("<!-- kernels: begin -->")[1].split("<!-- kernels: end -->")[0]
    assert [line.strip() for line in table.strip().splitlines()] == gguf_kernels.kernel_table()


def test_records_are_chosen_once(monkeypatch):
    """linear.py and fused_moe.py ask for their record at every call of a product
    outside a CUDA graph (eager, token counts past the captured sizes): the rules run
    once for each set of arguments, and the record is the uncached rules' over the grid."""
    from vllm_gguf_plugin.quantization import gguf_kernels as gk

    gk.dense_launch.cache_clear()
    gk.moe_launch.cache_clear()
    try:
        for bi, cap, _ in SETTINGS:
            for qtype, rows, tokens in itertools.product(DENSE_TYPES, ROWS, TOKENS):
                assert gk.dense_launch(qtype, tokens, rows, batch_invariant=bi) == \
                    gk.dense_launch.__wrapped__(qtype, tokens, rows, batch_invariant=bi)
            for types, tokens in itertools.product(
                    itertools.product(QUANT_TYPES, QUANT_TYPES), TOKENS):
                marlin = gk.moe_marlin(*types, capability=cap, batch_invariant=bi)
                assert gk.moe_launch(*types, tokens, batch_invariant=bi, marlin=marlin) == \
                    gk.moe_launch.__wrapped__(*types, tokens, batch_invariant=bi,
                                              marlin=marlin)
        gk.dense_launch.cache_clear()
        gk.moe_launch.cache_clear()
        asked = []
        for name in ("mmvq_max_tokens", "triton_tile"):
            rule = getattr(gk, name)
            monkeypatch.setattr(gk, name, lambda *a, rule=rule, name=name: (
                asked.append(name), rule(*a))[1])
        q4k = int(T.Q4_K)
        for _ in range(50):  # a decode step's products, step after step
            gk.dense_launch(q4k, 1, 6144, batch_invariant=False)
            gk.moe_launch(q4k, int(T.Q6_K), 1, batch_invariant=False)
        assert asked == ["mmvq_max_tokens", "triton_tile", "triton_tile"]
    finally:
        gk.dense_launch.cache_clear()
        gk.moe_launch.cache_clear()


# -- the warm-up: the token counts that compile every kernel variant ----------------
# GLM-5's routed experts: 256 of 2048 rows of gate and of up, 6144 inputs; top 8
GLM5_EXPERTS, GLM5_INTER, GLM5_HIDDEN, GLM5_TOP_K = 256, 2048, 6144, 8


def _stack(qtype, rows, cols):
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return (GLM5_EXPERTS, rows, cols // block * size)


def _covers(counts, first, last, key):
    """Every count in [first, last] has a warmed one of the same key, and no two warmed
    counts share a key (the fewest runs)."""
    warmed = {key(n): n for n in counts}
    assert len(warmed) == len(counts) and all(first <= n <= last for n in counts)
    missing = [n for n in range(first, last + 1) if key(n) not in warmed]
    assert not missing, missing[:5]


def test_specialization_is_tritons_variant():
    """Two counts of one specialization give every integer argument n * 2^j (j = 0..4)
    the same divisibility by 16 and equality to 1, Triton's specializations."""
    from vllm_gguf_plugin.quantization.gguf_kernels import specialization

    def variant(n):
        return tuple((n << j) % 16 == 0 for j in range(5)) + (n == 1,)

    by_class = {}
    for n in range(1, 4097):
        by_class.setdefault(specialization(n), set()).add(variant(n))
    assert all(len(v) == 1 for v in by_class.values()), by_class
    assert len({next(iter(v)) for v in by_class.values()}) == len(by_class)


@pytest.mark.parametrize("first,last", [(1, 2048), (513, 8192), (513, 16384)])
def test_dense_warmup_counts_cover_every_choice(first, last):
    from vllm_gguf_plugin.quantization import gguf_kernels as gk

    for qtype, rows, bi in itertools.product(DENSE_TYPES, ROWS, (False, True)):
        counts = gk.dense_warmup_counts(qtype, rows, first, last, batch_invariant=bi)
        _covers(counts, first, last, lambda n: (
            expected_dense(qtype, n, rows, bi), gk.specialization(n)))


def _fused_experts_calls(w1_shape, w2_shape, types, dtype):
    """What dequant_fused_moe gives vLLM's fused_experts: its calls recorded (the experts
    dequantized to meta tensors) as the arguments of vLLM's tile choice but the count."""
    from vllm.model_executor.layers.fused_moe.config import _get_config_dtype_str

    from vllm_gguf_plugin.quantization import moe_prefill

    calls = set()

    def dequantize(w, qtype, first, end, dt):
        return torch.empty(moe_prefill.dequantized_shape((end - first, *w.shape[1:]), qtype),
                           dtype=dt, device="meta")

    def fused_experts(x, w1, w2, topk_weights, topk_ids, **kwargs):
        calls.add((tuple(w1.shape), tuple(w2.shape), topk_ids.shape[1],
                   _get_config_dtype_str(dtype=x.dtype)))
        return torch.empty_like(x)

    x = torch.empty(1024, GLM5_HIDDEN, dtype=dtype, device="meta")
    ids = torch.empty(1024, GLM5_TOP_K, dtype=torch.int32, device="meta")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe_prefill, "dequantize_experts", dequantize)
        mp.setattr(moe_prefill, "fused_experts", fused_experts)
        mp.setattr(torch, "full", lambda size, v, **kw: torch.empty(size, device="meta"))
        mp.setattr(torch, "arange", lambda n, **kw: torch.empty(n, device="meta"))
        moe_prefill.dequant_fused_moe(x, torch.empty(w1_shape, dtype=torch.uint8, device="meta"),
                                      torch.empty(w2_shape, dtype=torch.uint8, device="meta"),
                                      ids.float(), ids, *types, None)
    return sorted(calls)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_moe_warmup_counts_cover_every_choice(monkeypatch, dtype):
    """Over GLM-5's expert shapes, every MoE pair listed, with Marlin and without, and
    batch invariant: a warmed count for each (launch, fused-MoE tile where dequantized,
    specialization) that any count past the CUDA graphs' sizes takes; the tiles are
    vLLM's for the calls a recorded run of dequant_fused_moe makes."""
    from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config
    from vllm.platforms import current_platform

    from vllm_gguf_plugin.quantization import gguf_kernels as gk

    monkeypatch.setattr("vllm.envs.VLLM_BATCH_INVARIANT", False, raising=False)
    # vLLM's tuned fused-MoE tiles are files by device name (an H100's, where it has one)
    monkeypatch.setattr(current_platform, "get_device_name",
                        lambda device_id=0: "NVIDIA H100 80GB HBM3", raising=False)
    first, last = 513, 8192
    for (gate_up, down), bi in itertools.product(EXPECTED_MOE, (False, True)):
        gate_up, down = int(gate_up), int(down)
        w1 = _stack(gate_up, 2 * GLM5_INTER, GLM5_HIDDEN)
        w2 = _stack(down, GLM5_HIDDEN, GLM5_INTER)
        for marlin in {(False, False), gk.moe_marlin(gate_up, down, capability=90,
                                                     batch_invariant=bi)}:
            calls = _fused_experts_calls(w1, w2, (gate_up, down), dtype)

            def key(n):
                launch = gk.moe_launch(gate_up, down, n, batch_invariant=bi, marlin=marlin)
                tile = None
                if launch.gate_up.kernel is gk.GGUFKernel.DEQUANT:
                    tile = frozenset(tuple(sorted(try_get_optimal_moe_config(
                        *call[:3], call[3], n).items())) for call in calls)
                elif launch.down.kernel is gk.GGUFKernel.DEQUANT:
                    tile = tuple(sorted(try_get_optimal_moe_config(
                        (GLM5_EXPERTS, 2 * GLM5_INTER, GLM5_HIDDEN), w2, GLM5_TOP_K, None,
                        n).items()))
                return launch, tile, gk.specialization(n)

            counts = gk.moe_warmup_counts(gate_up, down, first, last, batch_invariant=bi,
                                          marlin=marlin, w1_shape=w1, w2_shape=w2,
                                          top_k=GLM5_TOP_K, dtype=dtype)
            if (gate_up, down, marlin, bi) == (int(T.Q4_K), int(T.Q6_K), (False, False),
                                               False):
                # GLM-5's Q4_K_M layer off Marlin: two Triton tiles, then dequantized,
                # each at five specializations
                assert counts == (513, 514, 516, 520, 528, 768, 769, 770, 772, 776,
                                  3072, 3073, 3074, 3076, 3080)
            _covers(counts, first, last, key)
