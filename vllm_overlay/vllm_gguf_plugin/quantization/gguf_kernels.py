# SPDX-License-Identifier: Apache-2.0
"""Which kernel runs a GGUF product: the one place that decides it.

`dense_launch` (a linear layer's product) and `moe_launch` (a layer's routed experts)
choose from the weight's quant type(s), the token count, batch invariance and, for the
experts, whether they were converted for Marlin at load (`moe_marlin`, from the device's
capability and the switch). Each returns a frozen record naming the kernel and its tile
(`GGUFLaunch`; for the experts one a product, `GGUFMoELaunch`); `linear.py` and
`fused_moe.py` run it and decide nothing themselves. Every tuned
threshold is in one table, `TABLE`, each entry with the measurement behind it on
docs/results.md. No data, no host sync: the choice depends on shapes and types alone,
so it is stable under CUDA-graph capture. docs/gguf.md's kernel table is generated
from here (`kernel_table`) and checked against it by tests/models/quantization/
test_gguf_kernels.py.
"""

import dataclasses
import enum
import functools
import os
from collections.abc import Hashable, Iterable, Mapping
from types import MappingProxyType

from gguf import GGMLQuantizationType as T

from .utils import (
    DEQUANT_TYPES,
    IMATRIX_QUANT_TYPES,
    MMQ_QUANT_TYPES,
    MMVQ_QUANT_TYPES,
    UNQUANTIZED_TYPES,
    logger,
)

Q4_K = int(T.Q4_K)

# The switches: kernels chosen by an environment variable (registered with vLLM's
# environment variables by plugin.py; read here alone).
# on by default: Q4_K routed experts on vLLM's Marlin MoE (moe_marlin.py)
MOE_MARLIN_ENV = "VLLM_GGUF_MOE_MARLIN"


def moe_marlin_enabled() -> bool:
    """On unless VLLM_GGUF_MOE_MARLIN=0."""
    return os.environ.get(MOE_MARLIN_ENV, "1").strip() != "0"


# the switches and their values, as plugin.py registers them with vLLM
SWITCHES = {MOE_MARLIN_ENV: moe_marlin_enabled}


class GGUFKernel(enum.Enum):
    """The kernel a GGUF product runs (dense: a linear layer; MoE: one routed product)."""

    PLAIN = "plain"  # an unquantized weight: x @ w.T
    # batch_invariant.py: the plugin's Triton GEMM / fused-MoE kernel, one tile for all
    BATCH_INVARIANT = "batch_invariant"
    # int8 activations a row at a time: ggml_mul_mat_vec_a8; MoE: ggml_moe_a8_vec, a
    # (token, expert) pair at a time
    MMVQ = "mmvq"
    # int8 activations, tiled: ggml_mul_mat_a8; MoE: ggml_moe_a8 in expert groups
    MMQ = "mmq"
    # dequantize (dequant_triton.py for Q4_K and Q6_K) + a 16-bit GEMM; MoE: moe_prefill.py
    DEQUANT = "dequant"
    TRITON_MOE = "triton_moe"  # moe_triton_tiles.py: the plugin's Triton MoE kernel, block_m
    MARLIN = "marlin"  # MoE: moe_marlin.py (the layer's experts converted at load)
    PER_TOKEN = "per_token"  # the plugin's fallback: a dense product a token and expert
    UNSUPPORTED = "unsupported"  # no kernel: the layer refuses the type


@dataclasses.dataclass(frozen=True)
class GGUFLaunch:
    """A GGUF product's kernel and its tile."""

    kernel: GGUFKernel
    block_m: int = 0  # token rows a tile (TRITON_MOE; 0: the kernel's own)


@dataclasses.dataclass(frozen=True)
class GGUFMoELaunch:
    """The kernels of a layer's routed products."""

    gate_up: GGUFLaunch
    down: GGUFLaunch


@dataclasses.dataclass(frozen=True)
class TritonMoETile:
    """The Triton MoE tile of a product of `first` to `last` tokens."""

    first: int
    last: int
    block_m: int  # token rows a tile


