# SPDX-License-Identifier: Apache-2.0
"""What the installed vLLM's Marlin MoE kernels are built for (docs/serving.md, the first
start): a GGUF's Q4_K experts run on them by default, and where a GPU has no code of its
own the CUDA driver compiles their PTX at the first launch of each, before `/health` (the
profiling run) on a new machine. Read with Triton's bundled cuobjdump from the wheel's
`_moe_C` library."""

import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest


def functions_by_arch(cuobjdump: Path, library: Path, pattern: str) -> Counter:
    """Functions whose name matches `pattern` per code kind: "sm_90" (SASS) from
    `cuobjdump -res-usage`, "compute_80" (PTX entries) from `cuobjdump -ptx`."""
    counts: Counter = Counter()
    usage = subprocess.run([str(cuobjdump), "-res-usage", str(library)],
                           capture_output=True, text=True, check=True).stdout
    arch = None
    for line in usage.splitlines():
        if m := re.search(r"arch = (sm_\w+)", line):
            arch = m[1]
        elif (m := re.match(r"\s*Function (\S+):", line)) and re.search(pattern, m[1]):
            counts[arch] += 1
    ptx = subprocess.run([str(cuobjdump), "-ptx", str(library)],
                         capture_output=True, text=True, check=True).stdout
    target = None
    for line in ptx.splitlines():
        if m := re.match(r"\.target (sm_\d+)", line):
            target = "compute_" + m[1][3:]
        elif (m := re.search(r"\.entry (\S+)\(", line)) and re.search(pattern, m[1]):
            counts[target] += 1
    return counts


def test_marlin_moe_has_no_sm90_code():
    """vLLM 0.26.0's Marlin MoE (marlin_moe_wna16) holds SASS for sm_75, sm_80, sm_89 and
    sm_120 and compute_80 PTX: SM90 (H100, H200) and SM100 compile it from PTX at first
    use; SM80-89 run the sm_80/sm_89 code and SM120 its own."""
    import triton
    import vllm

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    library = next(Path(vllm.__file__).parent.glob("_moe_C*.so"), None)
    if library is None or not cuobjdump.exists():
        pytest.skip("no _moe_C library in this vLLM build, or no cuobjdump with Triton")
    counts = functions_by_arch(cuobjdump, library, r"marlin_moe_wna16.*Marlin")
    assert counts["sm_80"] and counts["sm_120"] and counts["compute_80"], counts
    assert not counts["sm_90"] and not counts["sm_90a"] and not counts["sm_100"], counts