@dataclasses.dataclass(frozen=True)
class KernelTable:
    """Every tuned threshold of the choice (token counts are of the step's tokens)."""

    mmvq_wide_rows: int  # dense: weights of more output rows take MMVQ up to the *_wide counts
    mmvq_max_tokens: int  # dense, K-quants and legacy quants: MMVQ up to this many tokens
    mmvq_max_tokens_wide: int
    mmvq_max_tokens_iq: int  # dense, I-quants
    mmvq_max_tokens_iq_wide: int
    dequant_gemm_min_tokens: int  # dense: dequantize + 16-bit GEMM from here, not MMQ
    dequant_gemm_min_tokens_by_type: Mapping[int, int]
    dequant_moe_min_tokens: int  # MoE: dequantized experts + vLLM's fused MoE from here
    plugin_mmq_min_tokens: int  # MoE: MMQ from here, not the one-pair kernel
    mmq_min_tokens_by_type: Mapping[int, int]
    triton_moe_tiles: Mapping[int, tuple[TritonMoETile, ...]]  # MoE: by rising counts
    marlin_min_capability: int  # Marlin MoE: SM80 or later
    moe_offset_max: int  # MoE: the tiled kernels' 32-bit offsets: bytes of an expert group


TABLE = KernelTable(
    # the plugin's own MMVQ bounds (upstream linear.py), unmeasured here
    mmvq_wide_rows=5120,
    mmvq_max_tokens=6,
    mmvq_max_tokens_wide=2,
    mmvq_max_tokens_iq=16,
    mmvq_max_tokens_iq_wide=8,
    # a prefill: MMQ 31-34x slower at 8192 tokens (docs/results.md at 41c0a23, "GGUF
    # products"; the engine's prefill rows: docs/results.md#2-speed-against-llamacpp)
    dequant_gemm_min_tokens=256,
    # docs/results.md#dense-gguf-products-the-triton-dequantization: faster from 16
    dequant_gemm_min_tokens_by_type=MappingProxyType({int(T.Q4_K): 16, int(T.Q6_K): 16}),
    # a long prefill: MMQ's and the one-pair kernel's time grow with every token (docs/
    # results.md at e75c491, "GGUF MoE at GLM-5's shapes"; now docs/results.md#one-moe-layer)
    dequant_moe_min_tokens=1024,
    # the plugin's own (upstream fused_moe.py: the one-pair kernel up to 64 tokens)
    plugin_mmq_min_tokens=65,
    # GLM-5's expert shapes (docs/results.md at e75c491, "GGUF MoE at GLM-5's shapes"; the
    # Marlin MoE that runs Q4_K now: docs/results.md#gguf-moe-q4_k-experts-on-vllms-marlin-moe)
    mmq_min_tokens_by_type=MappingProxyType({int(T.Q4_K): 32, int(T.Q6_K): 16,
                                             int(T.Q8_0): 32}),
    # as mmq_min_tokens_by_type: the Triton kernel with these tiles faster than MMQ there
    triton_moe_tiles=MappingProxyType({
        int(T.Q4_K): (TritonMoETile(384, 767, 32), TritonMoETile(768, 6143, 64)),
        int(T.Q6_K): (TritonMoETile(768, 3071, 64),),
    }),
    # vLLM's Marlin kernels' own requirement (marlin_utils)
    marlin_min_capability=80,
    # int32 offsets of the plugin's MoE kernels (plugin#127; moe_expert_groups.py)
    moe_offset_max=2**31 - 1,
)


def mmvq_max_tokens(qweight_type: int, rows: int) -> int:
    """The most tokens whose dense product of this type and `rows` outputs takes MMVQ."""
    wide = rows > TABLE.mmvq_wide_rows
    if qweight_type in IMATRIX_QUANT_TYPES:
        return TABLE.mmvq_max_tokens_iq_wide if wide else TABLE.mmvq_max_tokens_iq
    return TABLE.mmvq_max_tokens_wide if wide else TABLE.mmvq_max_tokens


def dequant_gemm_min_tokens(qweight_type: int) -> int:
    """The fewest tokens whose dense product dequantizes for a 16-bit GEMM, not MMQ."""
    return TABLE.dequant_gemm_min_tokens_by_type.get(qweight_type,
                                                     TABLE.dequant_gemm_min_tokens)


def mmq_min_tokens(qweight_type: int, qweight_type2: int) -> int:
    """The fewest tokens from which a layer's routed products of these types run MMQ."""
    return max(TABLE.mmq_min_tokens_by_type.get(t, TABLE.plugin_mmq_min_tokens)
               for t in (qweight_type, qweight_type2))


def triton_tile(qweight_type: int, tokens: int) -> TritonMoETile | None:
    """The Triton MoE tile of a routed product of this type over `tokens`, if any."""
    tiles = TABLE.triton_moe_tiles.get(qweight_type, ())
    return next((t for t in tiles if t.first <= tokens <= t.last), None)


def _marlin_capable(capability: int | None) -> bool:
    return capability is not None and capability >= TABLE.marlin_min_capability


def device_capability() -> int | None:
    """This process's CUDA device capability as vLLM reads it (80: SM80); None off CUDA."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None
    return current_platform.get_device_capability().to_int()


def _marlin_switched_off(env: str, on: bool, batch_invariant: bool) -> bool:
    if not on:
        return True
    if batch_invariant:  # Marlin's tiles follow the token count
        if os.environ.get(env, "").strip() == "1":
            logger.warning_once("%s=1 is ignored under VLLM_BATCH_INVARIANT=1", env)
        return True
    return False


def moe_marlin(qweight_type: int, qweight_type2: int, *, capability: int | None,
               batch_invariant: bool) -> tuple[bool, bool]:
    """Which routed products of a layer of these types are converted for vLLM's Marlin
    MoE at load, (gate_up, down): VLLM_GGUF_MOE_MARLIN on, not batch invariant, Q4_K
    ones (whose 256-value blocks make every shape whole tiles of Marlin's: 128 inputs,
    64 outputs), on SM80 or later; the down product only with its gate_up, and a layer
    whose down product stays only where the GGUF one-pair kernel runs its type."""
    if _marlin_switched_off(MOE_MARLIN_ENV, moe_marlin_enabled(), batch_invariant):
        return False, False
    gate_up = qweight_type == Q4_K and _marlin_capable(capability)
    down = gate_up and qweight_type2 == Q4_K
    return gate_up and (down or qweight_type2 in MMVQ_QUANT_TYPES), down


# dense_launch and moe_launch run at every call of a GGUF product outside a CUDA graph
# (eager, token counts past the captured sizes): a choice is made once for each set of
# arguments, which are all it reads (TABLE is a constant).
@functools.lru_cache(maxsize=4096)
def dense_launch(qweight_type: int, tokens: int, rows: int, *,
                 batch_invariant: bool) -> GGUFLaunch:
    """The kernel of a linear product of `tokens` tokens with a weight of this type and
    `rows` outputs (chosen once for each set of arguments)."""
    if qweight_type in UNQUANTIZED_TYPES:
        return GGUFLaunch(GGUFKernel.PLAIN)
    if batch_invariant:
        return GGUFLaunch(GGUFKernel.BATCH_INVARIANT)
    if tokens <= mmvq_max_tokens(qweight_type, rows) and qweight_type in MMVQ_QUANT_TYPES:
        return GGUFLaunch(GGUFKernel.MMVQ)
    if qweight_type in MMQ_QUANT_TYPES and tokens < dequant_gemm_min_tokens(qweight_type):
        return GGUFLaunch(GGUFKernel.MMQ)
    if qweight_type in DEQUANT_TYPES:
        return GGUFLaunch(GGUFKernel.DEQUANT)
    return GGUFLaunch(GGUFKernel.UNSUPPORTED)


def _moe_product(tile: TritonMoETile | None) -> GGUFLaunch:
    if tile is not None:
        return GGUFLaunch(GGUFKernel.TRITON_MOE, tile.block_m)
    return GGUFLaunch(GGUFKernel.MMQ)


def marlin_gguf_down(qweight_type: int, tokens: int) -> GGUFLaunch:
    """The kernel of a GGUF down product after Marlin's gate_up (moe_marlin.py), over
    `tokens` tokens: the one the GGUF MoE takes for a layer of its type alone (moe_marlin
    leaves on GGUF only the down products of one-pair kernel types: MMVQ below MMQ)."""
    return moe_launch(qweight_type, qweight_type, tokens, batch_invariant=False).down


@functools.lru_cache(maxsize=4096)
def moe_launch(qweight_type: int, qweight_type2: int, tokens: int, *,
               batch_invariant: bool, marlin: tuple[bool, bool] = (False, False)
               ) -> GGUFMoELaunch:
    """The kernels of a layer's routed products (gate_up of `qweight_type`, down of
    `qweight_type2`) over `tokens` tokens; `marlin`: its products converted (moe_marlin).
    Chosen once for each set of arguments (as `dense_launch`).

    A DEQUANT gate_up runs both products (moe_prefill.dequant_fused_moe); under Marlin
    a DEQUANT down product runs alone (dequant_moe_product)."""
    if marlin[0]:
        down = (GGUFLaunch(GGUFKernel.MARLIN) if marlin[1]
                else marlin_gguf_down(qweight_type2, tokens))
        return GGUFMoELaunch(GGUFLaunch(GGUFKernel.MARLIN), down)
    types = (qweight_type, qweight_type2)

    def both(kernel: GGUFKernel) -> GGUFMoELaunch:
        return GGUFMoELaunch(GGUFLaunch(kernel), GGUFLaunch(kernel))

    if batch_invariant:
        return both(GGUFKernel.BATCH_INVARIANT)
    tiles = [triton_tile(t, tokens) for t in types]
    if (tokens >= TABLE.dequant_moe_min_tokens and all(t in DEQUANT_TYPES for t in types)
            and not all(tiles)):
        return both(GGUFKernel.DEQUANT)
    if all(t in MMQ_QUANT_TYPES for t in types) and tokens >= mmq_min_tokens(*types):
        return GGUFMoELaunch(*map(_moe_product, tiles))
    if all(t in MMVQ_QUANT_TYPES for t in types):
        return both(GGUFKernel.MMVQ)
    return both(GGUFKernel.PER_TOKEN)


# -- the warm-up: the token counts that compile every kernel variant ----------------
def specialization(tokens: int) -> int:
    """Which variant of a Triton kernel a product of `tokens` tokens compiles: Triton
    compiles anew for an integer argument equal to 1 or divisible by 16, and a product's
    integer arguments are the token count times powers of two (a row per token and
    expert, top_k 8), so the variant follows the count's factors of two, up to 16 (0 to
    4), and 1 has its own (-1)."""
    return -1 if tokens == 1 else min((tokens & -tokens).bit_length() - 1, 4)


def warmup_counts(choices: Iterable[tuple[int, Hashable]]) -> tuple[int, ...]:
    """The first count of each (choice, specialization) among `choices`, pairs of a
    token count and what its products run, in rising counts: a model run at each
    compiles every kernel variant that any of the counts runs."""
    first: dict[tuple[Hashable, int], int] = {}
    for tokens, choice in choices:
        first.setdefault((choice, specialization(tokens)), tokens)
    return tuple(sorted(first.values()))


@functools.lru_cache(maxsize=256)
def dense_warmup_counts(qweight_type: int, rows: int, first: int, last: int, *,
                        batch_invariant: bool) -> tuple[int, ...]:
    """The token counts in [first, last] that compile every kernel variant of a linear
    product of this type and `rows` outputs (`warmup_counts`)."""
    return warmup_counts((tokens, dense_launch(qweight_type, tokens, rows,
                                               batch_invariant=batch_invariant))
                         for tokens in range(first, last + 1))


@functools.lru_cache(maxsize=256)
def moe_warmup_counts(qweight_type: int, qweight_type2: int, first: int, last: int, *,
                      batch_invariant: bool, marlin: tuple[bool, bool],
                      w1_shape: tuple[int, ...], w2_shape: tuple[int, ...], top_k: int,
                      dtype) -> tuple[int, ...]:
    """The token counts in [first, last] that compile every kernel variant of a layer's
    routed products (`warmup_counts`): their launch, and where the experts are
    dequantized, the tile vLLM's fused MoE takes (it follows the count too). The shapes
    are the GGUF stacks' [experts, rows, bytes]; `dtype` the activations'."""
    from . import moe_prefill

    def choice(tokens: int) -> Hashable:
        launch = moe_launch(qweight_type, qweight_type2, tokens,
                            batch_invariant=batch_invariant, marlin=marlin)
        if launch.gate_up.kernel is GGUFKernel.DEQUANT:
            return launch, moe_prefill.dequant_fused_moe_configs(
                w1_shape, w2_shape, qweight_type, qweight_type2, top_k, dtype, tokens)
        if launch.down.kernel is GGUFKernel.DEQUANT:  # the down product alone (Marlin)
            k = moe_prefill.dequantized_shape(w2_shape, qweight_type2)[2]
            return launch, tuple(sorted(moe_prefill.dequant_moe_product_config(
                w2_shape, k, top_k, tokens).items()))
        return launch

    return warmup_counts((tokens, choice(tokens)) for tokens in range(first, last + 1))


# -- docs/gguf.md's kernel table -----------------------------------------------------
TABLE_MAX_TOKENS = 16384  # the table's counts: 1 to this


def _name(launch: GGUFLaunch) -> str:
    return f"`{launch.kernel.value}`" + (f" ({launch.block_m} rows)" if launch.block_m else "")


def _runs(choice) -> str:
    """`choice(tokens)` over 1..TABLE_MAX_TOKENS as runs: "1-6 a; 7-255 b; 256+ c"."""
    runs: list[list] = []
    for tokens in range(1, TABLE_MAX_TOKENS + 1):
        name = choice(tokens)
        if runs and runs[-1][2] == name:
            runs[-1][1] = tokens
        else:
            runs.append([tokens, tokens, name])
    runs[-1][1] = None
    return "; ".join(f"{first}{'+' if last is None else '' if last == first else f'-{last}'}"
                     f" {name}" for first, last, name in runs)


def _moe_runs(qweight_type: int, qweight_type2: int, marlin=(False, False)) -> str:
    def choice(tokens):
        launch = moe_launch(qweight_type, qweight_type2, tokens, batch_invariant=False,
                            marlin=marlin)
        gate_up, down = _name(launch.gate_up), _name(launch.down)
        return gate_up if gate_up == down else f"{gate_up} / {down}"
    return _runs(choice)


def kernel_table() -> list[str]:
    """docs/gguf.md's table: the kernel of each type's products by token count, dense
    (either side of the MMVQ bound's output rows) and MoE (gate_up and down of that type;
    "a / b": gate_up's / down's), outside batch invariance and Marlin; then the Marlin
    MoE layers. Types whose rows are equal share one."""
    from .utils import KQUANT_TYPES, STANDARD_QUANT_TYPES

    rows: dict[tuple[str, ...], list[str]] = {}
    order = [*sorted(KQUANT_TYPES), *sorted(STANDARD_QUANT_TYPES),
             *sorted(IMATRIX_QUANT_TYPES)]
    for qtype in order:
        cells = tuple(
            _runs(lambda tokens, rows_=rows_: _name(dense_launch(
                qtype, tokens, rows_, batch_invariant=False)))
            for rows_ in (TABLE.mmvq_wide_rows, TABLE.mmvq_wide_rows + 1)
        ) + (_moe_runs(int(qtype), int(qtype)),)
        rows.setdefault(cells, []).append(T(qtype).name)
    lines = [f"| type | dense, up to {TABLE.mmvq_wide_rows} output rows | dense, more rows "
             "| MoE |", "|---|---|---|---|"]
    lines += [f"| {', '.join(names)} | {' | '.join(cells)} |" for cells, names in rows.items()]
    lines += [
        "| any quantized type, `VLLM_BATCH_INVARIANT=1` | 1+ `batch_invariant` "
        "| 1+ `batch_invariant` | 1+ `batch_invariant` |",
    ]
    for down in (T.Q4_K, T.Q6_K, T.Q5_K):
        marlin = (True, down == T.Q4_K)
        lines.append(f"| Q4_K gate_up, {down.name} down: Marlin MoE (default, "
                     f"SM{TABLE.marlin_min_capability}+) | | | "
                     f"{_moe_runs(Q4_K, int(down), marlin)} |")
    return lines


if __name__ == "__main__":
    print("\n".join(kernel_table()))
